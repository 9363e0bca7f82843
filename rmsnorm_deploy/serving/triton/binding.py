"""PyTriton's infer functions of ``serve``'s models, and what the fronts check their requests against.

:class:`BatchedInference` runs a plain graph's batches through the ONNX Runtime runner;
:class:`GenerationInference` and its decoupled twin :class:`StreamingGenerationInference` submit a
KV-cache graph's requests to the generation engine (``serving.engine.submit``) and answer them with
its tokens, or with the refusal (``triton.pytriton_env.refusal``) whose Triton error code
:data:`TRITON_KINDS` maps from the engine's outcome. :func:`served_models` is what the fronts check
each served model's requests against: the same tensors Triton is given.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import numpy as np

from rmsnorm_deploy.decoder.generate import KVCacheModel
from rmsnorm_deploy.errors import InputError
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_file import load_onnx
from rmsnorm_deploy.serving.engine.submit import Refusal, ending, submit_generation
from rmsnorm_deploy.serving.kserve.generation import (
    GENERATION_INPUTS,
    GENERATION_OUTPUT,
    STREAM_INDEX,
    STREAM_SUFFIX,
    parse_generation_request,
)
from rmsnorm_deploy.serving.kserve.request_check import ExpectedInput, Refused, ServedModel, numpy_check
from rmsnorm_deploy.serving.kserve.signature import Signature, TensorSpec
from rmsnorm_deploy.serving.triton.pytriton_env import CANCELLED, REQUEST_NUMBER, refusal
from rmsnorm_deploy.validate.feeds import check_token_ids, token_bounds

#: the engine's outcome (``serving.engine.submit``) -> the refusal kind of ``pytriton_env.refusal``
TRITON_KINDS = {"invalid": "invalid", "busy": "unavailable", "unavailable": "unavailable",
                "cancelled": "unavailable", "failed": "internal"}


def triton_refusal(outcome: Refusal) -> dict[str, np.ndarray]:
    """The infer function's answer to a generation the engine refused or ended early."""
    return refusal(outcome.message, TRITON_KINDS[outcome.kind])


class BatchedInference:
    """PyTriton's infer function: the requests of one batch, run through the runner, split back.

    Triton's dynamic batcher hands over requests whose non-batch dims may still differ (a
    sequence of 9 tokens and one of 12): those are grouped by shape, each group stacked along
    the batch dim and run once, each request answered with its own rows. Rows are computed the
    same way alone or stacked (the serving tests check this bit for bit).
    """

    def __init__(self, runner: Any, signature: Signature, served: ServedModel | None = None,
                 token_bounds: dict[str, int] | None = None):
        self.runner = runner
        self.signature = signature
        self.input_names = [t.name for t in signature.inputs]
        self.lock = threading.Lock()
        self.served = served
        self.token_bounds = token_bounds or {}

    def __call__(self, requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        feeds = [{name: np.asarray(request[name]) for name in self.input_names} for request in requests]
        results: list[dict[str, np.ndarray] | None] = [self.refusal(feed) for feed in feeds]
        if not self.signature.batched:
            return [result or self._run(feed) for result, feed in zip(results, feeds)]
        groups: dict[tuple, list[int]] = {}
        for index, feed in enumerate(feeds):
            if results[index] is not None:
                continue
            key = tuple((name, feed[name].dtype.str, feed[name].shape[1:]) for name in self.input_names)
            groups.setdefault(key, []).append(index)
        for members in groups.values():
            if len(members) == 1:
                results[members[0]] = self._run(feeds[members[0]])
                continue
            stacked = {name: np.concatenate([feeds[i][name] for i in members]) for name in self.input_names}
            outputs = self._run(stacked)
            start = 0
            for i in members:
                rows = len(feeds[i][self.input_names[0]])
                results[i] = {k: v[start:start + rows] for k, v in outputs.items()}
                start += rows
        return [r for r in results if r is not None]

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            return self.runner.infer(feed)

    def refusal(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The refusal (HTTP 400, one line) of a request the model cannot answer, else ``None``: dims
        outside the model's ranges (an empty sequence), token ids outside the vocabulary (ONNX
        ``Gather`` would wrap a negative one round to the table's end and answer 200)."""

        try:
            if self.served is not None:
                numpy_check(self.served, feed)
            check_token_ids(feed, self.token_bounds)
        except (Refused, InputError) as exc:
            return refusal(str(exc))
        return None


class GenerationInference:
    """PyTriton's infer function for a KV-cache graph's whole answers: each request goes to the
    generation engine (``serving.engine.engine``) and is answered when its stream ends.

    ``input_ids`` INT64 [n] is one prompt; ``max_new_tokens`` INT64 [1] is optional (default
    :data:`~rmsnorm_deploy.decoder.generate.DEFAULT_MAX_NEW_TOKENS`); ``output_ids`` INT64 [m] are
    the new tokens, greedy, ending at the folder's end-of-sequence token if one comes: the tokens
    ``generate(model, [prompt])`` returns, whatever else the engine runs meanwhile. Nothing is
    locked across a generation: the function awaits its stream in PyTriton's event loop, so the
    model's instance takes the next request at once (its proxy answers through the request's
    sender: ``pytriton_env``'s ``answer_later``).

    Refused (:func:`~rmsnorm_deploy.serving.triton.pytriton_env.refusal`, one line): a bad request (no
    ``input_ids``, ids outside the vocabulary, too long, ``max_new_tokens`` < 1) with HTTP 400 /
    gRPC ``INVALID_ARGUMENT``; a full queue, a model still warming up or a server that is stopping
    with HTTP 503 / gRPC ``UNAVAILABLE``; a failed generation step with HTTP 500 / gRPC
    ``INTERNAL``. The proxy's notice that Triton cancelled a request cancels its stream.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        #: streams by the proxy's request number, for its cancellation notices
        self.streams: dict[int, Any] = {}

    async def __call__(self, requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        return list(await asyncio.gather(*(self._one(request) for request in requests)))

    async def _one(self, request: Any) -> dict[str, np.ndarray]:
        if self.cancel_notice(request):
            return {}  # nobody waits for this answer
        stream = self.submit(request)
        if isinstance(stream, dict):
            return stream
        try:
            tokens = await stream.result_async()
        except Exception as exc:  # noqa: BLE001 - StreamFailed / StreamCancelled: one line to the client
            return triton_refusal(ending(exc))
        finally:
            self.forget(request)
        return {GENERATION_OUTPUT: np.asarray(tokens, dtype=np.int64)}

    def submit(self, request: Any) -> Any:
        """The request's ``Stream`` in the engine, or the refusal to answer it with."""

        try:
            prompt, max_new_tokens = parse_generation_request(request)
        except InputError as exc:
            return refusal(str(exc))
        stream = submit_generation(self.engine, prompt, max_new_tokens)
        if isinstance(stream, Refusal):
            return triton_refusal(stream)
        number = _request_number(request)
        if number is not None:
            self.streams[number] = stream
        return stream

    def forget(self, request: Any) -> None:
        number = _request_number(request)
        if number is not None:
            self.streams.pop(number, None)

    def cancel_notice(self, request: Any) -> bool:
        """True when ``request`` is the proxy's notice that Triton cancelled requests; their streams
        are cancelled (the engine frees their slots at its next step)."""

        if CANCELLED not in request.keys():
            return False
        for number in np.asarray(request[CANCELLED]).reshape(-1).tolist():
            stream = self.streams.pop(int(number), None)
            if stream is not None:
                stream.cancel()
        return True


class StreamingGenerationInference(GenerationInference):
    """The decoupled twin of :class:`GenerationInference` (model ``<name>_stream``): one response per
    new token as the engine makes it (``output_ids`` INT64 [1], ``index`` INT64 [1]), then Triton's
    final (empty) response. The tokens are those ``generate`` returns for the same request.

    A refused request, and a stream that fails or is cancelled by the server, get one error
    response on the stream (the codes of :class:`GenerationInference`). A client that closes its
    stream is reported by the proxy: its generation is cancelled and its slot freed.
    """

    async def __call__(self, requests: Sequence[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:  # type: ignore[override]
        if len(requests) != 1:  # Triton hands an unbatched model's requests over one by one
            raise RuntimeError(f"the streaming model got {len(requests)} requests at once; it answers one at a time")
        request = requests[0]
        if self.cancel_notice(request):
            return
        stream = self.submit(request)
        if isinstance(stream, dict):
            yield [stream]
            return
        index = 0
        try:
            async for token in stream:
                yield [{GENERATION_OUTPUT: np.array([token], dtype=np.int64),
                        STREAM_INDEX: np.array([index], dtype=np.int64)}]
                index += 1
        except Exception as exc:  # noqa: BLE001 - StreamFailed / StreamCancelled: one line to the client
            yield [triton_refusal(ending(exc))]
        finally:
            self.forget(request)


def _request_number(request: Any) -> int | None:
    number = (getattr(request, "parameters", None) or {}).get(REQUEST_NUMBER)
    return number if isinstance(number, int) else None


def generation_endpoint(path: Path, signature: Signature, providers: Sequence[str]) -> Any:
    """The ``KVCacheModel`` a KV-cache graph is served through, or ``None`` for a stateless graph.

    A KV-cache graph's ``present`` outputs are the next step's ``past`` inputs, so it is not served
    as a stateless model (every client would run its own cache round trip): it becomes a
    generation model (:class:`GenerationInference`) with the same name. Its metadata and inputs
    are checked here, before any port is opened: a graph with past/present pairs but no
    ``kv_cache`` metadata is refused in one line.
    """
    if not signature.is_kv_cache:
        return None

    return KVCacheModel(path, providers)


def pytriton_tensor(spec: TensorSpec, batched: bool):
    from pytriton.model_config import Tensor

    return Tensor(name=spec.name, dtype=np.dtype(spec.dtype), shape=tuple(spec.dims(batched=batched)))


def token_bounds_of(path: Path) -> dict[str, int]:
    """The vocabulary bound of each token-id input (``validate.feeds.token_bounds``: metadata, else
    the embedding table the graph gathers from)."""

    model = load_onnx(path, load_external=False)
    return token_bounds(model, ModelMetadata.read(model))


def served_models(signature: Signature, name: str, *, generation: bool) -> list[ServedModel]:
    """What the fronts check each served model's requests against: the same tensors Triton is given."""
    if generation:
        inputs = tuple(ExpectedInput(n, "INT64", tuple(d if d > 0 else "n" for d in dims))
                       for n, dims, _ in GENERATION_INPUTS)
        return [ServedModel(name, inputs), ServedModel(name + STREAM_SUFFIX, inputs, stream_of=name)]
    inputs = tuple(ExpectedInput(t.name, t.kserve_type, t.shape) for t in signature.inputs)
    ranges = {d: r for d, r in signature.ranges.items() if d != signature.batch_dim}
    return [ServedModel(name, inputs, signature.max_batch if signature.batched else 0, ranges)]

