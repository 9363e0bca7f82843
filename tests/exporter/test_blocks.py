"""The pre-norm model: its two-line block, causality, grouped-query attention, seeded weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.cases import DTYPES

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.contract.reference import SpecRMSNorm, reference
from rmsnorm_deploy.exporter.blocks import (
    ModelArgs,
    ModelArgsError,
    build_model,
    rotary_cos_sin,
)

SMALL = ModelArgs(vocab_size=97, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=40, max_seq_len=64)
VARIANTS = {
    "gqa": SMALL,
    "mha": dataclasses.replace(SMALL, n_kv_heads=None),
    "qk_norm+head_dim": dataclasses.replace(SMALL, head_dim=8, qk_norm=True, norm=RMSNormSpec.llama(1e-6)),
    "gemma-like": dataclasses.replace(SMALL, activation="gelu_tanh", embedding_scale=True, tie_embeddings=True,
                                      n_kv_heads=1, norm=RMSNormSpec.gemma(1e-6)),
    "bias+nogain": dataclasses.replace(SMALL, attention_bias=True, norm=RMSNormSpec(1e-5, gain="none")),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_count_and_norm_count_match_the_built_model(name):
    args = VARIANTS[name]
    model = build_model(args, "float32")
    assert sum(p.numel() for p in model.parameters()) == args.parameter_count()
    norms = [m for m in model.modules() if isinstance(m, SpecRMSNorm)]
    assert len(norms) == args.norm_count()
    assert all(n.spec == args.norm for n in norms)


def test_block_is_the_two_pre_norm_lines():
    model = build_model(SMALL, "float32", seed=3)
    block = model.layers[0]
    x = torch.randn(2, 5, SMALL.dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary_cos_sin(5, SMALL.resolved_head_dim, SMALL.rope_theta, x.dtype)
    with torch.no_grad():
        h = x + block.attention(reference(SMALL.norm, x, block.attention_norm.weight), cos, sin)
        expected = h + block.feed_forward(reference(SMALL.norm, h, block.ffn_norm.weight))
        assert torch.equal(block(x, cos, sin), expected)


@pytest.mark.parametrize("name", ["gqa", "qk_norm+head_dim", "gemma-like"])
def test_attention_is_causal(name):
    model = build_model(VARIANTS[name], "float32", seed=1)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 9), generator=gen)
    changed = ids.clone()
    changed[:, 6:] = torch.randint(0, 97, (2, 3), generator=gen)
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :6], b[:, :6])  # the past never sees the future
    assert not torch.equal(a[:, 6:], b[:, 6:])


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads():
    gqa = build_model(SMALL, "float32", seed=5)
    mha_args = dataclasses.replace(SMALL, n_kv_heads=None)
    mha = build_model(mha_args, "float32", seed=5)
    hd, rep = SMALL.resolved_head_dim, SMALL.n_heads // SMALL.kv_heads
    with torch.no_grad():
        state = {k: v for k, v in gqa.state_dict().items() if not k.endswith(("wk.weight", "wv.weight"))}
        mha.load_state_dict(state, strict=False)  # all but wk, wv (shapes differ): copied repeated below
        for g, m in zip(gqa.layers, mha.layers):
            for name in ("wk", "wv"):
                w = getattr(g.attention, name).weight.view(SMALL.kv_heads, hd, SMALL.dim)
                getattr(m.attention, name).weight.copy_(w.repeat_interleave(rep, dim=0).reshape(-1, SMALL.dim))
        ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(gqa(ids), mha(ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_are_seeded_and_the_same_numbers_in_every_dtype(dtype):
    a = build_model(SMALL, dtype, seed=11)
    b = build_model(SMALL, dtype, seed=11)
    ref = build_model(SMALL, "float32", seed=11)
    other = build_model(SMALL, "float32", seed=12)
    for (name, pa), pb, pr, po in zip(a.named_parameters(), b.parameters(), ref.parameters(), other.parameters()):
        assert pa.dtype == torch_dtype(dtype)
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, pr.to(pa.dtype)), name  # drawn in float32, then rounded
        assert not torch.equal(pr, po), name


def test_norm_gains_are_random_around_their_identity():
    model = build_model(VARIANTS["gemma-like"], "float32")
    gains = torch.cat([m.weight.detach() for m in model.modules() if isinstance(m, SpecRMSNorm)])
    assert abs(float(gains.mean())) < 0.05 and 0.05 < float(gains.std()) < 0.2  # offset gain: 1 + w, w ~ N(0, 0.1)
    model = build_model(SMALL, "float32")
    gains = torch.cat([m.weight.detach() for m in model.modules() if isinstance(m, SpecRMSNorm)])
    assert abs(float(gains.mean()) - 1) < 0.05 and float(gains.std()) > 0.05


def test_rotary_angles_start_at_zero_and_follow_theta():
    cos, sin = rotary_cos_sin(4, 8, 10000.0, torch.float32)
    assert torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))
    # position 1, first frequency (1 / theta^0 = 1): angle 1 rad
    assert float(cos[1, 0]) == pytest.approx(torch.cos(torch.tensor(1.0)).item())


@pytest.mark.parametrize("fields, message", [
    ({"n_kv_heads": 3}, "n_heads 4 is not a multiple of n_kv_heads 3"),
    ({"head_dim": 7}, "head_dim 7 must be even"),
    ({"dim": 26}, "dim 26 is not a multiple of n_heads 4"),
    ({"activation": "relu"}, "unknown activation 'relu'"),
    ({"n_layers": 0}, "n_layers must be an integer >= 1"),
    ({"norm": RMSNormSpec(normalized_dims=2)}, "normalized_dims must be 1"),
])
def test_bad_args_are_refused_by_name(fields, message):
    with pytest.raises(ModelArgsError, match=message):
        dataclasses.replace(SMALL, **fields)


def test_args_round_trip_through_dicts():
    args = VARIANTS["qk_norm+head_dim"]
    assert ModelArgs.from_dict(args.to_dict()) == args
    with pytest.raises(ModelArgsError, match=r"unknown model field\(s\) \['hidden'\]"):
        ModelArgs.from_dict({**args.to_dict(), "hidden": 3})
    with pytest.raises(ModelArgsError, match=r"missing model field\(s\) \['dim'\]"):
        ModelArgs.from_dict({k: v for k, v in args.to_dict().items() if k != "dim"})
