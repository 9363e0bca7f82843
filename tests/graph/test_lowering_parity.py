"""Parity of every lowering in ONNX Runtime CPU against the float64 oracle.

lowering x spec variant x dtype x shape (hidden 1, 7, 760, 4096; rows 1, 199) x graph
optimization (ORT_DISABLE_ALL, ORT_ENABLE_ALL). A lowering that cannot represent a spec must
refuse with its reason; where ONNX Runtime's CPU provider has no kernel (bfloat16
RMSNormalization, bfloat16 SimplifiedLayerNormalization with a float32 scale) the test asserts
ONNX Runtime's exact refusal, which README.md documents.
"""

from __future__ import annotations

import pytest
from tests.cases import DTYPES, ODD_SHAPES

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.graph.lowerings import LOWERINGS, refusal
from rmsnorm_deploy.validate.lowering_sweep import SweepCase, run_case

pytest.importorskip("onnxruntime", reason="needs onnxruntime (pip install 'rmsnorm-deploy[onnxruntime]')")

SPECS = {
    "torch": RMSNormSpec.torch_rmsnorm(1e-6),
    "llama": RMSNormSpec.llama(1e-5),
    "gemma": RMSNormSpec.gemma(1e-6),
    "nogain": RMSNormSpec(1e-6, gain="none"),
    "offset_c2s": RMSNormSpec(1e-6, gain="offset", order="cast_then_scale"),
    "f64_eps_outside": RMSNormSpec(1e-3, accumulation="float64", epsilon_placement="outside_sqrt"),
}

# ONNX Runtime 1.31/1.32 CPU provider: no bfloat16 Mul (RMSNormalization's body falls back to it),
# no SimplifiedLayerNormalization(bfloat16 x, float32 scale) kernel.
ORT_CPU_GAPS = {
    ("native", "bfloat16"): "Could not find an implementation for Mul(14)",
    ("ort", "bfloat16", "offset"): "Could not find an implementation for SimplifiedLayerNormalization(1)",
}


def _expected_gap(lowering: str, dtype: str, spec: RMSNormSpec) -> str | None:
    return ORT_CPU_GAPS.get((lowering, dtype)) or ORT_CPU_GAPS.get((lowering, dtype, spec.gain))


@pytest.mark.parametrize("optimization", ["disable", "all"])
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_lowering_matches_oracle(lowering, spec_name, dtype, shape, optimization):
    spec = SPECS[spec_name]
    row = run_case(SweepCase(spec_name, spec, dtype, lowering, optimization, shape, seed=shape[0] + shape[1]))
    opset = 23 if lowering == "native" else 18
    reason = refusal(lowering, spec, spec.upcasts(dtype), opset)
    if reason is not None:
        assert (row.status, row.detail) == ("refused", reason)
        return
    gap = _expected_gap(lowering, dtype, spec)
    if gap is not None:
        assert row.status == "unsupported" and row.detail.startswith(gap), row.detail
        return
    assert row.status == "pass", row.detail
    # The graph ONNX Runtime ran still reduced in the spec's accumulation dtype (never in half).
    assert row.ort_accumulation == spec.accumulation


@pytest.mark.parametrize(
    ("spec_name", "dtype", "fused"),
    [
        ("torch", "float32", True),
        ("llama", "float32", True),
        ("gemma", "float32", True),
        ("torch", "float16", True),  # Cast -> SimplifiedLayerNormalization(float32) -> Cast
        ("gemma", "bfloat16", True),
        ("llama", "float16", False),  # the round trip of cast_then_scale is not a pattern ORT fuses
        ("nogain", "float32", False),  # no Mul by a scale: nothing for the fusion to anchor on
    ],
)
def test_which_function_graphs_onnxruntime_fuses(spec_name, dtype, fused):
    row = run_case(SweepCase(spec_name, SPECS[spec_name], dtype, "function", "all", (8, 64)))
    assert row.status == "pass"
    assert (row.ort_op == "SimplifiedLayerNormalization") is fused, row.ort_op


def test_onnxruntime_native_kernel_scales_in_float32():
    # ONNX defines RMSNormalization as cast_then_scale; ORT's CPU kernel applies the scale in
    # float32 before rounding, so on float16 it is within 1 ulp of the spec, not bit-equal.
    row = run_case(SweepCase("llama", SPECS["llama"], "float16", "native", "disable", (199, 760)))
    assert row.status == "pass"
    assert row.ulp_vs_oracle <= 0.51 and 0.5 < row.ulp_vs_reference <= 1.0
