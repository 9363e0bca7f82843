"""Generation from `export --kv-cache` graphs against transformers with its own cache, and through onnxruntime-genai.

Each family's tiny model is exported once per process (tests/kv_models.py: torch.onnx takes
20-30 s per family on 2 cores, the reason these tests are marked slow); every test here then
runs in about a second.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.kv_models import KV_FAMILIES, exported_kv, hf_model

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.exporter.kv_cache import left_padded, position_ids_for
from rmsnorm_deploy.serving.generate import KVCacheModel, generate

pytest.importorskip("transformers", reason="transformers builds the reference models")
pytest.importorskip("onnxruntime", reason="the generation loop runs in ONNX Runtime")
pytestmark = pytest.mark.slow

NEW_TOKENS = 32
#: Batch 1, and batch 3 with prompts of different lengths (left padding).
PROMPTS = {1: [[5, 17, 99, 3, 250, 41, 7]], 3: [[5, 17, 99, 3, 250, 41, 7], [11, 12, 13], [200, 1, 64, 64, 9]]}


def _hf_generate(model, prompts, pad: int) -> list[list[int]]:
    ids, mask = left_padded(prompts, pad)
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=pad)
    return out[:, ids.shape[1]:].tolist()


def _hf_step_logits(model, prompts, new_tokens, pad: int) -> list[np.ndarray]:
    """transformers with its DynamicCache, fed the same tokens step by step: last-position logits."""
    from transformers import DynamicCache

    ids, mask = left_padded(prompts, pad)
    cache = DynamicCache()
    logits = []
    step_ids = ids
    with torch.no_grad():
        for step in range(len(new_tokens[0])):
            out = model(input_ids=torch.from_numpy(step_ids), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(position_ids_for(mask, step_ids.shape[1])), cache=cache,
                        use_cache=True)
            logits.append(out.logits[:, -1, :].float().numpy())
            step_ids = np.array([[row[step]] for row in new_tokens], dtype=np.int64)
            mask = np.concatenate([mask, np.ones((mask.shape[0], 1), dtype=np.int64)], axis=1)
    return logits


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", KV_FAMILIES)
def test_greedy_tokens_and_step_logits_match_transformers(family, batch):
    folder, result = exported_kv(family)
    assert result.parity.status == "pass", result.parity.reason
    model = hf_model(family)
    with KVCacheModel(folder) as kv:
        pad = kv.special["pad_token_id"]
        ours = generate(kv, PROMPTS[batch], max_new_tokens=NEW_TOKENS, return_logits=True)
    assert ours.tokens == _hf_generate(model, PROMPTS[batch], pad)
    reference = _hf_step_logits(model, PROMPTS[batch], ours.tokens, pad)
    tol = tolerance_for("model", "onnxruntime", "float32")
    assert len(ours.step_logits) == len(reference) >= 1
    for step, (got, want) in enumerate(zip(ours.step_logits, reference)):
        res = compare(got, want, tol, name=f"logits step {step}", dtype="float32")
        assert res.passed, res.summary()


def test_float16_tokens_match_torch_in_float16_while_torch_agrees_with_float32():
    folder, result = exported_kv("llama", "float16")
    assert result.parity.status == "pass", result.parity.reason
    half, full = hf_model("llama", "float16"), hf_model("llama", "float32")
    prompts = PROMPTS[3]
    with KVCacheModel(folder) as kv:
        pad = kv.special["pad_token_id"]
        ours = generate(kv, prompts, max_new_tokens=NEW_TOKENS, return_logits=True)
    torch_half, torch_full = _hf_generate(half, prompts, pad), _hf_generate(full, prompts, pad)
    agree = [r for r in range(len(prompts)) if torch_half[r] == torch_full[r]]
    assert agree, "torch's own float16 and float32 runs disagree on every row: nothing to compare"
    assert [ours.tokens[r] for r in agree] == [torch_half[r] for r in agree]
    reference = _hf_step_logits(half, prompts, ours.tokens, pad)
    tol = tolerance_for("model", "onnxruntime", "float16")
    for step, (got, want) in enumerate(zip(ours.step_logits, reference)):
        res = compare(got.astype(np.float16), want.astype(np.float16), tol, name=f"logits step {step}",
                      dtype="float16")
        assert res.passed, res.summary()


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3's config has no end-of-sequence token
def test_onnxruntime_genai_generates_our_tokens_from_the_folder_unmodified(family):
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install "
                                                         "onnxruntime-genai==0.18.0)")
    folder, _ = exported_kv(family)
    prompt = PROMPTS[1][0]
    with KVCacheModel(folder) as kv:
        ours = generate(kv, [prompt], max_new_tokens=NEW_TOKENS)
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + NEW_TOKENS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    theirs = [int(t) for t in generator.get_sequence(0)][len(prompt):]
    assert theirs == ours.tokens[0][:len(theirs)] and len(theirs) == len(ours.tokens[0])


def test_sampling_is_seeded_and_stays_in_the_top_k():
    from rmsnorm_deploy.serving.generate import Sampling

    folder, _ = exported_kv("llama")
    with KVCacheModel(folder) as kv:
        greedy = generate(kv, PROMPTS[1], max_new_tokens=8, return_logits=True, eos_token_id=None)
        a = generate(kv, PROMPTS[1], max_new_tokens=8, sampling=Sampling(True, seed=3, temperature=0.7, top_k=1),
                     eos_token_id=None)
        b = generate(kv, PROMPTS[1], max_new_tokens=8, sampling=Sampling(True, seed=3, temperature=5.0),
                     eos_token_id=None)
        c = generate(kv, PROMPTS[1], max_new_tokens=8, sampling=Sampling(True, seed=3, temperature=5.0),
                     eos_token_id=None)
    assert a.tokens == greedy.tokens  # top-1 sampling is greedy
    assert b.tokens == c.tokens  # same seed, same tokens
    assert b.tokens != greedy.tokens  # a hot sampler leaves the greedy path on a random model
    assert greedy.prefill_ms > 0 and greedy.decode_ms_per_token > 0 and greedy.steps == 7
    assert greedy.tokens_per_s == pytest.approx(1000 / greedy.decode_ms_per_token)
