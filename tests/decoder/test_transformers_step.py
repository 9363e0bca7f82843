"""transformers with its own cache through the decode loop (``decoder.transformers_step``): the
greedy tokens are the argmax of its logits, feeding them back gives the same logits, each step
matches a forward over the whole sequence without a cache, and the refusals. Tiny random Llama."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from rmsnorm_deploy.errors import InputError
from rmsnorm_deploy.decoder.convention import left_padded, position_ids_for
from rmsnorm_deploy.decoder.transformers_step import transformers_generate, transformers_steps

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers builds the reference model")

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [11, 12, 13]]


def _llama(dtype: str = "float32"):
    from rmsnorm_deploy.exporter.hf import TINY_CONFIGS, from_config

    return from_config(TINY_CONFIGS["llama"], dtype).module.model


def test_greedy_then_fed_back_gives_the_same_logits_without_a_deprecation_warning():
    lm = _llama()
    ids, mask = left_padded(PROMPTS, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the cache goes in as cache=, not past_key_values=
        run = transformers_steps(lm, ids, mask, new_tokens=5)
        fed = transformers_steps(lm, ids, mask, tokens=run.tokens)
    assert run.tokens.shape == (2, 5) and len(run.step_logits) == 5
    assert [g.argmax(-1).tolist() for g in run.step_logits] == run.tokens.T.tolist()
    assert np.array_equal(fed.tokens, run.tokens)
    assert all(np.array_equal(a, b) for a, b in zip(run.step_logits, fed.step_logits))


def test_each_step_matches_a_forward_over_the_whole_sequence():
    lm = _llama()
    ids, mask = left_padded(PROMPTS, 0)
    run = transformers_steps(lm, ids, mask, new_tokens=4)
    for k, got in enumerate(run.step_logits):
        full_ids = np.concatenate([ids, run.tokens[:, :k]], axis=1)
        full_mask = np.concatenate([mask, np.ones((len(PROMPTS), k), dtype=np.int64)], axis=1)
        with torch.no_grad():
            want = lm(input_ids=torch.from_numpy(full_ids), attention_mask=torch.from_numpy(full_mask),
                      position_ids=torch.from_numpy(position_ids_for(full_mask, full_ids.shape[1]))).logits[:, -1]
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def test_bfloat16_logits_come_back_as_float32():
    run = transformers_steps(_llama("bfloat16"), *left_padded(PROMPTS, 0), new_tokens=2)
    assert all(g.dtype == np.float32 for g in run.step_logits)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "either new_tokens"),
    ({"new_tokens": 2, "tokens": [[1], [2]]}, "either new_tokens"),
    ({"tokens": [[1, 2]]}, "tokens must be"),
    ({"tokens": [1, 2]}, "tokens must be"),
])
def test_bad_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(InputError, match=message):
        transformers_steps(object(), *left_padded(PROMPTS, 0), **kwargs)


def test_generate_runs_every_token_past_the_end_of_sequence_only_when_asked():
    lm = _llama()
    ids, mask = left_padded(PROMPTS, 0)
    greedy = transformers_steps(lm, ids, mask, new_tokens=6).tokens
    lm.generation_config.eos_token_id = int(greedy[0, 1])  # row 0 ends at its second token
    stopped = transformers_generate(lm, ids, mask, max_new_tokens=6, pad_token_id=0)
    unstopped = transformers_generate(lm, ids, mask, max_new_tokens=6, pad_token_id=0, stop_at_eos=False)
    assert np.array_equal(unstopped, greedy)
    assert stopped[0, :2].tolist() == greedy[0, :2].tolist() and (stopped[0, 2:] == 0).all()
    assert lm.generation_config.eos_token_id == greedy[0, 1]  # the model's own config is left alone
