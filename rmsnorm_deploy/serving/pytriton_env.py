"""What PyTriton 0.7 needs from this process to serve correctly; set here so the user never has to.

Two facts measured with ``nvidia-pytriton`` 0.7.0 (Triton 2.51) on CPython 3.11:

- **libpython.** The Python backend's stub (``triton_python_backend_stub``, a separate process
  the server starts per model instance) embeds Python and must load the interpreter's own
  ``libpython3.11.so``. With a pyenv-built Python the dynamic loader finds another one first and
  the model fails to initialize (``'_thread.RLock' object has no attribute
  '_recursion_count'``). PyTriton starts the server with a copy of ``os.environ``, so putting
  this interpreter's ``LIBDIR`` first on ``LD_LIBRARY_PATH`` before the server starts is enough:
  no re-exec is needed.
- **numpy 2.** The stub is built with a pybind11 that reads numpy 1's array descriptor layout;
  with numpy 2 every tensor crossing it is wrong *without an error*: inputs arrive with stride 0
  (every element reads the first one) and outputs with 0 bytes. PyTriton's proxy model (the
  Python file the stub runs) converts with ``Tensor.as_numpy()`` and ``Tensor(name, array)``;
  :func:`patch_proxy_for_numpy2` makes the copy PyTriton loads into the server exchange tensors
  through DLPack instead (``Tensor.to_dlpack`` / ``Tensor.from_dlpack``), which involves no numpy
  ABI. PyTriton's own package is left untouched. The serving tests check the values bit for
  bit, so a PyTriton that changes this code fails them loudly rather than serving zeros.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

#: Appended to PyTriton's proxy ``model.py`` (runs inside the stub, where ``pb_utils``,
#: ``json``, ``Request`` and ``TritonRequestsServer`` are the module's own names).
_PROXY_PATCH = '''

# --- rmsnorm_deploy: tensors cross the stub through DLPack (the stub's pybind11 predates numpy 2) ---
import ctypes as _ctypes

import numpy as _np

_api = _ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = _ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [_ctypes.py_object, _ctypes.c_char_p]
_api.PyCapsule_SetName.argtypes = [_ctypes.py_object, _ctypes.c_char_p]
_api.PyCapsule_New.restype = _ctypes.py_object
_api.PyCapsule_New.argtypes = [_ctypes.c_void_p, _ctypes.c_char_p, _ctypes.c_void_p]


class _DLPackCapsule:
    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU, device 0


def _tensor_as_numpy(tensor):
    return _np.from_dlpack(_DLPackCapsule(tensor.to_dlpack()))


def _tensor_from_numpy(name, array):
    # The stub reads the capsule with an unnamed PyCapsule_GetPointer: hand it the same
    # DLManagedTensor in an unnamed capsule, and mark numpy's as consumed (ownership moves:
    # the stub calls the tensor's deleter, which releases the array).
    capsule = _np.ascontiguousarray(array).__dlpack__()
    pointer = _api.PyCapsule_GetPointer(capsule, b"dltensor")
    _api.PyCapsule_SetName(capsule, b"used_dltensor")
    return pb_utils.Tensor.from_dlpack(name, _api.PyCapsule_New(pointer, None, None))


def _wrap_request_dlpack(self, triton_request, inputs, span=None):
    request = {}
    for input_name in inputs:
        input_tensor = pb_utils.get_input_tensor_by_name(triton_request, input_name)
        if input_tensor is not None:
            request[input_name] = _tensor_as_numpy(input_tensor)
    kwargs = {} if span is None else {"span": span}
    return Request(data=request, parameters=json.loads(triton_request.parameters()),
                   requested_output_names=list(triton_request.requested_output_names()), **kwargs)


def _wrap_response(response, requested_outputs_names, model_outputs_dict):
    if response.data is None:
        return None
    tensors = []
    for key, value in response.data.items():
        if key in requested_outputs_names:
            dtype = pb_utils.triton_string_to_numpy(model_outputs_dict[key]["data_type"])
            tensors.append(_tensor_from_numpy(key, value.astype(dtype, copy=False)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


TritonRequestsServer._wrap_request = _wrap_request_dlpack
'''
_MARK = "_rmsnorm_deploy_dlpack"


def numpy_needs_dlpack() -> bool:
    """True when numpy's array ABI is not the one the stub was built for (numpy 2 or newer)."""
    return int(np.__version__.split(".")[0]) >= 2


def libpython_dir() -> str | None:
    """This interpreter's ``LIBDIR`` when it holds a shared libpython, else ``None``."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and sysconfig.get_config_var("Py_ENABLE_SHARED") and Path(libdir).is_dir():
        return str(libdir)
    return None


def server_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment changes the server needs (``LD_LIBRARY_PATH`` with this Python's ``LIBDIR`` first)."""
    env = os.environ if environ is None else environ
    libdir = libpython_dir()
    if not libdir:
        return {}
    parts = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    if parts[:1] == [libdir]:
        return {}
    return {"LD_LIBRARY_PATH": ":".join([libdir] + [p for p in parts if p != libdir])}


def prepare_process() -> dict[str, str]:
    """Apply :func:`server_environment` to ``os.environ`` and the numpy-2 patch; return what changed."""
    changes = server_environment()
    os.environ.update(changes)
    if numpy_needs_dlpack():
        patch_proxy_for_numpy2()
    return changes


def patch_proxy_for_numpy2() -> None:
    """Make the proxy model PyTriton loads into the server exchange tensors through DLPack (idempotent)."""
    from pytriton.models import model as pytriton_model

    cls = pytriton_model.Model
    if getattr(cls.get_proxy_model_files, _MARK, False):
        return
    original = cls.get_proxy_model_files

    def get_proxy_model_files(self):
        files = original(self)
        key = f"file:{self.model_version}/model.py"
        if key not in files:
            raise RuntimeError(f"PyTriton's proxy files changed ({sorted(files)}): this PyTriton version is not the one "
                               "rmsnorm-deploy serves with (nvidia-pytriton 0.7)")
        files[key] = files[key] + _PROXY_PATCH.encode()
        return files

    setattr(get_proxy_model_files, _MARK, True)
    cls.get_proxy_model_files = get_proxy_model_files
