"""Gated and grouped specs: fields, serialization, parsing, and the reference bit-equal to every
gated norm class of transformers (and Gemma3n/Gemma4's norms, with and without a gain).

Reference classes (transformers 5.24, models/*/modeling_*.py):
MambaRMSNormGated (Bamba, Zamba2, Nemotron-H, GraniteMoeHybrid): ``x.float() * silu(z.float())``,
    mean square per group of ``group_size``, ``x * rsqrt(.)``, then ``weight * x.to(input_dtype)``
FalconH1RMSNormGated: per group of ``dim / n_groups``, ``weight * x`` in float32, ``* silu(z.float())``
    after (``norm_before_gate``) or before the norm, one ``.to(input_dtype)``
Qwen3NextRMSNormGated (Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid, Qwen4-Exp): ``weight * x.to(input_dtype)``,
    then ``* act(z.float())`` and ``.to(input_dtype)`` again
KimiLinearRMSNormGated (Bailing-Hybrid, GLM-5-Next, LaraMini): ``weight.float() * x`` then
    ``* act(z.float())`` in float32, one ``.to(input_dtype)``
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch
from tests.cases import DTYPES

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.contract.reference import oracle, reference
from rmsnorm_deploy.contract.spec import gated_named_specs, named_specs, parse_spec
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import SpecError

pytest.importorskip("transformers", reason="transformers is needed for the HF gated norm classes")
from rmsnorm_deploy.exporter.gated import GAINLESS_CAPABLE_CLASSES, GATED_CLASSES  # noqa: E402

EPS = 1e-5
MAMBA2 = RMSNormSpec.mamba2_gated(1e-6)
QWEN3_NEXT = RMSNormSpec.qwen3_next_gated(1e-6)
KIMI = RMSNormSpec.kimi_gated(1e-6)
_OLD_FIELDS = ["epsilon", "normalized_dims", "gain", "order", "accumulation", "epsilon_placement"]


def _class(qualified: str) -> type:
    module, name = qualified.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _groups(qualified: str) -> bool:
    cls = _class(qualified)
    return cls.__name__ == "FalconH1RMSNormGated" or "group_size" in cls.__init__.__code__.co_varnames


def _build(qualified: str, hidden: int, groups: int) -> torch.nn.Module:
    """An instance of a gated class, the way its family constructs it."""
    cls, name = _class(qualified), qualified.rsplit(".", 1)[-1]
    if name == "FalconH1RMSNormGated":
        return cls(hidden, eps=EPS, n_groups=groups, norm_before_gate=True)
    if "group_size" in cls.__init__.__code__.co_varnames:
        return cls(hidden, group_size=hidden // groups, eps=EPS)
    if name == "Qwen4ExpTextRMSNormGated":
        return cls(hidden, eps=EPS, activation="sigmoid")  # its activation comes from the config
    return cls(hidden, eps=EPS)


def _inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.empty(shape[:-1] + (1,)).uniform_(-3, 2, generator=gen)
    x = (torch.randn(shape, generator=gen) * scale).to(dtype)
    z = (torch.randn(shape, generator=gen) * 3.0).to(dtype)
    return x, z


# -- the spec ---------------------------------------------------------------------------------
def test_ungated_specs_serialize_as_before():
    for spec in named_specs().values():
        assert list(spec.to_dict()) == _OLD_FIELDS
    assert all(spec.has_gate for spec in gated_named_specs().values())
    old = {"epsilon": 1e-5, "normalized_dims": 1, "gain": "weight", "order": "cast_then_scale",
           "accumulation": "float32", "epsilon_placement": "inside_sqrt"}
    assert RMSNormSpec.from_dict(old) == RMSNormSpec.llama(1e-5)
    assert json.dumps(RMSNormSpec.llama(1e-5).to_dict(), sort_keys=True) == json.dumps(old, sort_keys=True)
    assert RMSNormSpec.llama(1e-5).variant(True) == "weight.cast_then_scale.acc_float32.upcast"


@pytest.mark.parametrize("spec", [MAMBA2, dataclasses.replace(MAMBA2, group_size=32), QWEN3_NEXT, KIMI,
                                  RMSNormSpec(gain="none", group_size=8)])
def test_gated_specs_round_trip(spec):
    data = json.loads(json.dumps(spec.to_dict()))
    assert RMSNormSpec.from_dict(data) == spec
    assert ("gate" in data) == spec.has_gate and ("group_size" in data) == (spec.group_size is not None)


def test_variant_names_the_gate_and_the_grouping():
    assert MAMBA2.variant(True) == "weight.cast_then_scale.acc_float32.gate_silu_before_norm.upcast"
    assert dataclasses.replace(MAMBA2, group_size=8).variant(False) == (
        "weight.acc_float32.grouped.gate_silu_before_norm.same_dtype")
    assert KIMI.variant(True) == "weight.scale_then_cast.acc_float32.gate_sigmoid_after_norm.upcast"


@pytest.mark.parametrize("kwargs, message", [
    (dict(gate="gelu"), "unknown gate 'gelu'; choose one of none, silu, sigmoid"),
    (dict(gate_placement="before_norm"), "gate_placement 'before_norm' needs a gate"),
    (dict(gate="silu", gate_placement="inside"), "unknown gate_placement 'inside'"),
    (dict(group_size=0), "group_size must be an integer >= 1"),
    (dict(group_size=True), "group_size must be an integer >= 1"),
    (dict(group_size=4, normalized_dims=2), "group_size groups the last dim; it needs normalized_dims 1, got 2"),
])
def test_invalid_gate_fields_are_refused_with_their_reason(kwargs, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RMSNormSpec(**kwargs)


def test_describe_says_where_the_gate_is():
    assert MAMBA2.describe().endswith("gated: x * silu(z) normalized in place of x")
    assert QWEN3_NEXT.describe().endswith("gated: times silu(z) after the rounding back, rounded again")
    assert KIMI.describe().endswith("gated: times sigmoid(z) before the rounding back")
    assert "over the last dim in groups of 16" in dataclasses.replace(MAMBA2, group_size=16).describe()
    assert "gated" not in RMSNormSpec.llama().describe()


def test_field_help_explains_every_gate_choice():
    helps = RMSNormSpec.field_help()
    assert set(helps["gate"]) == {"none", "silu", "sigmoid"}
    assert set(helps["gate_placement"]) == {"before_norm", "after_norm", "after_cast"}


@pytest.mark.parametrize("text, expected", [
    ("llama", RMSNormSpec.llama(1e-6)),
    ("mamba2_gated,eps=1e-5,group_size=64", RMSNormSpec.mamba2_gated(1e-5, 64)),
    ("qwen3_next_gated", QWEN3_NEXT),
    ("eps=1e-6,gain=offset,order=scale_then_cast", RMSNormSpec.gemma(1e-6)),
    ("kimi_gated, gate=silu", RMSNormSpec.kimi_gated(1e-6, gate="silu")),
    ("gemma,gate=sigmoid,gate_placement=after_cast", RMSNormSpec(1e-6, gain="offset", gate="sigmoid",
                                                                  gate_placement="after_cast")),
])
def test_parse_spec_reads_names_and_fields(text, expected):
    assert parse_spec(text) == expected


@pytest.mark.parametrize("text, message", [
    ("", "an empty spec"),
    ("mamba3", "unknown named spec 'mamba3'"),
    ("llama,colour=red", "cannot read 'colour=red'"),
    ("llama,eps=small", "epsilon 'small' in spec 'llama,eps=small' is not a number"),
    ("llama,group_size=x", "group_size 'x'"),
    ("gate=tanh", "unknown gate 'tanh'"),
])
def test_parse_spec_errors_are_one_line(text, message):
    with pytest.raises(SpecError, match=message) as info:
        parse_spec(text)
    assert "\n" not in str(info.value)


# -- the reference against transformers --------------------------------------------------------
@pytest.mark.parametrize("shape, groups", [((1, 7), 1), ((199, 64), 2), ((3, 5, 760), 4)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"g{v}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qualified", sorted(GATED_CLASSES), ids=lambda q: q.rsplit(".", 1)[-1])
def test_reference_is_bit_equal_to_each_gated_class(qualified, dtype, shape, groups):
    dt = torch_dtype(dtype)
    hidden = shape[-1]
    module = _build(qualified, hidden, groups).to(dt)
    gen = torch.Generator().manual_seed(hidden)
    with torch.no_grad():
        module.weight.copy_(torch.randn(hidden, generator=gen).to(dt))
    spec = GATED_CLASSES[qualified](module, dt)
    assert spec.has_gate and spec.epsilon == EPS
    assert spec.group_size == (None if groups == 1 or not _groups(qualified) else hidden // groups)
    x, z = _inputs(shape, dt, seed=len(shape) + hidden)
    with torch.no_grad():
        got = module(x, z)
    want = reference(spec, x, module.weight, z)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("with_scale", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qualified", sorted(GAINLESS_CAPABLE_CLASSES), ids=lambda q: q.rsplit(".", 1)[-1])
def test_reference_is_bit_equal_to_gemma3n_style_norms(qualified, dtype, with_scale):
    dt = torch_dtype(dtype)
    module = _class(qualified)(760, eps=1e-6, with_scale=with_scale).to(dt)
    if with_scale:
        with torch.no_grad():
            module.weight.copy_(torch.randn(760, generator=torch.Generator().manual_seed(1)).to(dt))
    spec = GAINLESS_CAPABLE_CLASSES[qualified](module, dt)
    assert spec.gain == ("weight" if with_scale else "none") and spec.order == "scale_then_cast"
    x, _ = _inputs((199, 760), dt, seed=2)
    with torch.no_grad():
        assert torch.equal(module(x), reference(spec, x, module.weight if with_scale else None))


def test_a_gated_spec_needs_its_gate_and_an_ungated_one_refuses_it():
    x, z = _inputs((2, 8), torch.float32, seed=0)
    w = torch.ones(8)
    with pytest.raises(ValueError, match=r"gated by silu\(z\) but no gate input z was given"):
        reference(MAMBA2, x, w)
    with pytest.raises(ValueError, match="a gate input was given but the spec has no gate"):
        reference(RMSNormSpec.llama(), x, w, z)
    with pytest.raises(ValueError, match=r"the gate input must have the shape and dtype of x: got float16\[2, 8\]"):
        reference(MAMBA2, x, w, z.half())
    with pytest.raises(ValueError, match="the last dim 8 is not a multiple of group_size 3"):
        reference(dataclasses.replace(MAMBA2, group_size=3), x, w, z)


# -- the oracle bounds the reference ---------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 7), (199, 760), (199, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", [MAMBA2, QWEN3_NEXT, KIMI, dataclasses.replace(MAMBA2, group_size=1),
                                  RMSNormSpec(gain="offset", gate="sigmoid", gate_placement="after_cast")],
                         ids=["mamba2", "qwen3_next", "kimi", "mamba2_group1", "offset_after_cast"])
def test_reference_is_within_the_norm_tolerance_of_the_oracle(spec, dtype, shape):
    dt = torch_dtype(dtype)
    x, z = _inputs(shape, dt, seed=shape[0] + shape[1])
    w = torch.randn(shape[-1], generator=torch.Generator().manual_seed(5)).to(dt)
    got, ideal = reference(spec, x, w, z), oracle(spec, x, w, z)
    assert ideal.dtype == torch.float64
    result = compare(got, ideal, tolerance_for("norm", "torch", dtype), dtype=dtype, name="reference vs oracle")
    assert result, result.summary()
    assert result.shape == tuple(got.shape) and got.numel() > 0
