"""Prompt KV kept across requests (``serving.engine.prefix_cache``): a request that starts with tokens the
engine computed before prefills only the rest and still gets exactly the tokens of a cold run
(``generate`` on its prompt alone), whether the prefix stayed in a slot or came back from the store,
under continuous batching, and for a prompt equal to a cached prefix; the store keeps to its budget.
Streams of one prompt (OpenAI's ``n``) prefill it once; a stream that outgrows its slot ends with ``length``."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")

from rmsnorm_deploy.decoder.generate import KVCacheModel, Sampling, generate  # noqa: E402
from rmsnorm_deploy.serving.engine.engine import Engine, EngineOptions  # noqa: E402
from rmsnorm_deploy.serving.engine.prefix_cache import PrefixStore, common_prefix  # noqa: E402
from rmsnorm_deploy.serving.engine.slots import SlotBatch  # noqa: E402

VOCAB = 256  # the tiny Llama's
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model(engine_exports):
    with KVCacheModel(engine_exports("ort")) as opened:
        yield opened


def _cold(model, prompt: list[int], n: int) -> list[int]:
    return generate(model, [prompt], max_new_tokens=n).tokens[0]


def _tokens(rng, count: int) -> list[int]:
    return rng.integers(3, VOCAB, count).tolist()


def test_a_chat_turn_prefills_only_its_new_tokens_and_gets_the_cold_tokens(model):
    rng = np.random.default_rng(0)
    engine = Engine(model, EngineOptions(max_batch=2, prefill_chunk=16)).start()
    prompt, held = _tokens(rng, 50), []
    for turn in range(3):
        before = engine.token_stats()
        answer = engine.submit(prompt, max_new_tokens=12, eos_token_id=None).result(TIMEOUT_S)
        assert answer == _cold(model, prompt, 12), f"turn {turn}"
        after = engine.token_stats()
        saved = after["prefix_tokens_saved"] - before["prefix_tokens_saved"]
        # what the slot held: the last prompt and all but the last new token (never fed)
        assert saved == (min(common_prefix(held, prompt), len(prompt) - 1) if held else 0)
        assert saved >= len(held) - 1 and after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) - saved
        held = prompt + answer[:-1]
        prompt = prompt + answer + _tokens(rng, 7)
    assert engine.token_stats()["prefix_hits"] == 2
    engine.drain(10)


def test_a_prompt_equal_to_a_cached_prefix_prefills_its_last_token_only(model):
    rng = np.random.default_rng(1)
    engine = Engine(model, EngineOptions(max_batch=1, prefill_chunk=16)).start()
    prompt = _tokens(rng, 40)
    first = engine.submit(prompt, max_new_tokens=6, eos_token_id=None).result(TIMEOUT_S)
    before = engine.token_stats()
    assert engine.submit(prompt, max_new_tokens=6, eos_token_id=None).result(TIMEOUT_S) == first == \
        _cold(model, prompt, 6)
    after = engine.token_stats()
    assert after["prefill_tokens"] - before["prefill_tokens"] == 1
    assert after["prefix_tokens_saved"] - before["prefix_tokens_saved"] == 39
    shorter = prompt[:25]  # a prefix of what the slot holds
    assert engine.submit(shorter, max_new_tokens=6, eos_token_id=None).result(TIMEOUT_S) == _cold(model, shorter, 6)
    assert engine.token_stats()["prefix_tokens_saved"] - after["prefix_tokens_saved"] == 24
    engine.drain(10)


@pytest.mark.parametrize("prefix_cache_mb", [0, 1])
def test_a_prefix_overwritten_in_its_slot_comes_back_from_the_store(model, prefix_cache_mb):
    rng = np.random.default_rng(2)
    engine = Engine(model, EngineOptions(max_batch=1, prefill_chunk=16, prefix_cache_mb=prefix_cache_mb)).start()
    first, other = _tokens(rng, 60), _tokens(rng, 30)
    held = first + engine.submit(first, max_new_tokens=4, eos_token_id=None).result(TIMEOUT_S)[:-1]
    engine.submit(other, max_new_tokens=4, eos_token_id=None).result(TIMEOUT_S)  # overwrites the only slot
    stats = engine.token_stats()
    assert stats["prefix_store_entries"] == (1 if prefix_cache_mb else 0)
    again = first + _tokens(rng, 5)
    assert engine.submit(again, max_new_tokens=8, eos_token_id=None).result(TIMEOUT_S) == _cold(model, again, 8)
    saved = engine.token_stats()["prefix_tokens_saved"] - stats["prefix_tokens_saved"]
    assert saved == (common_prefix(held, again) if prefix_cache_mb else 0) and saved >= (60 if prefix_cache_mb else 0)
    engine.drain(10)


def test_a_stored_prefix_evicted_while_its_slot_is_saved_is_looked_up_again(model):
    """The entry a newcomer is to copy from can be the least recently used one, which saving the free
    slot's own tokens into a full store evicts: the newcomer then prefills what no entry holds, and
    gets the cold tokens (it failed with "generation failed: <entry key>" before)."""
    rng = np.random.default_rng(5)
    engine = Engine(model, EngineOptions(max_batch=1, prefill_chunk=16)).start()
    engine.batch.store.budget_bytes = 70 * SlotBatch.cache_bytes(model.layout, 1, 1)  # one entry of <= 70 tokens
    first, other = _tokens(rng, 60), _tokens(rng, 60)
    engine.submit(first, max_new_tokens=4, eos_token_id=None).result(TIMEOUT_S)
    engine.submit(other, max_new_tokens=4, eos_token_id=None).result(TIMEOUT_S)  # first's KV goes to the store
    again = first + _tokens(rng, 5)  # found in the store; saving other's KV from the slot evicts it
    assert engine.submit(again, max_new_tokens=8, eos_token_id=None).result(TIMEOUT_S) == _cold(model, again, 8)
    assert engine.stats().get("error", 0) == 0 and engine.token_stats()["prefix_store_entries"] == 1
    engine.drain(10)


def test_many_conversations_under_continuous_batching_each_get_the_cold_tokens(model):
    """Six conversations sharing a system prompt, three slots: each round every conversation sends
    its next turn at once, so slots are reused, overwritten, saved to and restored from the store
    while other streams decode beside them."""
    rng = np.random.default_rng(3)
    system = _tokens(rng, 40)
    chats = [system + _tokens(rng, int(rng.integers(1, 20))) for _ in range(6)]
    engine = Engine(model, EngineOptions(max_batch=3, prefill_chunk=16, prefix_cache_mb=1)).start()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for _ in range(3):
            counts = [int(rng.integers(1, 12)) for _ in chats]
            streams = [engine.submit(chat, max_new_tokens=n, eos_token_id=None) for chat, n in zip(chats, counts)]
            got = list(pool.map(lambda s: s.result(TIMEOUT_S), streams))
            assert got == [_cold(model, chat, n) for chat, n in zip(chats, counts)]
            chats = [chat + answer + _tokens(rng, int(rng.integers(1, 6))) for chat, answer in zip(chats, got)]
    stats = engine.token_stats()
    assert stats["prefix_hits"] >= 12 and stats["prefix_tokens_saved"] > 40 * 12
    assert stats["prefix_store_entries"] > 0
    engine.drain(10)


def test_the_store_keeps_to_its_budget_least_recently_used_out():
    rows = [np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)]  # 32 bytes a token
    store = PrefixStore(budget_bytes=32 * 12)
    assert store.put([1, 2, 3, 4, 5], rows) and store.put([7, 8, 9, 9, 9], rows)
    assert store.longest([1, 2, 3, 0]) == (3, next(iter(store.entries)))
    store.copy_into(next(iter(store.entries)), 3, [np.zeros((2, 10, 4), np.float32)])  # [1..5] now most recent
    assert store.put([4, 4, 4], rows)  # 15 tokens > 12: the least recently used ([7, 8, 9, 9, 9]) goes
    assert sorted(e.tokens.tolist() for e in store.entries.values()) == [[1, 2, 3, 4, 5], [4, 4, 4]]
    assert store.nbytes == 32 * 8
    assert store.put([1, 2, 3], rows) and len(store.entries) == 2  # covered by [1..5]: nothing added
    assert store.put([4, 4, 4, 4], rows) and [4, 4, 4] not in [e.tokens.tolist() for e in store.entries.values()]
    assert not PrefixStore(32 * 4).put([1] * 5, rows) and not PrefixStore(0).put([1], rows)  # over the budget
    target = np.zeros((2, 10, 4), np.float32)
    key = store.longest([1, 2, 3, 4, 5, 6])[1]
    store.copy_into(key, 5, [target])
    assert np.array_equal(target[:, :5], rows[0][:, :5]) and not target[:, 5:].any()
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0 and common_prefix([2], [1]) == 0


@pytest.mark.parametrize("max_batch", [4, 2])
def test_streams_of_one_prompt_prefill_it_once_and_each_get_their_tokens_alone(model, max_batch):
    """``follow``: the followers copy the leader's prompt KV and first logits (with 2 slots the third
    waits for a slot, its leader may be gone: it then reuses the prompt as any request would)."""
    prompt = _tokens(np.random.default_rng(5), 40)  # two prefill chunks of 32
    samplings = [Sampling(do_sample=True, seed=3 + i, temperature=0.9) for i in range(3)]
    want = [generate(model, [prompt], max_new_tokens=8, sampling=s, eos_token_id=None).tokens[0] for s in samplings]
    engine = Engine(model, EngineOptions(max_batch=max_batch, prefix_cache_mb=0)).start()
    streams = [engine.submit(prompt, max_new_tokens=8, sampling=samplings[0], eos_token_id=None)]
    streams += [engine.submit(prompt, max_new_tokens=8, sampling=s, eos_token_id=None, follow=streams[0])
                for s in samplings[1:]]
    assert [s.result(TIMEOUT_S) for s in streams] == want and len(set(map(tuple, want))) == 3
    stats = engine.token_stats()
    if max_batch == 4:
        assert stats["prefill_tokens"] == 40 and stats["shared_prefills"] == 2
    else:  # the third reused the leader's slot (its prompt but the last token)
        assert stats["prefill_tokens"] <= 41 and stats["shared_prefills"] >= 1
    engine.drain(10)


def test_a_stream_that_outgrows_its_slot_ends_with_length_and_the_others_go_on(model):
    engine = Engine(model, EngineOptions(max_batch=2, max_tokens_in_flight=64)).start()  # 32 tokens a slot
    prompt, other = _tokens(np.random.default_rng(6), 20), _tokens(np.random.default_rng(7), 5)
    long, short = (engine.submit(prompt, max_new_tokens=30, eos_token_id=None),
                   engine.submit(other, max_new_tokens=20, eos_token_id=None))
    assert long.result(TIMEOUT_S) == _cold(model, prompt, 12) and long.finish_reason == "length"
    assert short.result(TIMEOUT_S) == _cold(model, other, 20) and short.finish_reason == "length"
    assert engine.stats().get("error", 0) == 0
    engine.drain(10)
