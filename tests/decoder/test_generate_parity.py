"""Generation from `export --kv-cache` graphs against transformers with its own cache, and through onnxruntime-genai.

Each family's tiny model is exported once per process (tests/kv_models.py: torch.onnx takes
20-30 s per family on 2 cores, the reason these tests are marked slow); every test here then
runs in about a second.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.kv_models import KV_FAMILIES, exported_kv, hf_model

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.decoder.convention import left_padded
from rmsnorm_deploy.decoder.transformers_step import transformers_generate, transformers_steps
from rmsnorm_deploy.decoder.generate import KVCacheModel, generate
from rmsnorm_deploy.decoder.genai_client import genai_greedy

pytest.importorskip("transformers", reason="transformers builds the reference models")
pytest.importorskip("onnxruntime", reason="the generation loop runs in ONNX Runtime")
pytestmark = pytest.mark.slow

NEW_TOKENS = 32
#: Batch 1, and batch 3 with prompts of different lengths (left padding).
PROMPTS = {1: [[5, 17, 99, 3, 250, 41, 7]], 3: [[5, 17, 99, 3, 250, 41, 7], [11, 12, 13], [200, 1, 64, 64, 9]]}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", KV_FAMILIES)
def test_greedy_tokens_and_step_logits_match_transformers(family, batch):
    folder, result = exported_kv(family)
    assert result.parity.status == "pass", result.parity.reason
    model = hf_model(family)
    with KVCacheModel(folder) as kv:
        pad = kv.special["pad_token_id"]
        ours = generate(kv, PROMPTS[batch], max_new_tokens=NEW_TOKENS, return_logits=True)
    ids, mask = left_padded(PROMPTS[batch], pad)
    assert ours.tokens == transformers_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, pad_token_id=pad).tolist()
    reference = transformers_steps(model, ids, mask, tokens=ours.tokens).step_logits
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
    ids, mask = left_padded(prompts, pad)
    torch_half, torch_full = (transformers_generate(m, ids, mask, max_new_tokens=NEW_TOKENS, pad_token_id=pad).tolist()
                              for m in (half, full))
    agree = [r for r in range(len(prompts)) if torch_half[r] == torch_full[r]]
    assert agree, "torch's own float16 and float32 runs disagree on every row: nothing to compare"
    assert [ours.tokens[r] for r in agree] == [torch_half[r] for r in agree]
    reference = transformers_steps(half, ids, mask, tokens=ours.tokens).step_logits
    tol = tolerance_for("model", "onnxruntime", "float16")
    for step, (got, want) in enumerate(zip(ours.step_logits, reference)):
        res = compare(got.astype(np.float16), want.astype(np.float16), tol, name=f"logits step {step}",
                      dtype="float16")
        assert res.passed, res.summary()


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3's config has no end-of-sequence token
def test_onnxruntime_genai_generates_our_tokens_from_the_folder_unmodified(family):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install "
                                                         "onnxruntime-genai==0.18.0)")
    folder, _ = exported_kv(family)
    prompt = PROMPTS[1][0]
    with KVCacheModel(folder) as kv:
        ours = generate(kv, [prompt], max_new_tokens=NEW_TOKENS)
    theirs = genai_greedy(folder, prompt, NEW_TOKENS)
    assert theirs == ours.tokens[0][:len(theirs)] and len(theirs) == len(ours.tokens[0])


def test_sampling_is_seeded_and_stays_in_the_top_k():
    from rmsnorm_deploy.decoder.generate import Sampling

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
