"""A generation model's KServe interface, and its gRPC token streams answered by the engine in the
gRPC front's own event loop.

A KV-cache graph is served as the model ``<name>`` (whole answers) and its decoupled twin
``<name>_stream`` (one response per token), both over the one engine. ``<name>_stream`` is still a
Triton model (its metadata, config and readiness come from Triton, and a client that reaches
Triton's own port gets the same answers), but a ``ModelStreamInfer`` request for it that reaches the
public gRPC front is answered here: the front submits it to the engine, which lives in the same
process, and writes each token's response itself. So Triton's statistics for ``<name>_stream`` count
only what reached its own port; the engine's counts (``serve``'s last line) count every stream.

Why: through Triton a token crosses four processes (the engine's infer function, PyTriton's proxy in
the Python backend's stub, Triton's gRPC server, the front's relay back to the client). Measured on 2
CPUs with the ~125M Llama and 16 clients streaming 64 tokens each: that transport took a fifth of
the CPU, and tokens/s served fell from the engine's 331 to 255 (``docs/serving.md``). Answered here,
a token costs one protobuf message in the front's loop.

The responses are Triton's, field for field (a test compares both routes' bytes): one
``ModelInferResponse`` per token (``output_ids`` and ``index``, INT64 [1], in ``raw_output_contents``,
the request's ``id``, ``triton_final_response`` false), then, when the request asks for it with
``triton_enable_empty_final_response``, an empty final response. A refused or failed request gets
one ``error_message`` in the stream, as Triton answers a refusal from the model. A client that
closes its stream cancels its generations at once (no notice through Triton's cancellation).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import numpy as np

from rmsnorm_deploy.decoder.generate import DEFAULT_MAX_NEW_TOKENS
from rmsnorm_deploy.errors import InputError, one_line
from rmsnorm_deploy.serving.engine.submit import Refusal, ending, submit_generation

__all__ = ["GENERATION_INPUTS", "GENERATION_OUTPUT", "STREAM_INDEX", "STREAM_SUFFIX", "EngineStreams",
           "parse_generation_request", "request_arrays"]

#: The generation model's interface (a KV-cache graph is served as this, under ``--model-name``).
GENERATION_INPUTS = (("input_ids", [-1], False), ("max_new_tokens", [1], True))  # (name, dims, optional)
GENERATION_OUTPUT = "output_ids"
#: The streaming twin, ``<model name>`` + this suffix: one response per new token.
STREAM_SUFFIX = "_stream"
#: Its second output: the new token's position among the new tokens (0, 1, ...).
STREAM_INDEX = "index"

#: Triton's parameters on a streamed response and on a request that asks for the empty final one
FINAL_PARAMETER = "triton_final_response"
EMPTY_FINAL_PARAMETER = "triton_enable_empty_final_response"


def parse_generation_request(request: Any) -> tuple[list[int], int]:
    """The prompt and ``max_new_tokens`` of one KServe request (``InputError`` when malformed);
    the engine checks them against the model."""

    if "input_ids" not in request.keys():
        raise InputError("the request has no input_ids (the prompt's token ids, INT64 [n])")
    prompt = [int(t) for t in np.asarray(request["input_ids"]).reshape(-1)]
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if "max_new_tokens" in request.keys():
        given = np.asarray(request["max_new_tokens"]).reshape(-1)
        if given.size != 1:
            raise InputError(f"max_new_tokens must hold one number, got {given.size}")
        max_new_tokens = int(given[0])
    return prompt, max_new_tokens


def request_arrays(request: Any) -> dict[str, np.ndarray]:
    """The INT64 inputs of a checked ``ModelInferRequest`` (``request_check`` has matched each one's
    data to its shape and datatype), raw or typed."""
    raw = list(request.raw_input_contents)
    arrays = {}
    for index, tensor in enumerate(request.inputs):
        shape = tuple(int(d) for d in tensor.shape)
        if raw:
            values = np.frombuffer(raw[index], dtype="<i8")
        else:
            values = np.asarray(tensor.contents.int64_contents, dtype=np.int64)
        arrays[tensor.name] = values.reshape(shape)
    return arrays


class EngineStreams:
    """The ``ModelStreamInfer`` answers of one generation model's streaming twin, from ``engine``.

    ``outputs`` are the model's output names in Triton's order (a request may ask for some of them).
    """

    def __init__(self, engine: Any, model_name: str, outputs: tuple[str, str]):
        from tritonclient.grpc import service_pb2  # optional: the gRPC front's own dependency

        self.engine = engine
        self.model_name = model_name
        self.outputs = outputs
        self.pb = service_pb2

    async def answer(self, request: Any) -> AsyncIterator[bytes]:
        """The serialized ``ModelStreamInferResponse`` messages of one request, as they come. Leaving
        the iteration early (a client gone) cancels the generation."""
        wanted = [o.name for o in request.outputs] or list(self.outputs)
        unknown = [name for name in wanted if name not in self.outputs]
        if unknown:  # Triton refuses it before the model sees it: an error and an empty response
            message = f"unexpected inference output '{unknown[0]}' for model '{self.model_name}'"
            yield self.pb.ModelStreamInferResponse(error_message=message,
                                                   infer_response=self.pb.ModelInferResponse()).SerializeToString()
            return
        try:
            prompt, max_new_tokens = parse_generation_request(request_arrays(request))
        except InputError as exc:
            for item in self.refusal(request, str(exc)):
                yield item
            return
        stream = submit_generation(self.engine, prompt, max_new_tokens)
        if isinstance(stream, Refusal):
            for item in self.refusal(request, stream.message):
                yield item
            return
        index = 0
        try:
            async for token in stream:
                yield self.token(request, wanted, token, index)
                index += 1
        except Exception as exc:  # noqa: BLE001 - StreamFailed, StreamCancelled, a fault: one line, the front lives
            for item in self.refusal(request, ending(exc).message):
                yield item
            return
        if _asks_final(request):
            yield self.final(request)

    def _response(self, request: Any, *, final: bool, version: str = "") -> Any:
        response = self.pb.ModelInferResponse(model_name=self.model_name, model_version=version, id=request.id)
        response.parameters[FINAL_PARAMETER].bool_param = final
        return response

    def token(self, request: Any, wanted: list[str], token: int, index: int) -> bytes:
        response = self._response(request, final=False, version="1")
        values = {self.outputs[0]: token, self.outputs[1]: index}
        for name in wanted:
            response.outputs.add(name=name, datatype="INT64", shape=[1])
            response.raw_output_contents.append(np.array([values[name]], dtype="<i8").tobytes())
        return self.pb.ModelStreamInferResponse(infer_response=response).SerializeToString()

    def final(self, request: Any) -> bytes:
        """Triton's empty final response (no version, no outputs)."""
        return self.pb.ModelStreamInferResponse(infer_response=self._response(request, final=True)).SerializeToString()

    def refusal(self, request: Any, message: str) -> list[bytes]:
        """What Triton sends for a request the model refuses: the error, then the final response."""
        error = self.pb.ModelStreamInferResponse(error_message=one_line(message),
                                                 infer_response=self._response(request, final=False))
        return [error.SerializeToString()] + ([self.final(request)] if _asks_final(request) else [])


def _asks_final(request: Any) -> bool:
    parameter = request.parameters.get(EMPTY_FINAL_PARAMETER)
    return parameter is not None and parameter.bool_param
