"""The generation model's infer functions and ``stream``, in this process (no server): what is
refused (and how), what stays a server fault, and that streaming is the same loop as ``generate``."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rmsnorm_deploy.errors import InputError, UserError
from rmsnorm_deploy.decoder.generate import KVCacheModel, generate, stream
from rmsnorm_deploy.serving.pytriton_env import REFUSED, refusal
from rmsnorm_deploy.serving.server import (
    GENERATION_OUTPUT,
    STREAM_INDEX,
    GenerationInference,
    StreamingGenerationInference,
)

pytest.importorskip("onnxruntime", reason="the generation loop runs in ONNX Runtime")
VOCAB = 512  # the tiny preset's


@pytest.fixture(scope="module")
def model(tiny_kv_export):
    with KVCacheModel(tiny_kv_export) as kv:
        yield kv


class CountingSteps:
    """Wraps a ``KVCacheModel``: counts the runs of its decode step, and can make them fail like a
    broken session."""

    def __init__(self, model: KVCacheModel, fail_with: Exception | None = None):
        self.model, self.fail_with, self.steps = model, fail_with, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    @property
    def stepper(self):
        counter, inner = self, self.model.stepper

        class Counted:
            def empty_cache(self, batch):
                return inner.empty_cache(batch)

            def run(self, *args):
                counter.steps += 1
                if counter.fail_with is not None:
                    raise counter.fail_with
                return inner.run(*args)

        return Counted()


def _refused_message(answer: dict) -> str:
    assert set(answer) == {REFUSED} and answer[REFUSED].dtype == np.uint8, answer
    return answer[REFUSED].tobytes().decode()


@pytest.mark.parametrize("length,max_new_tokens", [(1, 1), (1, 6), (7, 5), (7, 32)])
def test_stream_yields_the_tokens_generate_returns(model, length, max_new_tokens):
    prompt = np.random.default_rng(length).integers(0, VOCAB, length).tolist()
    want = generate(model, [prompt], max_new_tokens=max_new_tokens).tokens[0]
    assert list(stream(model, prompt, max_new_tokens=max_new_tokens)) == want
    assert 1 <= len(want) <= max_new_tokens


def test_stream_checks_the_request_before_it_runs_the_model(model):
    counting = CountingSteps(model)
    with pytest.raises(InputError, match=r"^token id 512 is outside the model's vocabulary \[0, 512\)$"):
        stream(counting, [1, VOCAB], max_new_tokens=2)
    with pytest.raises(InputError, match=r"^--max-new-tokens must be an integer >= 1, got 0$"):
        stream(counting, [1, 2], max_new_tokens=0)
    tokens = stream(counting, [1, 2, 3], max_new_tokens=3)
    assert counting.steps == 0  # lazy: the prefill runs when the first token is asked for
    next(tokens)
    assert counting.steps == 1


@pytest.mark.parametrize("request_,message", [
    ({"max_new_tokens": np.array([3])}, "the request has no input_ids (the prompt's token ids, INT64 [n])"),
    ({"input_ids": np.array([3, -1])}, "token id -1 is outside the model's vocabulary [0, 512)"),
    ({"input_ids": np.array([VOCAB])}, "token id 512 is outside the model's vocabulary [0, 512)"),
    ({"input_ids": np.array([1, 2]), "max_new_tokens": np.array([0])}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"input_ids": np.array([1, 2]), "max_new_tokens": np.array([1, 2])}, "max_new_tokens must hold one number, got 2"),
    ({"input_ids": np.array([1, 2]), "max_new_tokens": np.array([255])},
     "2 prompt tokens + 255 new tokens exceed the model's maximum of 256; lower max_new_tokens to at most 254"),
], ids=["no-prompt", "negative-token", "token-at-vocab-size", "zero-new-tokens", "two-numbers", "over-the-limit"])
def test_bad_requests_are_refused_not_raised(model, request_, message):
    counting = CountingSteps(model)
    assert [_refused_message(a) for a in GenerationInference(counting)([request_])] == [message]
    assert [[_refused_message(a) for a in answers]
            for answers in StreamingGenerationInference(counting)([request_])] == [[message]]
    assert counting.steps == 0


@pytest.mark.parametrize("fault", [RuntimeError("the session is gone"),
                                   UserError("ONNX Runtime failed to run a generation step: out of memory")],
                         ids=["exception", "runtime-failure"])
def test_a_server_fault_is_raised_not_refused(model, fault):
    """Raised, PyTriton answers it with Triton's default code (HTTP 500 / gRPC INTERNAL)."""
    request = {"input_ids": np.array([1, 2, 3])}
    with pytest.raises(type(fault), match=str(fault)):
        GenerationInference(CountingSteps(model, fault))([request])
    with pytest.raises(type(fault), match=str(fault)):
        list(StreamingGenerationInference(CountingSteps(model, fault))([request]))


def test_streaming_answers_one_token_per_response_and_frees_the_lock_between_them(model):
    lock = threading.Lock()
    prompt = [5, 6, 7, 8, 9, 10, 11]
    infer = StreamingGenerationInference(model, lock)
    answers = []
    for answer in infer([{"input_ids": np.array(prompt), "max_new_tokens": np.array([6])}]):
        assert not lock.locked()  # another stream may run its steps while this one's answer is sent
        answers.append(answer)
    assert all(len(a) == 1 and a[0][GENERATION_OUTPUT].shape == (1,) for a in answers)
    assert [int(a[0][STREAM_INDEX][0]) for a in answers] == list(range(len(answers)))
    want = generate(model, [prompt], max_new_tokens=6).tokens[0]
    assert [int(a[0][GENERATION_OUTPUT][0]) for a in answers] == want
    plain = GenerationInference(model, lock)([{"input_ids": np.array(prompt), "max_new_tokens": np.array([6])}])
    assert plain[0][GENERATION_OUTPUT].tolist() == want


def test_two_streams_interleaved_give_each_its_own_tokens(model):
    """PyTriton's event loop can start a second stream while the first is between tokens."""
    infer = StreamingGenerationInference(model)
    a, b = [3, 1, 4, 1, 5], [9]
    first = infer([{"input_ids": np.array(a), "max_new_tokens": np.array([5])}])
    second = infer([{"input_ids": np.array(b), "max_new_tokens": np.array([5])}])
    got: dict[str, list[int]] = {"a": [], "b": []}
    for x, y in zip(first, second):
        got["a"].append(int(x[0][GENERATION_OUTPUT][0]))
        got["b"].append(int(y[0][GENERATION_OUTPUT][0]))
    got["a"] += [int(x[0][GENERATION_OUTPUT][0]) for x in first]
    got["b"] += [int(y[0][GENERATION_OUTPUT][0]) for y in second]
    assert got == {"a": generate(model, [a], max_new_tokens=5).tokens[0],
                   "b": generate(model, [b], max_new_tokens=5).tokens[0]}


def test_refusal_is_one_line_of_utf8():
    answer = refusal("token id -1 is outside\n  the vocabulary — [0, 512)")
    assert _refused_message(answer) == "token id -1 is outside the vocabulary — [0, 512)"
