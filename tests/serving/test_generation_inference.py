"""The generation model's infer functions and ``stream``, in this process (no server): what is
refused (and with which code), a failed step and a cancelled stream, the proxy's cancellation
notice, and that streaming gives ``generate``'s tokens."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from rmsnorm_deploy.decoder.generate import KVCacheModel, generate, stream
from rmsnorm_deploy.errors import InputError
from rmsnorm_deploy.serving.engine.engine import Engine, EngineOptions
from rmsnorm_deploy.serving.triton.pytriton_env import CANCELLED, REFUSED, REFUSED_CODE, REQUEST_NUMBER, refusal
from rmsnorm_deploy.serving.kserve.generation import GENERATION_OUTPUT, STREAM_INDEX
from rmsnorm_deploy.serving.triton.binding import GenerationInference, StreamingGenerationInference

pytest.importorskip("onnxruntime", reason="the generation loop runs in ONNX Runtime")
VOCAB = 512  # the tiny preset's


@pytest.fixture(scope="module")
def model(tiny_kv_export):
    with KVCacheModel(tiny_kv_export) as kv:
        yield kv


@pytest.fixture
def engine(model):
    engine = Engine(model, EngineOptions(max_batch=2, max_queue=1)).start()
    yield engine
    engine.drain(0)


class Request(dict):
    """What PyTriton hands an infer function: the inputs, and the request's parameters."""

    def __init__(self, data, number=None):
        super().__init__(data)
        self.parameters = {} if number is None else {REQUEST_NUMBER: number}


def _whole(infer, request) -> dict:
    return asyncio.run(infer([request]))[0]


def _streamed(infer, request) -> list[list[dict]]:
    async def collect():
        return [answer async for answer in infer([request])]
    return asyncio.run(collect())


def _refused(answer: dict) -> tuple[str, str]:
    assert set(answer) == {REFUSED, REFUSED_CODE} and answer[REFUSED].dtype == np.uint8, answer
    return answer[REFUSED].tobytes().decode(), answer[REFUSED_CODE].tobytes().decode()


@pytest.mark.parametrize("length,max_new_tokens", [(1, 1), (1, 6), (7, 5), (7, 32)])
def test_stream_yields_the_tokens_generate_returns(model, length, max_new_tokens):
    prompt = np.random.default_rng(length).integers(0, VOCAB, length).tolist()
    want = generate(model, [prompt], max_new_tokens=max_new_tokens).tokens[0]
    assert list(stream(model, prompt, max_new_tokens=max_new_tokens)) == want
    assert 1 <= len(want) <= max_new_tokens


@pytest.mark.parametrize("request_,message", [
    ({"max_new_tokens": np.array([3])}, "the request has no input_ids (the prompt's token ids, INT64 [n])"),
    ({"input_ids": np.array([3, -1])}, "token id -1 is outside the model's vocabulary [0, 512)"),
    ({"input_ids": np.array([VOCAB])}, "token id 512 is outside the model's vocabulary [0, 512)"),
    ({"input_ids": np.array([1, 2]), "max_new_tokens": np.array([0])}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"input_ids": np.array([1, 2]), "max_new_tokens": np.array([1, 2])}, "max_new_tokens must hold one number, got 2"),
    ({"input_ids": np.array([1, 2]), "max_new_tokens": np.array([255])},
     "2 prompt tokens + 255 new tokens exceed the model's maximum of 256; lower max_new_tokens to at most 254"),
], ids=["no-prompt", "negative-token", "token-at-vocab-size", "zero-new-tokens", "two-numbers", "over-the-limit"])
def test_bad_requests_are_refused_as_invalid_argument(engine, request_, message):
    assert _refused(_whole(GenerationInference(engine), Request(request_))) == (message, "INVALID_ARG")
    assert [[_refused(a) for a in answers] for answers in _streamed(StreamingGenerationInference(engine),
                                                                    Request(request_))] == [[(message, "INVALID_ARG")]]
    assert engine.stats() == {"running": 0, "waiting": 0}


def test_a_full_queue_is_refused_as_unavailable(engine):
    busy = [engine.submit([1, 2, 3], max_new_tokens=200, eos_token_id=None) for _ in range(3)]  # 2 slots + 1 queued
    message = ("the server is busy: its 2 streams and its queue of 1 are full (--max-batch 2, --max-queue 1); retry later",
               "UNAVAILABLE")
    request = Request({"input_ids": np.array([4, 5])})
    assert _refused(_whole(GenerationInference(engine), request)) == message
    assert [[_refused(a) for a in answers] for answers in _streamed(StreamingGenerationInference(engine),
                                                                    request)] == [[message]]
    for stream_ in busy:
        stream_.cancel()


def test_a_failed_step_is_an_internal_error_in_one_line(engine):
    def broken(binding):
        raise RuntimeError("generation failed: ONNX Runtime failed to run a generation step: out of memory")

    engine.batch.model = _Failing(engine.batch.model)
    answer = _whole(GenerationInference(engine), Request({"input_ids": np.array([1, 2, 3])}))
    assert _refused(answer) == ("generation failed: ONNX Runtime failed to run a generation step: out of memory",
                                "INTERNAL")
    assert engine.ready


class _Failing:
    """A ``KVCacheModel`` whose decode step fails as a broken session does."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    @property
    def stepper(self):
        class Broken:
            def empty_cache(self, batch):
                return None

            def run(self, *args):
                raise RuntimeError("ONNX Runtime failed to run a generation step: out of memory")

        return Broken()


def test_streaming_answers_one_token_per_response_with_generates_tokens(engine, model):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    request = Request({"input_ids": np.array(prompt), "max_new_tokens": np.array([6])})
    answers = _streamed(StreamingGenerationInference(engine), request)
    assert all(len(a) == 1 and a[0][GENERATION_OUTPUT].shape == (1,) for a in answers)
    assert [int(a[0][STREAM_INDEX][0]) for a in answers] == list(range(len(answers)))
    want = generate(model, [prompt], max_new_tokens=6).tokens[0]
    assert [int(a[0][GENERATION_OUTPUT][0]) for a in answers] == want
    assert _whole(GenerationInference(engine), request)[GENERATION_OUTPUT].tolist() == want


def test_concurrent_requests_share_the_engine(model):
    """PyTriton's event loop runs many requests at once; each gets its own tokens."""
    engine = Engine(model, EngineOptions(max_batch=4, max_queue=2)).start()
    prompts = [[3, 1, 4, 1, 5], [9], [2, 7, 1, 8]]
    infer, streaming = GenerationInference(engine), StreamingGenerationInference(engine)

    async def main():
        async def streamed(prompt):
            request = Request({"input_ids": np.array(prompt), "max_new_tokens": np.array([5])})
            return [int(a[0][GENERATION_OUTPUT][0]) async for a in streaming([request])]

        whole = infer([Request({"input_ids": np.array(p), "max_new_tokens": np.array([5])}) for p in prompts])
        return await asyncio.gather(whole, *(streamed(p) for p in prompts))

    whole, *streams = asyncio.run(main())
    want = [generate(model, [p], max_new_tokens=5).tokens[0] for p in prompts]
    assert [a[GENERATION_OUTPUT].tolist() for a in whole] == want and streams == want
    engine.drain(0)


def test_the_proxys_cancellation_notice_cancels_the_stream_it_names(engine):
    streaming = StreamingGenerationInference(engine)
    iteration, noticed = engine.batch.iteration, threading.Event()

    def held_iteration():  # the engine waits for the notice after the first token (no race with a fast model)
        yield from iteration()
        noticed.wait(30)

    engine.batch.iteration = held_iteration

    async def main():
        request = Request({"input_ids": np.array([1, 2, 3]), "max_new_tokens": np.array([250])}, number=41)
        answers = streaming([request])
        first = await answers.__anext__()
        assert list(streaming.streams) == [41]
        notice = [answer async for answer in streaming([Request({CANCELLED: np.array([41])})])]
        noticed.set()
        rest = [answer async for answer in answers]
        return first, notice, rest

    first, notice, rest = asyncio.run(main())
    assert int(first[0][STREAM_INDEX][0]) == 0 and notice == []
    assert len(rest) <= 2 and [_refused(a[0]) for a in rest[-1:]] == [("cancelled", "UNAVAILABLE")]
    assert streaming.streams == {} and engine.stats()["cancelled"] == 1
    assert _whole(GenerationInference(engine), Request({CANCELLED: np.array([7])})) == {}  # unknown: nothing to do


def test_refusal_is_one_line_of_utf8_with_its_code():
    answer = refusal("token id -1 is outside\n  the vocabulary — [0, 512)")
    assert _refused(answer) == ("token id -1 is outside the vocabulary — [0, 512)", "INVALID_ARG")
    assert _refused(refusal("busy", "unavailable"))[1] == "UNAVAILABLE"
    with pytest.raises(KeyError):
        refusal("x", "teapot")


def test_stream_checks_the_request_before_it_runs_the_model(model):
    with pytest.raises(InputError, match=r"^token id 512 is outside the model's vocabulary \[0, 512\)$"):
        stream(model, [1, VOCAB], max_new_tokens=2)
