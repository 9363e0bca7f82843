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
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np

#: The output an infer function answers a refused request with (see :func:`refusal`).
REFUSED = "rmsnorm_deploy_refused"
#: The second output of a refusal: the name of the Triton error code it becomes.
REFUSED_CODE = "rmsnorm_deploy_refused_code"
#: Refusal kinds: the Python backend's error code, and what a client sees.
REFUSAL_CODES = {
    "invalid": ("INVALID_ARG", "HTTP 400, gRPC INVALID_ARGUMENT"),
    "unavailable": ("UNAVAILABLE", "HTTP 503, gRPC UNAVAILABLE"),
    "internal": ("INTERNAL", "HTTP 500, gRPC INTERNAL"),
}
#: The request parameter holding the proxy's number of a request (answer-later models).
REQUEST_NUMBER = "rmsnorm_deploy_request"
#: The only input of the proxy's notice that Triton cancelled the request of that number.
CANCELLED = "rmsnorm_deploy_cancelled"
#: PyTriton's switch from its shared-memory TensorStore to base64 messages (both sides read it).
NO_TENSORSTORE = "PYTRITON_NO_TENSORSTORE"
#: Model names whose proxy answers later and reports cancellations (see :func:`prepare_process`).
_ANSWER_LATER: set[str] = set()

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
    array = _np.ascontiguousarray(array)
    if not array.flags.writeable:  # DLPack exports writeable arrays only (base64-decoded ones are not)
        array = array.copy()
    capsule = array.__dlpack__()
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

#: Appended after the DLPack patch, always: a :func:`refusal` answer becomes an INVALID_ARG error.
_REFUSAL_PATCH = '''

# --- rmsnorm_deploy: a refused request comes back as the error its refusal names (default INVALID_ARG) ---
_rmsnorm_deploy_wrap_response = _wrap_response


def _wrap_response(response, requested_outputs_names, model_outputs_dict):
    if response.data is not None and "@REFUSED@" in response.data:
        message = response.data["@REFUSED@"].tobytes().decode("utf-8", "replace")
        code = response.data.get("@REFUSED_CODE@")
        code = "INVALID_ARG" if code is None else code.tobytes().decode("ascii", "replace")
        return pb_utils.InferenceResponse(
            output_tensors=[], error=pb_utils.TritonError(message, code=getattr(pb_utils.TritonError, code)))
    return _rmsnorm_deploy_wrap_response(response, requested_outputs_names, model_outputs_dict)
'''.replace("@REFUSED@", REFUSED).replace("@REFUSED_CODE@", REFUSED_CODE)

#: Appended last for the models named in ``prepare_process(answer_later=...)`` (see the module docstring).
_ANSWER_LATER_PATCH = '''

# --- rmsnorm_deploy: answer through each request's sender (execute returns at once) and report cancellations ---
import itertools as _rd_itertools
from concurrent.futures import Future as _RdFuture

import numpy as _rd_np

_rd_numbers = _rd_itertools.count(1)
_rd_number_of = {}  # id(Triton request) -> its number, from wrapping to the start of its responses
_rd_model = []  # this stub's TritonPythonModel
_rd_decoupled = []  # whether its model is really decoupled
_rd_initialize = TritonPythonModel.initialize


def _rd_initialize_answer_later(self, args):
    config = json.loads(args["model_config"])
    policy = config.setdefault("model_transaction_policy", {})
    _rd_decoupled.append(bool(policy.get("decoupled", False)))
    policy["decoupled"] = True  # the proxy's sender path: execute returns at once
    _rd_initialize(self, dict(args, model_config=json.dumps(config)))
    _rd_model.append(self)


def _rd_answers(self, triton_requests, flags, payload):
    # The Triton responses of one message from the inference handler (None for a bare end of stream).
    error = flags & PyTritonResponseFlags.ERROR
    try:
        if error:
            message = payload.decode("utf-8")
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(message)) for _ in triton_requests]
        if payload:
            responses = self._serializer_deserializer.deserialize_responses(payload)
            return [_wrap_response(response, request.requested_output_names(), self._model_outputs_dict)
                    for request, response in zip(triton_requests, responses)]
        return None
    finally:
        if not error:
            self._serializer_deserializer.free_responses_resources(payload)


async def _rd_respond(self, scope, responses_queue, responses_future):
    # The responses of one batch of requests through their senders. A decoupled model's go out as
    # they come, then the final flag; a non-decoupled model's one answer goes with the final flag in
    # one call (the flag alone after it reads as an empty answer to gRPC clients). The watcher stops
    # asking Triton whether a request is cancelled before its final response is sent (the request
    # is released with it).
    requests_id = scope["requests_id"]
    triton_requests = self._requests_map.get(requests_id, [])
    senders = [request.get_response_sender() for request in triton_requests]
    numbers = [_rd_number_of.pop(id(request), None) for request in triton_requests]
    state = {"final": False}
    watcher = asyncio.ensure_future(_rd_watch(triton_requests, numbers, state))
    loop = asyncio.get_running_loop()
    held = None
    try:
        while True:
            flags, payload = await responses_queue.get()
            try:
                answers = _rd_answers(self, triton_requests, flags, payload)
            finally:
                responses_queue.task_done()
            eos = flags & PyTritonResponseFlags.EOS
            if answers is not None and _rd_decoupled[0] and not eos:
                await asyncio.gather(*(loop.run_in_executor(None, sender.send, answer, 0)
                                       for sender, answer in zip(senders, answers)))
            elif answers is not None:
                held = answers
            if eos:
                break
        state["final"] = True  # set in this loop's thread before any final send starts
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        await asyncio.gather(*(loop.run_in_executor(None, sender.send, answer, final)
                               for sender, answer in zip(senders, held or [None] * len(senders))))
    finally:
        state["final"] = True
        watcher.cancel()
        self._requests_map.pop(requests_id, None)
        if not responses_future.done():
            responses_future.set_result(None)


_rd_wrap_request = TritonRequestsServer._wrap_request


def _rd_wrap_request_numbered(self, triton_request, inputs, span=None):
    request = _rd_wrap_request(self, triton_request, inputs, span)
    number = _rd_number_of.setdefault(id(triton_request), next(_rd_numbers))
    request.parameters = dict(request.parameters or {}, @NUMBER@=number)
    return request


async def _rd_tell_cancelled(number):
    model = _rd_model[0]
    requests_id = b"rmsnorm-deploy-cancelled-%d" % number
    model._requests[requests_id] = []  # no Triton request waits for this one's answer
    payload = model._serializer_deserializer.serialize_requests(
        [Request(data={"@CANCELLED@": _rd_np.array([number], dtype=_rd_np.int64)}, parameters={})])
    await model._requests_server._server.send_requests(requests_id, payload, _RdFuture())


async def _rd_watch(triton_requests, numbers, state):
    while any(n is not None for n in numbers):
        await asyncio.sleep(0.05)
        for index, request in enumerate(triton_requests):
            if state["final"]:  # checked right before each call, in the thread that sends the final flag
                return
            if numbers[index] is not None and request.is_cancelled():
                number, numbers[index] = numbers[index], None
                await _rd_tell_cancelled(number)


_rd_push = TritonRequestsServer.push


def _rd_push_sent(self, requests_id, triton_requests, spans=None):
    # execute returns once the inputs are copied out: the backend frees a request's input tensors
    # when execute returns (the proxy's decoupled path would read them later)
    future = _rd_push(self, requests_id, triton_requests, spans)
    future.result()
    return future


TritonPythonModel.initialize = _rd_initialize_answer_later
TritonRequestsServer.push = _rd_push_sent
TritonRequestsServer._wrap_request = _rd_wrap_request_numbered
DecoupledResponsesHandler.handle_responses = _rd_respond
'''.replace("@NUMBER@", REQUEST_NUMBER).replace("@CANCELLED@", CANCELLED)
_MARK = "_rmsnorm_deploy_dlpack"


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
    """What is appended to PyTriton's proxy ``model.py``: the DLPack exchange (numpy 2), the
    refusals, and for ``answer_later`` models the sender path and the cancellation notices."""
    return (_PROXY_PATCH if dlpack else "") + _REFUSAL_PATCH + (_ANSWER_LATER_PATCH if answer_later else "")


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
