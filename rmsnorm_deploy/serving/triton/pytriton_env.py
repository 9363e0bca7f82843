"""What PyTriton 0.7 needs from this process to serve correctly; set here so the user never has to.

Three facts measured with ``nvidia-pytriton`` 0.7.0 (Triton 2.51) on CPython 3.11:

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
  :func:`patch_proxy` makes the copy PyTriton loads into the server exchange tensors
  through DLPack instead (``Tensor.to_dlpack`` / ``Tensor.from_dlpack``), which involves no numpy
  ABI. PyTriton's own package is left untouched. The serving tests check the values bit for
  bit, so a PyTriton that changes this code fails them loudly rather than serving zeros.
- **Error codes.** PyTriton turns any exception of an infer function into Triton's default
  error code (HTTP 500, gRPC ``INTERNAL``) with the whole traceback as the message, so a client
  cannot tell its own mistake from a server fault. The Python backend can answer one request
  with ``pb_utils.TritonError(message, code=pb_utils.TritonError.INVALID_ARG)``, which Triton
  sends as HTTP 400 / gRPC ``INVALID_ARGUMENT``. An infer function refuses a request by answering
  it with :func:`refusal` (one output, :data:`REFUSED`, holding the one-line message as UTF-8
  bytes); :func:`patch_proxy` turns that answer into such an error response, in plain and in
  decoupled (streaming) models alike, with the error code the refusal names
  (:data:`REFUSAL_CODES`: INVALID_ARG, UNAVAILABLE for a full queue or a server that is stopping,
  INTERNAL for a failed generation step, each with its one-line message). Exceptions still travel
  PyTriton's way: a genuine fault stays a 500.
- **Many requests per instance.** Triton hands a non-decoupled model instance its next request
  only when ``execute`` returns, and PyTriton's proxy waits there for the answer: one generation
  at a time, whatever the engine behind could batch. For the models named in
  :func:`prepare_process` (``answer_later``), the proxy takes its decoupled path instead:
  ``execute`` returns at once and the one answer goes through the request's response sender
  (the Python backend allows that for non-decoupled models: one response, then the final flag).
- **Cancellation.** PyTriton never tells an infer function that Triton cancelled a request (a
  gRPC client that closed its stream). For the same models the proxy numbers each request (the
  request parameter :data:`REQUEST_NUMBER`), watches ``is_cancelled()`` of the requests in flight
  and, when one is cancelled, sends the infer function a request holding only :data:`CANCELLED`
  (that number), answered by nobody: the infer function cancels that request's generation.
  Triton releases a request with its final response, so nothing asks about it after that
  (asking crashed Triton 2.51 with a segmentation fault in ``ResponseFactoryIsCancelled``).
- **Small tensors.** PyTriton passes tensors between this process and the stub through its
  TensorStore (shared memory handed out by a manager process) unless ``PYTRITON_NO_TENSORSTORE``
  is set (base64 in the message). For a generation model's one-token responses the store is the
  cost: 16 streams of the tiny Llama spent 1.2 ms of CPU per token in the transport with it and
  0.4 ms without (3.4x the tokens per second), so :func:`prepare_process` turns it off when it
  serves generation models; a plain model's large tensors keep it.

The proxy's changes are written in ``proxy_patch.py``, a module of this package like any other
(read by the linters, imported by the tests); what is appended to PyTriton's proxy ``model.py`` is
only the few lines that load that file by its path in the stub and apply it
(:func:`proxy_patch`). PyTriton's own package is left untouched.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np

from rmsnorm_deploy.serving.triton import proxy_patch as patch_module
from rmsnorm_deploy.serving.triton.proxy_patch import CANCELLED, REFUSED, REFUSED_CODE, REQUEST_NUMBER

__all__ = ["CANCELLED", "NO_TENSORSTORE", "REFUSAL_CODES", "REFUSED", "REFUSED_CODE", "REQUEST_NUMBER",
           "libpython_dir", "numpy_needs_dlpack", "patch_proxy", "prepare_process", "proxy_patch", "refusal",
           "server_environment"]

#: Refusal kinds: the Python backend's error code, and what a client sees.
REFUSAL_CODES = {
    "invalid": ("INVALID_ARG", "HTTP 400, gRPC INVALID_ARGUMENT"),
    "unavailable": ("UNAVAILABLE", "HTTP 503, gRPC UNAVAILABLE"),
    "internal": ("INTERNAL", "HTTP 500, gRPC INTERNAL"),
}
#: PyTriton's switch from its shared-memory TensorStore to base64 messages (both sides read it).
NO_TENSORSTORE = "PYTRITON_NO_TENSORSTORE"
#: Model names whose proxy answers later and reports cancellations (see :func:`prepare_process`).
_ANSWER_LATER: set[str] = set()
_MARK = "_rmsnorm_deploy_patched"


def refusal(message: str, kind: str = "invalid") -> dict[str, np.ndarray]:
    """An infer function's answer to a request it refuses: the client gets the error of ``kind``
    (:data:`REFUSAL_CODES`; by default HTTP 400 / gRPC ``INVALID_ARGUMENT``) with ``message`` on
    one line, and the server keeps serving."""
    code = REFUSAL_CODES[kind][0]
    return {REFUSED: np.frombuffer(" ".join(message.split()).encode("utf-8"), dtype=np.uint8).copy(),
            REFUSED_CODE: np.frombuffer(code.encode("ascii"), dtype=np.uint8).copy()}


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


def prepare_process(answer_later: Iterable[str] = ()) -> dict[str, str]:
    """Apply :func:`server_environment` to ``os.environ`` and the proxy patch; return what changed.
    The models named in ``answer_later`` answer through their requests' senders and report
    cancelled requests (see the module docstring)."""
    changes = server_environment()
    _ANSWER_LATER.update(answer_later)
    if _ANSWER_LATER and not os.environ.get(NO_TENSORSTORE):
        changes[NO_TENSORSTORE] = "1"  # generation models: one-token tensors (see the module docstring)
    os.environ.update(changes)
    patch_proxy()
    return changes


def proxy_patch(*, dlpack: bool, answer_later: bool = False) -> str:
    """What is appended to PyTriton's proxy ``model.py``: the lines that load ``proxy_patch.py`` (a
    module of this package, by its path) and apply the DLPack exchange (numpy 2), the refusals,
    and for ``answer_later`` models the sender path and the cancellation notices."""
    return patch_module.loader(dlpack=dlpack, answer_later=answer_later)


def patch_proxy() -> None:
    """Make the proxy model PyTriton loads into the server answer a :func:`refusal` with INVALID_ARG
    and, under numpy 2, exchange tensors through DLPack (idempotent)."""
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
        patch = proxy_patch(dlpack=numpy_needs_dlpack(), answer_later=self.model_name in _ANSWER_LATER)
        files[key] = files[key] + patch.encode()
        return files

    setattr(get_proxy_model_files, _MARK, True)
    cls.get_proxy_model_files = get_proxy_model_files
