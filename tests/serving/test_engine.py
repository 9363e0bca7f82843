"""The generation engine in this process: every stream exactly what ``generate`` gives its prompt
alone (and transformers' greedy tokens), whatever joined the batch and when; cancellation frees a
slot; a full queue is refused at once; a failing run fails only its streams; drain; asyncio."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")
pytest.importorskip("transformers", reason="transformers' greedy tokens are the reference")

from rmsnorm_deploy.decoder.generate import KVCacheModel, Sampling, generate  # noqa: E402
from rmsnorm_deploy.decoder.transformers_step import transformers_steps  # noqa: E402
from rmsnorm_deploy.errors import InputError, UserError  # noqa: E402
from rmsnorm_deploy.serving.engine.engine import (  # noqa: E402
    Engine,
    EngineBusy,
    EngineOptions,
    EngineUnavailable,
    StreamCancelled,
    StreamFailed,
)
from rmsnorm_deploy.serving.engine.slots import SlotBatch, TurnBatch  # noqa: E402

VOCAB, EOS = 256, 2  # the tiny Llama's
TIMEOUT_S = 120


def _requests(count: int, seed: int) -> list[tuple[list[int], int]]:
    """Mixed prompts (1 to 60 tokens: some prefilled in several chunks) and max_new_tokens (1 to 40)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, VOCAB, int(rng.integers(1, 61))).tolist(), int(rng.integers(1, 41)))
            for _ in range(count)]


@pytest.fixture(scope="module", params=["ort", "ort-shared", "portable"])
def served_model(request, engine_exports):
    with KVCacheModel(engine_exports(request.param)) as model:
        yield request.param, model


def _engine(model, **options) -> Engine:
    return Engine(model, EngineOptions(**options)).start()


def test_64_streams_joining_at_random_steps_are_each_exactly_generate_alone_and_transformers(served_model,
                                                                                             engine_llama):
    kind, model = served_model
    requests = _requests(64, seed=0)
    want = [generate(model, [prompt], max_new_tokens=n).tokens[0] for prompt, n in requests]
    engine = _engine(model, max_batch=8, max_queue=64, prefill_chunk=16)
    assert isinstance(engine.batch, TurnBatch if kind == "portable" else SlotBatch)
    streams, joined = [None] * len(requests), [0] * len(requests)
    pacer = random.Random(1)

    def after_steps(count: int) -> None:
        """Wait until the engine has run ``count`` more steps (or has nothing to run): joins spread
        over the engine's steps however fast this machine runs them."""
        target, deadline = engine.counts["steps"] + count, time.monotonic() + 5
        while engine.counts["steps"] < target and time.monotonic() < deadline:
            stats = engine.stats()
            if not stats["running"] and not stats["waiting"]:
                return
            time.sleep(0.0005)

    def client(indices: list[int]) -> None:
        for i in indices:
            after_steps(pacer.randint(0, 3))  # join at whatever step the engine is at
            joined[i] = engine.counts["steps"]
            prompt, n = requests[i]
            streams[i] = engine.submit(prompt, max_new_tokens=n)

    threads = [threading.Thread(target=client, args=(list(range(k, 64, 4)),)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    got = [stream.result(TIMEOUT_S) for stream in streams]
    assert engine.drain(10)
    assert len(set(joined)) > 8, "the streams should have joined at many different steps"
    assert got == want, [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert {s.finish_reason for s in streams} <= {"stop", "length"}
    assert engine.stats()["stop"] + engine.stats()["length"] == 64 and engine.stats()["running"] == 0
    for (prompt, n), tokens in zip(requests, got):  # transformers' greedy tokens, up to the first end of sequence
        reference = _transformers_tokens(engine_llama, tuple(prompt), n)
        assert tokens == reference[:len(tokens)] and (len(tokens) == n or tokens[-1] == EOS)


_REFERENCE: dict[tuple, list[int]] = {}


def _transformers_tokens(model, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    """transformers' greedy tokens for a prompt, computed once for every graph kind that is checked."""
    key = (id(model), prompt, new_tokens)
    if key not in _REFERENCE:
        _REFERENCE[key] = transformers_steps(model, np.array([prompt]), new_tokens=new_tokens,
                                             keep_logits=False).tokens[0].tolist()
    return _REFERENCE[key]


@pytest.mark.parametrize("seed", [0, 7])
def test_seeded_sampling_gives_each_stream_the_tokens_it_gets_alone(served_model, seed):
    _, model = served_model
    requests = _requests(12, seed=seed + 1)
    samplings = [Sampling(do_sample=True, seed=seed + i, temperature=0.7 + 0.1 * (i % 4), top_k=(0, 5, 40)[i % 3])
                 for i in range(len(requests))]
    want = [generate(model, [p], max_new_tokens=n, sampling=s).tokens[0] for (p, n), s in zip(requests, samplings)]
    engine = _engine(model, max_batch=4)
    streams = [engine.submit(p, max_new_tokens=n, sampling=s) for (p, n), s in zip(requests, samplings)]
    assert [s.result(TIMEOUT_S) for s in streams] == want
    engine.drain(10)


def test_a_row_decodes_the_same_logits_alone_and_in_any_batch(engine_exports):
    """Why the batch never flips a greedy token: ONNX Runtime's CPU MatMul computes each row alone,
    so a row's logits are bit-identical whatever rows decode beside it."""
    with KVCacheModel(engine_exports("ort")) as model:
        batch = SlotBatch(model, slots=6, slot_length=64, prefill_chunk=16)
        streams = [_Fake(i, list(range(3 + i, 10 + 3 * i))) for i in range(6)]  # 7 to 22 tokens
        for stream in streams:
            batch.admit(stream)
            stream.done = True  # prefill only, in 16-token chunks
        while any(batch.rows[s].prefilling(s) for s in streams):
            list(batch.iteration())
        cache = [array.copy() for array in batch.cache]
        state = {s: (batch.rows[s].filled, batch.rows[s].last) for s in streams}
        rows = {}
        for group in (1, 3, 6):
            for array, saved in zip(batch.cache, cache):  # every group decodes from the same cache
                array[...] = saved
            for stream in streams:
                batch.rows[stream].filled, batch.rows[stream].last = state[stream]
                stream.done = stream.number >= group
            assert len(list(batch.iteration())) == group
            rows[group] = batch.logits[:group, -1].copy()
        assert np.array_equal(rows[1], rows[3][:1]) and np.array_equal(rows[3], rows[6][:3])


class _Fake:
    """The fields of a stream ``SlotBatch`` reads."""

    def __init__(self, number: int, prompt: list[int]):
        self.number, self.prompt, self.done = number, prompt, False
        self.max_new_tokens = 8

    @staticmethod
    def pick(logits):
        return np.argmax(logits, axis=-1)


# -- cancellation, backpressure, faults, drain ----------------------------------------------------

def _first_token(stream) -> int:
    """Wait for the stream's first token without iterating it (leaving an iteration cancels it)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not stream.tokens:
        assert time.monotonic() < deadline and not stream.done
        time.sleep(0.001)
    return stream.tokens[0]


def test_cancel_frees_the_slot_for_the_next_step(engine_exports):
    with KVCacheModel(engine_exports("ort")) as model:
        engine = _engine(model, max_batch=1, max_queue=1)
        long = engine.submit([5, 6, 7], max_new_tokens=400, eos_token_id=None)
        _first_token(long)
        with engine._cond:  # the engine thread waits at the top of its next iteration meanwhile
            waiting = engine.submit([8, 9], max_new_tokens=3)
            assert engine.stats()["waiting"] == 1 and long.finish_reason is None  # the only slot is taken
            steps = engine.counts["steps"]
            long.cancel()
        assert waiting.result(TIMEOUT_S) == generate(model, [[8, 9]], max_new_tokens=3).tokens[0]
        assert long.finish_reason == "cancelled" and len(long.tokens) < 400
        with pytest.raises(StreamCancelled, match="^cancelled$"):
            long.result()
        # the slot went to the waiting stream at the next step, not after the long one's 400 tokens
        assert engine.counts["steps"] - steps <= 1 + 3
        engine.drain(10)


def test_a_queued_stream_cancelled_never_runs(engine_exports):
    with KVCacheModel(engine_exports("ort")) as model:
        engine = _engine(model, max_batch=1, max_queue=2)
        long = engine.submit([5, 6, 7], max_new_tokens=300, eos_token_id=None)
        _first_token(long)
        queued = engine.submit([8, 9], max_new_tokens=3)
        queued.cancel()
        with pytest.raises(StreamCancelled, match="^cancelled before it started$"):
            queued.result(TIMEOUT_S)
        assert queued.tokens == [] and engine.stats()["waiting"] == 0
        long.cancel()
        engine.drain(10)


def test_a_full_queue_is_refused_at_once_and_the_engine_keeps_serving(engine_exports):
    with KVCacheModel(engine_exports("ort")) as model:
        engine = _engine(model, max_batch=2, max_queue=1)
        running = [engine.submit([5 + i], max_new_tokens=400, eos_token_id=None) for i in range(2)]
        for stream in running:
            _first_token(stream)
        with engine._cond:  # the engine thread waits at the top of its next iteration meanwhile
            assert not any(stream.done for stream in running)
            queued = engine.submit([9, 9], max_new_tokens=2)
            started = time.perf_counter()
            with pytest.raises(EngineBusy) as info:
                engine.submit([1, 2, 3], max_new_tokens=2)
            assert time.perf_counter() - started < 0.5
        assert str(info.value) == ("the server is busy: its 2 streams and its queue of 1 are full (--max-batch 2, "
                                   "--max-queue 1); retry later")
        assert engine.stats()["refused_busy"] == 1
        for stream in running:
            stream.cancel()
        assert queued.result(TIMEOUT_S) == generate(model, [[9, 9]], max_new_tokens=2).tokens[0]
        assert engine.submit([1, 2, 3], max_new_tokens=2).result(TIMEOUT_S) == \
            generate(model, [[1, 2, 3]], max_new_tokens=2).tokens[0]
        engine.drain(10)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_a_failing_run_fails_only_its_streams(engine_exports, phase):
    """A decode run fails every stream in it; a prefill run only its newcomer; the rest is exact."""
    with KVCacheModel(engine_exports("ort")) as model:
        engine = _engine(model, max_batch=4, prefill_chunk=64)
        batch, failing = engine.batch, threading.Event()
        real_run = batch._run

        def run(step_run, ids, mask, positions, cache):
            caches = batch._rows if phase == "prefill" else batch._batches
            if failing.is_set() and any(cache is each for each in caches.values()):
                failing.clear()
                raise RuntimeError("ONNX Runtime failed to run a generation step: the device is gone")
            return real_run(step_run, ids, mask, positions, cache)

        batch._run = run
        running = [engine.submit([5, 6, i], max_new_tokens=300, eos_token_id=None) for i in (7, 8)]
        for stream in running:
            _first_token(stream)
        failing.set()
        if phase == "prefill":  # the newcomer's prefill fails; the running streams go on
            victims = [engine.submit([4, 4, 4], max_new_tokens=5)]
        else:
            victims = running
        for stream in victims:
            with pytest.raises(StreamFailed) as info:
                stream.result(TIMEOUT_S)
            assert str(info.value) == ("generation failed: ONNX Runtime failed to run a generation step: "
                                       "the device is gone")
            assert stream.finish_reason == "error"
        prompt = [11, 12, 13]
        assert engine.submit(prompt, max_new_tokens=20).result(TIMEOUT_S) == \
            generate(model, [prompt], max_new_tokens=20).tokens[0]
        assert engine.stats()["error"] == len(victims)
        if phase == "prefill":
            assert all(stream.finish_reason is None for stream in running)
        engine.drain(0)


def test_drain_finishes_what_runs_and_refuses_newcomers(engine_exports):
    with KVCacheModel(engine_exports("ort")) as model:
        engine = _engine(model, max_batch=2, max_queue=4)
        requests = _requests(5, seed=3)
        streams = [engine.submit(p, max_new_tokens=n) for p, n in requests]
        done = threading.Thread(target=engine.drain, args=(TIMEOUT_S,))
        done.start()
        time.sleep(0.01)
        with pytest.raises(EngineUnavailable, match="^the server is stopping; send the request to another replica$"):
            engine.submit([1], max_new_tokens=1)
        done.join(TIMEOUT_S)
        assert [s.result() for s in streams] == [generate(model, [p], max_new_tokens=n).tokens[0] for p, n in requests]


def test_drain_cancels_what_outlives_its_timeout(engine_exports):
    with KVCacheModel(engine_exports("ort")) as model:
        engine = _engine(model, max_batch=1)
        long = engine.submit([5, 6, 7], max_new_tokens=500, eos_token_id=None)
        _first_token(long)
        assert long.finish_reason is None
        assert engine.drain(0) is False
        with pytest.raises(StreamCancelled, match=r"^cancelled: the server is stopping and the request did not "
                                                  r"finish within 0 s$"):
            long.result(TIMEOUT_S)
        assert engine.stats() == {"running": 0, "waiting": 0, "cancelled": 1}


def test_not_ready_before_start(engine_exports):
    with KVCacheModel(engine_exports("ort")) as model:
        engine = Engine(model, EngineOptions(max_batch=1))
        assert not engine.ready
        with pytest.raises(EngineUnavailable, match="^the model is still warming up; retry when it reports ready$"):
            engine.submit([1, 2], max_new_tokens=1)
        engine.start()
        assert engine.ready and engine.stats() == {"running": 0, "waiting": 0}  # the warm-up is not counted
        engine.drain(0)


@pytest.mark.parametrize("kind", ["ort", "portable"])
def test_a_stream_is_counted_and_its_slot_freed_before_anyone_sees_it_end(engine_exports, kind, monkeypatch):
    """The engine frees the slot (slow here) and counts the stream before the stream is done: the
    warm-up's last stream is not counted after ``start`` cleared the counts, and a client that saw its
    answer end reads statistics that include it."""
    with KVCacheModel(engine_exports(kind)) as model:
        engine = Engine(model, EngineOptions(max_batch=2))
        release = engine.batch.release

        def slow_release(stream):
            time.sleep(0.05)
            release(stream)

        monkeypatch.setattr(engine.batch, "release", slow_release)
        engine.start()
        assert engine.stats() == {"running": 0, "waiting": 0}
        stream = engine.submit([5, 6, 7], max_new_tokens=3, eos_token_id=None)
        assert len(stream.result(TIMEOUT_S)) == 3 and stream.finish_reason == "length"
        assert engine.stats() == {"running": 0, "waiting": 0, "length": 1}
        engine.drain(10)


# -- asyncio --------------------------------------------------------------------------------------

def test_streams_from_an_event_loop(engine_exports):
    with KVCacheModel(engine_exports("ort-shared")) as model:
        engine = _engine(model, max_batch=4)
        requests = _requests(8, seed=5)

        async def main():
            async def one(prompt, n):
                return [token async for token in engine.submit(prompt, max_new_tokens=n)]

            whole = await engine.submit(requests[0][0], max_new_tokens=requests[0][1]).result_async()
            return whole, await asyncio.gather(*(one(p, n) for p, n in requests))

        whole, got = asyncio.run(main())
        want = [generate(model, [p], max_new_tokens=n).tokens[0] for p, n in requests]
        assert got == want and whole == want[0]
        engine.drain(10)


def test_leaving_the_async_loop_cancels_the_stream(engine_exports):
    with KVCacheModel(engine_exports("ort")) as model:
        engine = _engine(model, max_batch=1)

        async def main():
            stream = engine.submit([5, 6, 7], max_new_tokens=400, eos_token_id=None)
            async for _ in stream:
                break
            return stream

        stream = asyncio.run(main())
        assert engine.submit([8], max_new_tokens=2).result(TIMEOUT_S)  # the slot came free
        assert stream.finish_reason == "cancelled"
        engine.drain(0)


# -- what is refused ----------------------------------------------------------------------------

@pytest.mark.parametrize("options,message", [
    (dict(max_batch=0), "--max-batch must be an integer >= 1, got 0"),
    (dict(max_queue=-1), "--max-queue must be an integer >= 0, got -1"),
    (dict(prefill_chunk=0), "--prefill-chunk must be an integer >= 1, got 0"),
    (dict(max_batch=4, max_tokens_in_flight=7), "--max-tokens-in-flight must be an integer >= 2 x --max-batch (8), "
                                                "got 7"),
    (dict(drain_timeout_s=float("nan")), "--drain-timeout must be a number of seconds >= 0, got nan"),
    (dict(prefix_cache_mb=-1), "--prefix-cache-mb must be an integer >= 0, got -1"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(UserError) as info:
        EngineOptions(**options).check()
    assert str(info.value) == message


@pytest.mark.parametrize("prompt,max_new_tokens,message", [
    ([1, 256], 2, "token id 256 is outside the model's vocabulary [0, 256)"),
    ([1, 2], 0, "max_new_tokens must be an integer >= 1, got 0"),
    ("hello", 2, "the prompt must be token ids (a sequence of integers), not text"),
    ([1] * 64, 3, "the prompt has 64 tokens; this server's streams hold 64 tokens (--max-tokens-in-flight over "
                  "--max-batch), so at most 63 prompt tokens"),
    ([1] * 10, 17000, "10 prompt tokens + 17000 new tokens exceed the model's maximum of 16384; lower "
                      "max_new_tokens to at most 16374"),
])
def test_bad_requests_are_refused_before_they_queue(engine_exports, prompt, max_new_tokens, message):
    with KVCacheModel(engine_exports("ort")) as model:
        engine = _engine(model, max_batch=2, max_tokens_in_flight=128)
        with pytest.raises(InputError) as info:
            engine.submit(prompt, max_new_tokens=max_new_tokens)
        assert str(info.value) == message and engine.stats()["waiting"] == 0
        engine.drain(0)


def test_the_portable_graph_says_why_its_streams_take_turns(engine_exports):
    with KVCacheModel(engine_exports("portable")) as model:
        engine = Engine(model, EngineOptions(max_batch=3, max_queue=5))
        assert engine.batching == (
            "one stream at a time: up to 3 streams take turns, one batch-1 step each (the portable graph "
            "concatenates its past every step, so batching it would copy every row's cache at each join; export "
            "with --target onnxruntime for continuous batching); 5 more requests queued")
    with KVCacheModel(engine_exports("ort")) as model:
        engine = Engine(model, EngineOptions(max_batch=4, max_tokens_in_flight=1024, prefill_chunk=16))
        assert engine.batching == (
            "continuous batching: up to 4 streams decoded together in slots of 256 tokens (KV cache 1,024 tokens, "
            "0.5 MiB, --max-tokens-in-flight; the largest request: 256 tokens, prompt and new tokens together), "
            "prompts prefilled 16 tokens per step, prompt KV reused across requests (a prefix cache of up to 256 MiB "
            "beside the slots' own), 64 more requests queued")


def test_the_default_kv_budget_is_sized_to_the_model_and_the_machine(engine_exports, monkeypatch):
    """Never a model-length slot per stream by default: at most DEFAULT_TOKENS_IN_FLIGHT in all, less
    where the model is shorter or the machine's memory budget holds less."""
    from rmsnorm_deploy.serving.engine import engine as engine_module

    with KVCacheModel(engine_exports("ort")) as model:
        lay, per_token = model.layout, SlotBatch.cache_bytes(model.layout, 1, 1)
        assert lay.max_length == 16384 and engine_module.DEFAULT_TOKENS_IN_FLIGHT == 32768
        assert Engine(model, EngineOptions(max_batch=16)).slot_length == 2048
        assert Engine(model, EngineOptions(max_batch=1)).slot_length == 16384  # the model's length is less
        monkeypatch.setattr(engine_module, "memory_budget", lambda: 1000 * per_token)  # half holds 500 tokens
        engine = Engine(model, EngineOptions(max_batch=16, prefix_cache_mb=0))
        assert engine.slot_length == 31 and "slots of 31 tokens (KV cache 496 tokens" in engine.batching
        assert "default; the largest request: 31 tokens" in engine.batching and "--prefix-cache-mb 0" in engine.batching


def _grounded_requests(count: int, seed: int) -> list[tuple[list[int], int]]:
    """Prompts that repeat a short passage: prompt lookup then proposes tokens the tiny model
    sometimes keeps and sometimes rejects (both paths of the check run)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, VOCAB, int(rng.integers(3, 9))).tolist() * 4, int(rng.integers(2, 30)))
            for _ in range(count)]


@pytest.mark.parametrize("max_batch", [1, 3])
def test_speculation_keeps_every_greedy_stream_token_for_token(served_model, max_batch):
    """One slot (every stream alone: each checks its proposals in a one-slot run) and three (streams
    speculate only while one decodes, the others ride in the batched run), or turns (portable)."""
    from rmsnorm_deploy.decoder.generate import SpeculationOptions

    _, model = served_model
    requests = _grounded_requests(8, seed=max_batch)
    want = [generate(model, [p], max_new_tokens=n).tokens[0] for p, n in requests]
    engine = Engine(model, EngineOptions(max_batch=max_batch, prefill_chunk=16),
                    speculation=SpeculationOptions("ngram", 4)).start()
    streams = [engine.submit(p, max_new_tokens=n) for p, n in requests]
    got = [s.result(TIMEOUT_S) for s in streams]
    stats = engine.speculation_stats()
    engine.drain(10)
    assert got == [w[:len(g)] for g, w in zip(got, want)] and all(
        len(g) == len(w) or g[-1] == EOS for g, w in zip(got, want))
    assert stats["verifications"] > 0 and 0 < stats["accepted"] <= stats["proposed"], stats
    assert stats["tokens"] == sum(len(g) - 1 for g in got) and stats["streams_without_speculation"] == 0, stats
    assert stats["tokens_per_pass"] > 1, stats


def test_speculation_samples_with_the_streams_own_distribution_and_skips_pickers_it_cannot_follow(engine_exports):
    """A temperature so low that the model's distribution is its argmax: the rejection rule must keep
    the greedy tokens (the target's probabilities read at the right positions); a request with
    logit_bias decodes without speculation, counted."""
    from rmsnorm_deploy.decoder.generate import SpeculationOptions
    from rmsnorm_deploy.serving.engine.sampling import Chooser, SamplingFields

    with KVCacheModel(engine_exports("ort")) as model:
        requests = _grounded_requests(3, seed=5)
        want = [generate(model, [p], max_new_tokens=n, eos_token_id=None).tokens[0] for p, n in requests]
        engine = Engine(model, EngineOptions(max_batch=1), speculation=SpeculationOptions("ngram", 4)).start()
        cold = Sampling(do_sample=True, seed=3, temperature=1e-6)
        got = [engine.submit(p, max_new_tokens=n, sampling=cold, eos_token_id=None).result(TIMEOUT_S)
               for p, n in requests]
        stats = engine.speculation_stats()
        biased = Chooser(SamplingFields(logit_bias={7: 1.0}))
        engine.submit(requests[0][0], max_new_tokens=3, pick=biased).result(TIMEOUT_S)
        after = engine.speculation_stats()
        engine.drain(10)
    assert got == want and stats["verifications"] > 0 and stats["accepted"] > 0, stats
    assert after["streams_without_speculation"] == 1 and after["proposed"] == stats["proposed"], after


def test_speculation_refuses_a_draft_of_another_vocabulary_in_one_line(engine_exports, text_exports):
    from rmsnorm_deploy.decoder.generate import SpeculationOptions

    with KVCacheModel(engine_exports("ort")) as model, KVCacheModel(text_exports("ort")) as draft:
        with pytest.raises(InputError, match="vocabulary of 292 tokens, the model 256; give a draft with the model"):
            Engine(model, EngineOptions(max_batch=1), speculation=SpeculationOptions(draft, 4))


def test_a_draft_model_speculates_in_the_engine_with_the_same_tokens(engine_exports):
    """The model as its own draft: every proposal is right, and the tokens stay ``generate``'s."""
    from rmsnorm_deploy.decoder.generate import SpeculationOptions

    with KVCacheModel(engine_exports("ort")) as model, KVCacheModel(engine_exports("ort")) as draft:
        requests = _grounded_requests(3, seed=9)
        want = [generate(model, [p], max_new_tokens=n).tokens[0] for p, n in requests]
        engine = Engine(model, EngineOptions(max_batch=2), speculation=SpeculationOptions(draft, 3)).start()
        got = [engine.submit(p, max_new_tokens=n).result(TIMEOUT_S) for p, n in requests]
        stats = engine.speculation_stats()
        engine.drain(10)
    assert got == [w[:len(g)] for g, w in zip(got, want)]
    assert stats["proposer"].startswith("draft:") and stats["accepted"] == stats["proposed"] > 0, stats
