"""What ``serve`` changes in PyTriton's proxy model, the ``model.py`` that Triton's Python-backend stub
runs for each bound model (``pytriton_env`` says why each change is needed).

This file runs in two places. In the ``serve`` process it is an ordinary module of this package:
``pytriton_env`` reads its constants and its path. In the stub it is loaded from that path by the
few lines :func:`loader` appends to PyTriton's proxy ``model.py`` (it imports nothing of this
package: the stub has none of it loaded), and :func:`apply` is called with the proxy module's
namespace, whose names (``pb_utils``, ``json``, ``Request``, ``TritonRequestsServer``,
``TritonPythonModel``, ``DecoupledResponsesHandler``, ``PyTritonResponseFlags``) the functions
here use as their own; PyTriton's code calls ``_wrap_response`` from that namespace, which
:func:`apply` rebinds.

- **DLPack** (numpy 2): tensors cross the stub through ``Tensor.to_dlpack`` / ``from_dlpack``
  instead of the numpy ABI the stub's pybind11 predates.
- **Refusals**: an answer holding :data:`REFUSED` becomes the Triton error its :data:`REFUSED_CODE`
  names (default ``INVALID_ARG``).
- **Answer later** (generation models): ``execute`` returns at once, each answer goes through its
  request's sender, and a request Triton cancelled is reported to the infer function as a request
  holding only :data:`CANCELLED` (its number, the request parameter :data:`REQUEST_NUMBER`).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

#: The output an infer function answers a refused request with (``pytriton_env.refusal``).
REFUSED = "rmsnorm_deploy_refused"
#: The second output of a refusal: the name of the Triton error code it becomes.
REFUSED_CODE = "rmsnorm_deploy_refused_code"
#: The request parameter holding the proxy's number of a request (answer-later models).
REQUEST_NUMBER = "rmsnorm_deploy_request"
#: The only input of the proxy's notice that Triton cancelled the request of that number.
CANCELLED = "rmsnorm_deploy_cancelled"
#: The proxy module's names this module uses, set by :func:`apply` (``None`` outside the stub).
PROXY_NAMES = ("pb_utils", "Request", "TritonRequestsServer", "TritonPythonModel", "DecoupledResponsesHandler",
               "PyTritonResponseFlags")
pb_utils: Any = None
Request: Any = None
TritonRequestsServer: Any = None
TritonPythonModel: Any = None
DecoupledResponsesHandler: Any = None
PyTritonResponseFlags: Any = None
#: the proxy module's namespace itself (its ``_wrap_response`` is looked up there, as PyTriton's code does)
_proxy: dict[str, Any] = {}


def loader(*, dlpack: bool, answer_later: bool) -> str:
    """The lines appended to PyTriton's proxy ``model.py``: load this file by its path, apply it."""
    return (f"\n\n# --- rmsnorm_deploy: the proxy's changes live in {Path(__file__).name} (serving/triton) ---\n"
            "import importlib.util as _rd_util\n"
            f"_rd_spec = _rd_util.spec_from_file_location('rmsnorm_deploy_proxy_patch', {str(Path(__file__))!r})\n"
            "_rd_patch = _rd_util.module_from_spec(_rd_spec)\n"
            "_rd_spec.loader.exec_module(_rd_patch)\n"
            f"_rd_patch.apply(globals(), dlpack={dlpack!r}, answer_later={answer_later!r})\n")


def apply(proxy: dict[str, Any], *, dlpack: bool, answer_later: bool) -> None:
    """Change the proxy module whose namespace is ``proxy`` (see the module docstring)."""
    global _proxy, _wrap_response_before_refusals
    _proxy = proxy
    module = globals()
    for name in PROXY_NAMES:
        module[name] = proxy.get(name)
    if dlpack:
        proxy["TritonRequestsServer"]._wrap_request = _wrap_request_dlpack
        proxy["_wrap_response"] = _wrap_response_dlpack
    _wrap_response_before_refusals = proxy["_wrap_response"]
    proxy["_wrap_response"] = _wrap_response_refused
    if answer_later:
        _answer_later(proxy)


# -- DLPack: tensors cross the stub without the numpy ABI ------------------------------------------------

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _DLPackCapsule:
    def __init__(self, capsule: Any):
        self._capsule = capsule

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU, device 0


def tensor_as_numpy(tensor: Any) -> np.ndarray:
    return np.from_dlpack(_DLPackCapsule(tensor.to_dlpack()))


def tensor_from_numpy(name: str, array: np.ndarray) -> Any:
    # The stub reads the capsule with an unnamed PyCapsule_GetPointer: hand it the same
    # DLManagedTensor in an unnamed capsule, and mark numpy's as consumed (ownership moves:
    # the stub calls the tensor's deleter, which releases the array).
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # DLPack exports writeable arrays only (base64-decoded ones are not)
        array = array.copy()
    capsule = array.__dlpack__()
    pointer = _api.PyCapsule_GetPointer(capsule, b"dltensor")
    _api.PyCapsule_SetName(capsule, b"used_dltensor")
    return pb_utils.Tensor.from_dlpack(name, _api.PyCapsule_New(pointer, None, None))


def _wrap_request_dlpack(self: Any, triton_request: Any, inputs: Any, span: Any = None) -> Any:
    request = {}
    for input_name in inputs:
        input_tensor = pb_utils.get_input_tensor_by_name(triton_request, input_name)
        if input_tensor is not None:
            request[input_name] = tensor_as_numpy(input_tensor)
    kwargs = {} if span is None else {"span": span}
    return Request(data=request, parameters=json.loads(triton_request.parameters()),
                   requested_output_names=list(triton_request.requested_output_names()), **kwargs)


def _wrap_response_dlpack(response: Any, requested_outputs_names: Any, model_outputs_dict: Any) -> Any:
    if response.data is None:
        return None
    tensors = []
    for key, value in response.data.items():
        if key in requested_outputs_names:
            dtype = pb_utils.triton_string_to_numpy(model_outputs_dict[key]["data_type"])
            tensors.append(tensor_from_numpy(key, value.astype(dtype, copy=False)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


# -- refusals: an answer holding REFUSED is the Triton error it names --------------------------------------

_wrap_response_before_refusals: Any = None


def _wrap_response_refused(response: Any, requested_outputs_names: Any, model_outputs_dict: Any) -> Any:
    if response.data is not None and REFUSED in response.data:
        message = response.data[REFUSED].tobytes().decode("utf-8", "replace")
        code = response.data.get(REFUSED_CODE)
        code = "INVALID_ARG" if code is None else code.tobytes().decode("ascii", "replace")
        return pb_utils.InferenceResponse(
            output_tensors=[], error=pb_utils.TritonError(message, code=getattr(pb_utils.TritonError, code)))
    return _wrap_response_before_refusals(response, requested_outputs_names, model_outputs_dict)


# -- answer later: execute returns at once, answers go through each request's sender ----------------------

_numbers = itertools.count(1)
_number_of: dict[int, int] = {}  # id(Triton request) -> its number, from wrapping to the start of its responses
_model: list[Any] = []  # this stub's TritonPythonModel
_decoupled: list[bool] = []  # whether its model is really decoupled
_initialize: Any = None  # PyTriton's TritonPythonModel.initialize
_wrap_request: Any = None  # TritonRequestsServer._wrap_request before the numbering
_push: Any = None  # PyTriton's TritonRequestsServer.push


def _answer_later(proxy: dict[str, Any]) -> None:
    global _initialize, _wrap_request, _push
    _initialize = TritonPythonModel.initialize
    _wrap_request = TritonRequestsServer._wrap_request
    _push = TritonRequestsServer.push
    TritonPythonModel.initialize = _initialize_answer_later
    TritonRequestsServer.push = _push_sent
    TritonRequestsServer._wrap_request = _wrap_request_numbered
    DecoupledResponsesHandler.handle_responses = _respond


def _initialize_answer_later(self: Any, args: dict[str, Any]) -> None:
    config = json.loads(args["model_config"])
    policy = config.setdefault("model_transaction_policy", {})
    _decoupled.append(bool(policy.get("decoupled", False)))
    policy["decoupled"] = True  # the proxy's sender path: execute returns at once
    _initialize(self, dict(args, model_config=json.dumps(config)))
    _model.append(self)


def _answers(self: Any, triton_requests: list[Any], flags: int, payload: bytes) -> list[Any] | None:
    """The Triton responses of one message from the inference handler (None for a bare end of stream)."""
    error = flags & PyTritonResponseFlags.ERROR
    try:
        if error:
            message = payload.decode("utf-8")
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(message)) for _ in triton_requests]
        if payload:
            responses = self._serializer_deserializer.deserialize_responses(payload)
            wrap = _proxy["_wrap_response"]
            return [wrap(response, request.requested_output_names(), self._model_outputs_dict)
                    for request, response in zip(triton_requests, responses)]
        return None
    finally:
        if not error:
            self._serializer_deserializer.free_responses_resources(payload)


async def _respond(self: Any, scope: dict[str, Any], responses_queue: Any, responses_future: Any) -> None:
    """The responses of one batch of requests through their senders. A decoupled model's go out as
    they come, then the final flag; a non-decoupled model's one answer goes with the final flag in
    one call (the flag alone after it reads as an empty answer to gRPC clients). The watcher stops
    asking Triton whether a request is cancelled before its final response is sent (the request
    is released with it)."""
    requests_id = scope["requests_id"]
    triton_requests = self._requests_map.get(requests_id, [])
    senders = [request.get_response_sender() for request in triton_requests]
    numbers = [_number_of.pop(id(request), None) for request in triton_requests]
    state = {"final": False}
    watcher = asyncio.ensure_future(_watch(triton_requests, numbers, state))
    loop = asyncio.get_running_loop()
    held = None
    try:
        while True:
            flags, payload = await responses_queue.get()
            try:
                answers = _answers(self, triton_requests, flags, payload)
            finally:
                responses_queue.task_done()
            eos = flags & PyTritonResponseFlags.EOS
            if answers is not None and _decoupled[0] and not eos:
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


def _wrap_request_numbered(self: Any, triton_request: Any, inputs: Any, span: Any = None) -> Any:
    request = _wrap_request(self, triton_request, inputs, span)
    number = _number_of.setdefault(id(triton_request), next(_numbers))
    request.parameters = dict(request.parameters or {}, **{REQUEST_NUMBER: number})
    return request


async def _tell_cancelled(number: int) -> None:
    model = _model[0]
    requests_id = b"rmsnorm-deploy-cancelled-%d" % number
    model._requests[requests_id] = []  # no Triton request waits for this one's answer
    payload = model._serializer_deserializer.serialize_requests(
        [Request(data={CANCELLED: np.array([number], dtype=np.int64)}, parameters={})])
    await model._requests_server._server.send_requests(requests_id, payload, Future())


async def _watch(triton_requests: list[Any], numbers: list[int | None], state: dict[str, bool]) -> None:
    while any(n is not None for n in numbers):
        await asyncio.sleep(0.05)
        for index, request in enumerate(triton_requests):
            if state["final"]:  # checked right before each call, in the thread that sends the final flag
                return
            if numbers[index] is not None and request.is_cancelled():
                number, numbers[index] = numbers[index], None
                await _tell_cancelled(number)


def _push_sent(self: Any, requests_id: Any, triton_requests: Any, spans: Any = None) -> Any:
    """``execute`` returns once the inputs are copied out: the backend frees a request's input tensors
    when ``execute`` returns (the proxy's decoupled path would read them later)."""
    future = _push(self, requests_id, triton_requests, spans)
    future.result()
    return future
