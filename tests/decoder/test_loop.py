"""The one decode loop (``decoder.loop.decode_loop``) over a scripted step: what each step is
fed (left-padded prompt, grown mask, positions from the mask), token choice, end-of-sequence and
pad handling, logits kept, the per-token hook; and the refusals. No model: each test runs in ms."""

from __future__ import annotations

import numpy as np
import pytest

from rmsnorm_deploy.errors import InputError, UserError
from rmsnorm_deploy.decoder.convention import left_padded
from rmsnorm_deploy.decoder.loop import Sampling, decode_loop, forced, greedy, nucleus, token_picker

VOCAB = 11


class ScriptedStep:
    """A fake backend: the next token of a row is ``(last token + its position + 1) % VOCAB``
    unless ``script`` says otherwise; every call is recorded. The cache is the past length."""

    def __init__(self, script: dict[tuple[int, int], int] | None = None):
        self.script = script or {}  # (row, new token index) -> token
        self.calls: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []

    def empty_cache(self, batch: int) -> int:
        return 0

    def run(self, input_ids, attention_mask, position_ids, cache):
        assert attention_mask.shape[1] == cache + input_ids.shape[1]  # mask covers past + sequence
        assert position_ids.shape == input_ids.shape
        self.calls.append((input_ids.copy(), attention_mask.copy(), position_ids.copy(), cache))
        made = len(self.calls) - 1
        logits = np.zeros((input_ids.shape[0], VOCAB), dtype=np.float32)
        for row in range(input_ids.shape[0]):
            token = self.script.get((row, made), (input_ids[row, -1] + position_ids[row, -1] + 1) % VOCAB)
            logits[row, token] = 1.0
        return logits, cache + input_ids.shape[1]


@pytest.mark.parametrize("rows", [[[4]], [[3, 5, 7], [9]], [[1] * 7, [2, 3]]])
def test_feeds_grow_the_mask_and_take_positions_from_it(rows):
    step = ScriptedStep()
    ids, mask = left_padded(rows, pad_token_id=0)
    run = decode_loop(step, ids, mask, max_new_tokens=4)
    prefill_ids, prefill_mask, prefill_pos, past = step.calls[0]
    assert past == 0 and np.array_equal(prefill_ids, ids) and np.array_equal(prefill_mask, mask)
    for r, row in enumerate(rows):  # left padding: positions 0.. on the real tokens, padded slots 1
        pad = ids.shape[1] - len(row)
        assert prefill_pos[r, pad:].tolist() == list(range(len(row)))
        assert (prefill_pos[r, :pad] == 1).all()
    for k, (step_ids, step_mask, step_pos, past) in enumerate(step.calls[1:], start=1):
        assert step_ids.shape == (len(rows), 1) and step_ids[:, 0].tolist() == run.tokens[:, k - 1].tolist()
        assert step_mask.shape[1] == ids.shape[1] + k and (step_mask[:, ids.shape[1]:] == 1).all()
        assert np.array_equal(step_mask[:, :ids.shape[1]], mask)  # the padding stays in front
        assert step_pos[:, 0].tolist() == [len(row) - 1 + k for row in rows]
    assert run.tokens.shape == (len(rows), 4) and run.steps == 3 and len(step.calls) == 4


def test_end_of_sequence_pads_a_finished_row_and_stops_when_all_ended():
    eos, pad = 10, 0
    step = ScriptedStep({(0, 1): eos, (1, 3): eos})
    run = decode_loop(step, np.array([[3, 4], [5, 6]]), max_new_tokens=8, eos_token_ids=[eos], pad_token_id=pad)
    assert run.tokens[0, 1] == eos and (run.tokens[0, 2:] == pad).all()
    assert run.tokens[1, 3] == eos and (run.tokens[1, :3] != eos).all()
    assert run.tokens.shape == (2, 4) and len(step.calls) == 4 and run.steps == 3


def test_no_end_of_sequence_runs_to_max_new_tokens():
    step = ScriptedStep({(0, k): 10 for k in range(6)})
    run = decode_loop(step, np.array([[3]]), max_new_tokens=6)
    assert run.tokens.tolist() == [[10] * 6] and run.steps == 5


def test_one_new_token_is_the_prefill_only():
    step = ScriptedStep()
    run = decode_loop(step, np.array([[1, 2, 3]]), max_new_tokens=1, keep_logits=True)
    assert run.steps == 0 and run.decode_ms_per_token == 0.0 and run.prefill_s > 0
    assert len(step.calls) == 1 and len(run.step_logits) == 1 and run.step_logits[0].shape == (1, VOCAB)


def test_kept_logits_and_the_per_token_hook_see_every_step():
    seen: list[list[int]] = []
    run = decode_loop(ScriptedStep(), np.array([[1, 2], [3, 4]]), max_new_tokens=5, keep_logits=True,
                      on_token=lambda t: seen.append(t.tolist()))
    assert seen == run.tokens.T.tolist()
    assert [g.argmax(-1).tolist() for g in run.step_logits] == run.tokens.T.tolist()


def test_forced_tokens_are_fed_whatever_the_logits_say():
    given = np.array([[7, 2, 9], [1, 1, 4]])
    step = ScriptedStep()
    run = decode_loop(step, np.array([[3, 4], [5, 6]]), max_new_tokens=3, pick=forced(given))
    assert np.array_equal(run.tokens, given)
    assert [call[0][:, 0].tolist() for call in step.calls[1:]] == given[:, :2].T.tolist()


def test_greedy_takes_the_first_index_on_ties_and_top_k_1_sampling_is_greedy():
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0]], dtype=np.float32)
    assert greedy(logits).tolist() == [1, 0]
    assert token_picker(Sampling(True, seed=3, top_k=1))(logits[:1]).tolist() == [1]
    assert token_picker() is greedy


def test_sampling_is_reproducible_from_its_seed():
    logits = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32)
    runs = [[token_picker(Sampling(True, seed=s, temperature=3.0))(logits).tolist() for _ in range(2)]
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]  # same seed, same draws
    assert runs[0] != runs[2] or runs[0][0] != runs[0][1]  # the draws do vary


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, [3]), (0.6, [3, 1]), (0.9, [3, 1, 0]), (1.0, [3, 1, 0, 2])])
def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_that_reaches_p(top_p, kept):
    probs = np.array([[0.15, 0.3, 0.05, 0.5]])
    cut = nucleus(probs, top_p)
    assert np.flatnonzero(cut[0]).tolist() == sorted(kept)
    assert cut.sum() == pytest.approx(1.0) and np.allclose(cut[0, kept], probs[0, kept] / probs[0, kept].sum())
    logits = np.log(probs).astype(np.float32)
    draws = {int(token_picker(Sampling(True, seed=s, top_p=top_p))(logits)[0]) for s in range(200)}
    assert draws == set(kept)


def test_top_p_1_draws_exactly_as_without_it():
    logits = np.random.default_rng(1).normal(size=(2, 40)).astype(np.float32)
    assert (token_picker(Sampling(True, seed=5, temperature=0.8, top_p=1.0))(logits).tolist()
            == token_picker(Sampling(True, seed=5, temperature=0.8))(logits).tolist())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"input_ids": np.zeros((2,), np.int64)}, r"input_ids must be \[batch >= 1, prompt >= 1\]"),
    ({"input_ids": np.zeros((1, 0), np.int64)}, r"input_ids must be \[batch >= 1, prompt >= 1\]"),
    ({"attention_mask": np.ones((1, 2), np.int64)}, r"attention_mask has shape \[1, 2\], input_ids \[1, 3\]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1, got True"),
])
def test_bad_arguments_are_one_line_errors(kwargs, message):
    args = {"input_ids": np.ones((1, 3), np.int64), "max_new_tokens": 2, **kwargs}
    with pytest.raises(InputError, match=message):
        decode_loop(ScriptedStep(), args.pop("input_ids"), **args)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"seed": -1}, "--seed must be an integer >= 0"),
    ({"temperature": float("nan")}, "--temperature must be a finite number > 0"),
    ({"top_k": -2}, "--top-k must be an integer >= 0"),
    ({"top_p": 0.0}, r"--top-p must be a number > 0 and <= 1 \(1: no cut\), got 0.0"),
    ({"top_p": 1.5}, "--top-p must be a number > 0 and <= 1"),
    ({"top_p": float("nan")}, "--top-p must be a number > 0 and <= 1"),
    ({"top_p": True}, "--top-p must be a number > 0 and <= 1"),
])
def test_bad_sampling_is_refused(kwargs, message):
    with pytest.raises(UserError, match=message):
        Sampling(True, **kwargs)


class _ScriptedContext:
    """Stands in for TensorRT's per-profile execution context (``tensorrt.runner._Step``) so
    that the wiring of ``TensorRTStep`` into the loop runs on CPU: which profile each step uses,
    what it is fed, and that presents come back as the next past. Nothing of TensorRT runs."""

    calls: list[tuple[int, dict]] = []

    def __init__(self, runner, index, stream):
        self.index = index

    def run(self, inputs):
        import torch

        _ScriptedContext.calls.append((self.index, {k: tuple(v.shape) for k, v in inputs.items()}))
        ids, pos = inputs["input_ids"], inputs["position_ids"]
        logits = torch.nn.functional.one_hot((ids + pos + 1) % VOCAB, VOCAB).float()
        out = {"logits": logits}
        for i in range(2):
            for kind in ("key", "value"):
                past = inputs[f"past_key_values.{i}.{kind}"]
                new = torch.zeros(past.shape[0], past.shape[1], ids.shape[1], past.shape[3], dtype=past.dtype)
                out[f"present.{i}.{kind}"] = torch.cat([past, new], dim=2)
        return out


def test_tensorrt_step_runs_the_loop_on_its_prefill_then_decode_profile(monkeypatch):
    import contextlib
    import types

    torch = pytest.importorskip("torch")
    from rmsnorm_deploy.decoder.convention import KVCacheLayout
    from rmsnorm_deploy.tensorrt import runner as trt_runner

    monkeypatch.setattr(trt_runner, "_Step", _ScriptedContext)
    monkeypatch.setattr(trt_runner, "_cuda_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(trt_runner, "_new_stream", lambda device: None)
    monkeypatch.setattr(trt_runner, "_on_stream", lambda stream: contextlib.nullcontext())
    _ScriptedContext.calls = []
    layout = KVCacheLayout(num_layers=2, num_heads=4, kv_heads=2, head_dim=8, hidden_size=32, vocab_size=VOCAB,
                           max_length=64, dtype="float32")
    runner = types.SimpleNamespace(profile_set=[0, 1], engine=types.SimpleNamespace(num_optimization_profiles=2),
                                   engine_path="model.engine")
    tokens = trt_runner._generate(runner, layout, [[3, 4, 5], [6]], max_new_tokens=4, eos_token_id=None)
    expected = decode_loop(ScriptedStep(), *left_padded([[3, 4, 5], [6]], 0), max_new_tokens=4).tokens.tolist()
    assert tokens == expected
    assert [index for index, _ in _ScriptedContext.calls] == [0, 1, 1, 1]
    assert [shapes["past_key_values.1.value"][2] for _, shapes in _ScriptedContext.calls] == [0, 3, 4, 5]
    assert [shapes["attention_mask"] for _, shapes in _ScriptedContext.calls] == [(2, 3), (2, 4), (2, 5), (2, 6)]
    runner.profile_set = [0]
    with pytest.raises(UserError, match="has no decode profile"):
        trt_runner._generate(runner, layout, [[3]], max_new_tokens=2)
