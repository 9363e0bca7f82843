"""Perplexity in llama-perplexity's scheme (``decoder.perplexity``): the windows and the scored
half, and the whole computation over a tiny Llama's ``--target onnxruntime`` export against
transformers' own loss on the same chunks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rmsnorm_deploy.decoder.perplexity import chunked, perplexity, scored_nll, scored_positions, sliding
from rmsnorm_deploy.errors import InputError

CONTEXT = 16


def test_windows_drop_the_tail_and_start_with_bos_only_when_given():
    ids = list(range(10, 10 + 2 * CONTEXT + 5))
    plain = chunked(ids, CONTEXT)
    assert plain.shape == (2, CONTEXT) and plain[1, 0] == 10 + CONTEXT and plain[-1, -1] == 10 + 2 * CONTEXT - 1
    with_bos = chunked(ids, CONTEXT, bos_token_id=1)
    assert with_bos[:, 0].tolist() == [1, 1]
    assert np.array_equal(with_bos[:, 1:], plain[:, 1:])


@pytest.mark.parametrize("ids, context, message", [
    (list(range(31)), 16, "the text has 31 tokens; perplexity with a context of 16 needs at least 32"),
    (list(range(64)), 2, "context must be an integer >= 4"),
])
def test_too_short_a_text_or_context_is_refused(ids, context, message):
    with pytest.raises(InputError, match=message):
        chunked(ids, context)


def test_only_the_second_half_is_scored_against_the_next_token():
    vocab = 5
    window = np.array([0, 1, 2, 3, 4, 0, 1, 2])
    logits = np.zeros((8, vocab), np.float32)
    logits[4:7, :] = -50.0  # positions 4, 5, 6 are scored: they predict window[5], window[6], window[7]
    logits[4, 0] = logits[5, 1] = logits[6, 2] = 0.0
    logits[:4] = np.nan  # never read: the first half only gives context
    nll, scored = scored_nll(logits, window)
    assert scored == 3
    assert nll == pytest.approx(3 * math.log1p((vocab - 1) * math.exp(-50.0)), rel=1e-12)
    logits[7] = np.nan  # the last position predicts nothing
    assert scored_nll(logits, window)[1] == 3


@pytest.fixture(scope="module")
def tiny_ort(tmp_path_factory):
    """A tiny random Llama (float32) and its ``--kv-cache --target onnxruntime`` export folder."""
    pytest.importorskip("transformers", reason="transformers builds the reference model")
    from rmsnorm_deploy.cli import main
    from rmsnorm_deploy.exporter import hf

    root = tmp_path_factory.mktemp("perplexity")
    lm = hf.from_config(hf.TINY_CONFIGS["llama"], "float32", seed=0).module.model
    lm.save_pretrained(root / "hf")
    assert main(["export", str(root / "hf"), "--kv-cache", "--target", "onnxruntime", "-o", str(root / "ort")]) == 0
    return lm, root / "ort"


def test_matches_transformers_own_loss_on_the_same_chunks(tiny_ort):
    import torch

    from rmsnorm_deploy.decoder.generate import KVCacheModel

    lm, folder = tiny_ort
    ids = np.random.default_rng(7).integers(3, lm.config.vocab_size, size=3 * CONTEXT + 3)
    with KVCacheModel(folder) as model:
        got = perplexity(model, ids, context=CONTEXT, bos_token_id=1)
    assert (got.chunks, got.scored_tokens, got.text_tokens) == (3, 3 * (CONTEXT // 2 - 1), len(ids))
    windows = torch.from_numpy(chunked(ids, CONTEXT, bos_token_id=1))
    labels = windows.clone()
    labels[:, : CONTEXT // 2 + 1] = -100  # transformers shifts: label j is predicted at position j - 1
    with torch.no_grad():
        loss = lm(input_ids=windows, labels=labels).loss.item()
    assert got.mean_nll == pytest.approx(loss, rel=1e-5)
    assert got.perplexity == pytest.approx(math.exp(loss), rel=1e-5)
    assert got.perplexity > 1.0


def test_nan_logits_fail_and_a_context_past_the_model_is_refused(tiny_ort):
    from rmsnorm_deploy.decoder.generate import KVCacheModel
    from rmsnorm_deploy.errors import UserError

    with pytest.raises(UserError, match="NaN or Inf logits"):
        scored_nll(np.full((8, 4), np.nan), np.arange(8) % 4)
    _, folder = tiny_ort
    with KVCacheModel(folder) as model:
        too_long = model.layout.max_length + 1
        with pytest.raises(InputError, match=f"a context of {too_long} tokens exceeds the model's maximum"):
            perplexity(model, [3] * (2 * too_long), context=too_long)


def test_sliding_windows_score_each_token_once_with_its_history():
    ids = np.arange(100, 100 + 37)
    windows = sliding(ids, CONTEXT, 5, bos_token_id=1)
    assert windows.shape == (5, CONTEXT) and windows[:, 0].tolist() == [1] * 5  # starts 0, 5, … 20; 36 - 20 < 5 left
    scored = [int(w[p + 1]) - 100 for w in windows for p in scored_positions(CONTEXT, 5)]
    assert scored == list(range(CONTEXT - 5, 20 + CONTEXT))  # each once, in order, the tail of the text dropped
    with pytest.raises(InputError, match="stride must be an integer from 1 to the context minus 1 \\(15\\), got 0"):
        sliding(ids, CONTEXT, 0)
    with pytest.raises(InputError, match="the text has 15 tokens; perplexity with a context of 16 needs at least 16"):
        sliding(ids[:15], CONTEXT, 4)


def test_strided_perplexity_matches_transformers_own_loss_window_by_window(tiny_ort):
    """Direct: each window's loss in transformers with all but its last ``stride`` labels masked."""
    import torch

    from rmsnorm_deploy.decoder.generate import KVCacheModel

    lm, folder = tiny_ort
    stride = 5
    ids = np.random.default_rng(8).integers(3, lm.config.vocab_size, size=2 * CONTEXT + 3)
    with KVCacheModel(folder) as model:
        got = perplexity(model, ids, context=CONTEXT, bos_token_id=1, stride=stride)
    starts = range(0, len(ids) - CONTEXT + 1, stride)
    windows = torch.from_numpy(np.stack([ids[start: start + CONTEXT] for start in starts]))
    windows[:, 0] = 1
    labels = windows.clone()
    labels[:, : CONTEXT - stride] = -100  # transformers shifts: label j is predicted at position j - 1
    with torch.no_grad():
        loss = lm(input_ids=windows, labels=labels).loss.item()  # the mean over every unmasked label
    count = stride * len(starts)
    assert (got.chunks, got.scored_tokens, got.stride) == (4, count, stride) and count == 20
    assert got.mean_nll == pytest.approx(loss, rel=1e-5)
