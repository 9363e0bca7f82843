"""Norm detection: every known class maps to its spec, confirmed bit for bit; unknown norms are refused."""

from __future__ import annotations

import importlib

import pytest
import torch
from tests.cases import DTYPES

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.contract.reference import SpecRMSNorm
from rmsnorm_deploy.exporter.detect import (
    KNOWN_CLASSES,
    NormMismatchError,
    UnknownNormError,
    detect_norms,
)

pytest.importorskip("transformers", reason="transformers is needed for the HF norm classes")

HIDDEN = 24


def _hf_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _make(path: str) -> torch.nn.Module:
    if path.startswith("torch."):
        return torch.nn.RMSNorm(HIDDEN, eps=1e-5)
    return _hf_class(path)(HIDDEN, eps=1e-5)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        module.weight.add_(torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.3)


from rmsnorm_deploy.exporter.gated import GAINLESS_CAPABLE_CLASSES, GATED_CLASSES  # noqa: E402


class Wrapper(torch.nn.Module):
    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", [p for p in KNOWN_CLASSES if p not in GATED_CLASSES and p not in GAINLESS_CAPABLE_CLASSES])
def test_each_known_class_is_detected_and_confirmed(path, dtype):  # gated.py's classes: tests/exporter/test_gated.py
    norm = _make(path)
    _randomize(norm, seed=len(path))
    model = Wrapper(block=Wrapper(norm=norm.to(torch_dtype(dtype))))
    detection = detect_norms(model)
    (found,) = detection.norms
    assert found.path == "block.norm" and found.class_name == path and found.how == "known class"
    assert found.spec.epsilon == 1e-5 and found.spec.normalized_dims == 1
    expected_gain = "offset" if "Gemma" in path else "weight"
    expected_order = "scale_then_cast" if ("Gemma" in path or "Olmo2" in path or path.startswith("torch.")) else "cast_then_scale"
    assert (found.spec.gain, found.spec.order) == (expected_gain, expected_order)
    assert found.dtype == torch_dtype(dtype) and found.weight is norm.weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_rmsnorm_without_eps_uses_float32_machine_epsilon_and_multi_dim_shapes(dtype):
    # torch computes half inputs in float32 and takes that dtype's epsilon (confirmation proves it:
    # the half dtype's own epsilon differs in the small-magnitude rows).
    model = Wrapper(a=torch.nn.RMSNorm((3, 8), elementwise_affine=False), b=torch.nn.RMSNorm(8).to(torch_dtype(dtype)))
    specs = detect_norms(model, dtype=dtype).specs
    eps = torch.finfo(torch.float32).eps
    assert specs["a"] == RMSNormSpec(eps, normalized_dims=2, gain="none", order="scale_then_cast")
    assert specs["b"] == RMSNormSpec(eps, gain="weight", order="scale_then_cast")


class DeclaredNorm(torch.nn.Module):
    """A user norm that says what it computes (it computes Gemma's RMSNorm, written its own way)."""

    rmsnorm_spec = RMSNormSpec.gemma(1e-6)

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden) * 0.2)
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_user_class_declaring_its_spec_is_confirmed(dtype):
    model = Wrapper(norm=DeclaredNorm(HIDDEN).to(torch_dtype(dtype)), spec_norm=SpecRMSNorm(RMSNormSpec.olmo2(1e-5), HIDDEN))
    detection = detect_norms(model)
    assert [n.how for n in detection.norms] == ["declared rmsnorm_spec", "SpecRMSNorm"]
    assert detection.specs == {"norm": RMSNormSpec.gemma(1e-6), "spec_norm": RMSNormSpec.olmo2(1e-5)}


def test_a_wrong_epsilon_is_caught_by_confirmation():
    # Rows as small as 1e-3 make epsilon visible: 1e-6 declared, 1e-3 computed.
    model = Wrapper(layers=Wrapper(n=DeclaredNorm(HIDDEN, eps=1e-3)))
    with pytest.raises(NormMismatchError, match=r"norm 'layers.n' \(.*DeclaredNorm\) differs from its spec"):
        detect_norms(model)


def test_a_wrong_rounding_order_is_caught_in_half_precision():
    class LlamaOrderDeclaredAsTorch(DeclaredNorm):
        rmsnorm_spec = RMSNormSpec(1e-6, gain="weight", order="scale_then_cast")

        def forward(self, x):  # HF Llama's order: round the normalized value, then scale in half
            xf = x.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    norm = LlamaOrderDeclaredAsTorch(760).half()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(760, generator=torch.Generator().manual_seed(0)).half() * 0.5 + 1)
    with pytest.raises(NormMismatchError, match="differs from its spec"):
        detect_norms(Wrapper(n=norm))


def test_unknown_norm_like_module_is_refused_with_its_path_and_class():
    class ScaleNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.g = torch.nn.Parameter(torch.ones(1))
            self.normalized_shape = (HIDDEN,)

        def forward(self, x):
            return self.g * x / x.norm(dim=-1, keepdim=True)

    model = Wrapper(encoder=Wrapper(final=ScaleNorm()))
    with pytest.raises(UnknownNormError, match=r"module 'encoder.final' \(.*ScaleNorm\) computes none of the \d+ "
                                               r"candidate RMSNorm specs bit for bit.*closest: nogain"):
        detect_norms(model)


def test_subclass_of_a_known_class_is_not_assumed_to_compute_the_same():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class MyRMSNorm(LlamaRMSNorm):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(UnknownNormError, match=r"module 'n' \(.*MyRMSNorm\) computes none of the"):
        detect_norms(Wrapper(n=MyRMSNorm(HIDDEN)))


def test_declared_spec_must_be_a_spec():
    class Bad(torch.nn.Module):
        rmsnorm_spec = "llama"

    with pytest.raises(UnknownNormError, match="rmsnorm_spec is a str; set it to an RMSNormSpec"):
        detect_norms(Wrapper(n=Bad()))


def test_other_normalizations_are_left_alone_and_listed():
    model = Wrapper(ln=torch.nn.LayerNorm(HIDDEN), gn=torch.nn.GroupNorm(2, HIDDEN), rms=torch.nn.RMSNorm(HIDDEN))
    detection = detect_norms(model)
    assert [n.path for n in detection.norms] == ["rms"]
    assert detection.other_norms == [("ln", "torch.nn.modules.normalization.LayerNorm"),
                                     ("gn", "torch.nn.modules.normalization.GroupNorm")]


def test_spec_rmsnorm_multi_axis_is_confirmed():
    spec = RMSNormSpec(1e-6, normalized_dims=2, gain="weight", order="cast_then_scale")
    model = Wrapper(n=SpecRMSNorm(spec, (3, 7), dtype=torch.bfloat16))
    (found,) = detect_norms(model).norms
    assert found.normalized_shape == (3, 7) and found.spec == spec
