"""The torch reference is bit-equal to the modules its specs describe; the oracle bounds it.

Reference modules (transformers 5.x, models/*/modeling_*.py):
LlamaRMSNorm, MistralRMSNorm, Qwen2/3RMSNorm, Phi3RMSNorm, DeepseekV3RMSNorm:
    ``self.weight * hidden_states.to(input_dtype)`` after ``x * rsqrt(mean(x^2) + eps)`` in float32
GemmaRMSNorm / Gemma2RMSNorm / Gemma3RMSNorm: ``(x * rsqrt(...)) * (1.0 + self.weight.float())``, then ``type_as(x)``
Olmo2RMSNorm: ``(self.weight * hidden_states).to(input_dtype)``
T5LayerNorm: ``x * rsqrt(...)``, ``.to(weight.dtype)`` if half, then ``self.weight * x``
torch.nn.RMSNorm: ``F.rms_norm``, scaling in float32 before the cast
"""

from __future__ import annotations

import pytest
import torch
from tests.cases import DTYPES, ODD_SHAPES

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.contract.reference import SpecRMSNorm, oracle, reference
from rmsnorm_deploy.contract.tolerances import tolerance_for

transformers = pytest.importorskip("transformers", reason="transformers is needed for the HF reference classes")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402
from transformers.models.t5.modeling_t5 import T5LayerNorm  # noqa: E402

EPS = 1e-6

MODULES = {
    "torch.nn.RMSNorm": (lambda h: torch.nn.RMSNorm(h, eps=EPS), RMSNormSpec.torch_rmsnorm(EPS)),
    "torch.nn.RMSNorm(no affine)": (
        lambda h: torch.nn.RMSNorm(h, eps=EPS, elementwise_affine=False), RMSNormSpec.torch_rmsnorm(EPS, affine=False)),
    "LlamaRMSNorm": (lambda h: LlamaRMSNorm(h, eps=EPS), RMSNormSpec.llama(EPS)),
    "Qwen3RMSNorm": (lambda h: Qwen3RMSNorm(h, eps=EPS), RMSNormSpec.llama(EPS)),
    "GemmaRMSNorm": (lambda h: GemmaRMSNorm(h, eps=EPS), RMSNormSpec.gemma(EPS)),
    "Gemma3RMSNorm": (lambda h: Gemma3RMSNorm(h, eps=EPS), RMSNormSpec.gemma(EPS)),
    "Olmo2RMSNorm": (lambda h: Olmo2RMSNorm(h, eps=EPS), RMSNormSpec.olmo2(EPS)),
    "T5LayerNorm": (lambda h: T5LayerNorm(h, eps=EPS), RMSNormSpec.llama(EPS)),
}


def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    weight = getattr(module, "weight", None)
    if weight is not None:
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5 + (0.0 if "Gemma" in type(module).__name__ else 1.0))


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MODULES))
def test_reference_is_bit_equal_to_module(name, dtype, shape):
    make, spec = MODULES[name]
    gen = torch.Generator().manual_seed(hash((name, dtype, shape)) % 2**31)
    module = make(shape[-1])
    _randomize(module, gen)
    module = module.to(torch_dtype(dtype))
    x = (torch.randn(shape, generator=gen) * 3).to(torch_dtype(dtype))
    with torch.no_grad():
        expected = module(x)
        got = reference(spec, x, getattr(module, "weight", None))
    assert got.dtype == expected.dtype == x.dtype
    mismatched = (got.view(torch.int16 if dtype != "float32" else torch.int32)
                  != expected.view(torch.int16 if dtype != "float32" else torch.int32)).sum().item()
    assert mismatched == 0, f"{mismatched} of {x.numel()} elements differ from {name}"


def test_cast_then_scale_and_scale_then_cast_really_differ_in_half():
    # Otherwise the bit-equality tests above could not tell the orders apart.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(199, 760, generator=gen).half()
    w = (torch.randn(760, generator=gen) * 0.5 + 1).half()
    a = reference(RMSNormSpec.llama(EPS), x, w)
    b = reference(RMSNormSpec.olmo2(EPS), x, w)
    assert (a != b).sum().item() > 1000


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_name", ["torch", "llama", "gemma", "nogain"])
def test_reference_is_within_tolerance_of_oracle(spec_name, dtype, shape):
    from rmsnorm_deploy.contract.spec import named_specs

    spec = named_specs()[spec_name]
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(shape, generator=gen) * 2).to(torch_dtype(dtype))
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(torch_dtype(dtype)) if spec.has_gain else None
    result = compare(reference(spec, x, w), oracle(spec, x, w), tolerance_for("norm", "torch", dtype))
    assert result, result.summary()


def test_oracle_is_float64_and_unrounded():
    spec = RMSNormSpec.llama(EPS)
    x = torch.randn(4, 7).half()
    w = torch.ones(7).half()
    out = oracle(spec, x, w)
    assert out.dtype == torch.float64
    assert (out.half().double() != out).any()  # not rounded to float16


def test_multi_axis_spec_normalizes_jointly():
    spec = RMSNormSpec(EPS, normalized_dims=2, gain="none")
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    expected = x / torch.sqrt(x.pow(2).mean(dim=(-2, -1), keepdim=True) + spec.epsilon_float32)
    torch.testing.assert_close(oracle(spec, x), expected, rtol=0, atol=0)


def test_epsilon_outside_sqrt():
    spec = RMSNormSpec(1e-2, gain="none", epsilon_placement="outside_sqrt")
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    rms = torch.sqrt(torch.tensor(12.5, dtype=torch.float64))
    torch.testing.assert_close(oracle(spec, x), x / (rms + spec.epsilon_float32))


def test_spec_module_computes_reference_and_checks_shape():
    module = SpecRMSNorm(RMSNormSpec.gemma(EPS), 8, dtype="bfloat16")
    assert module.weight.dtype == torch.bfloat16 and torch.all(module.weight == 0)
    x = torch.randn(2, 8).bfloat16()
    assert torch.equal(module(x), reference(module.spec, x, module.weight))
    with pytest.raises(ValueError, match="normalized_shape .* has 1 dims but the spec normalizes 2"):
        SpecRMSNorm(RMSNormSpec(normalized_dims=2), 8)
