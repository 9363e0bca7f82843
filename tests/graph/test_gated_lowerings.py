"""Gated and grouped norms as ONNX: the function and inline lowerings carry the gate and match the
float64 oracle in ONNX Runtime CPU; native, ort and plugin refuse with the reason; the audit
reports the gate and a float32 reduction.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tests.cases import DTYPES

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.dtypes import to_torch
from rmsnorm_deploy.contract.inputs import activations
from rmsnorm_deploy.contract.reference import oracle
from rmsnorm_deploy.errors import LoweringError
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.function import function_proto, input_names, rmsnorm_node, spec_from_node
from rmsnorm_deploy.graph.lowerings import lower_model, refusal
from rmsnorm_deploy.graph.standalone import rmsnorm_model
from rmsnorm_deploy.validate.lowering_sweep import SweepCase, run_case

ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime (pip install 'rmsnorm-deploy[onnxruntime]')")

SPECS = {
    "mamba2": RMSNormSpec.mamba2_gated(1e-5),
    "qwen3_next": RMSNormSpec.qwen3_next_gated(1e-6),
    "kimi": RMSNormSpec.kimi_gated(1e-6),
    "nogain_after_cast": RMSNormSpec(1e-6, gain="none", gate="silu", gate_placement="after_cast"),
    "offset_sigmoid_before": RMSNormSpec(1e-6, gain="offset", gate="sigmoid", gate_placement="before_norm"),
}
GROUPED = {
    "mamba2_groups": RMSNormSpec.mamba2_gated(1e-5, group_size=19),
    "falcon_h1_groups": RMSNormSpec(1e-6, order="scale_then_cast", gate="silu", gate_placement="after_norm",
                                    group_size=19),
    "llama_groups": RMSNormSpec(1e-6, order="cast_then_scale", group_size=19),
}


def _check(case: SweepCase) -> None:
    row = run_case(case)
    assert row.status == "pass", row.detail
    assert row.ort_accumulation == "float32"  # ONNX Runtime still reduces in float32 (never in half)


@pytest.mark.parametrize("shape", [(1, 7), (199, 760)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("lowering, optimization", [("function", "all"), ("inline", "disable")])
def test_gated_lowering_matches_oracle(lowering, spec_name, dtype, shape, optimization):
    _check(SweepCase(spec_name, SPECS[spec_name], dtype, lowering, optimization, shape, seed=shape[0] + shape[1]))


@pytest.mark.parametrize("shape", [(199, 760)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_name", list(GROUPED))
@pytest.mark.parametrize("lowering", ["function", "inline"])
def test_grouped_lowering_matches_oracle(lowering, spec_name, dtype, shape):
    _check(SweepCase(spec_name, GROUPED[spec_name], dtype, lowering, "all", shape, seed=shape[1]))


def test_float32_stress_inputs_pass():
    for name, spec in SPECS.items():
        _check(SweepCase(name, spec, "float32", "function", "all", (199, 760), inputs="stress"))


def test_float16_overflow_where_the_exact_value_is_out_of_range():
    # silu(z) after the norm is unbounded: with stress inputs the exact product exceeds float16's
    # range, and ONNX Runtime gives inf exactly there (as the torch reference and the HF module do).
    spec = SPECS["qwen3_next"]
    model = rmsnorm_model(spec, dtype="float16", shape=(199, 760))
    x = activations((199, 760), "float16", seed=1, kind="stress")
    z = activations((199, 760), "float16", seed=2, kind="stress")
    w = np.ones(760, dtype=np.float16)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "weight": w, "z": z})[0]
    exact = oracle(spec, to_torch(x), to_torch(w), to_torch(z)).numpy()
    # float16's max is 65504; the norm is rounded once before the gate multiplies it, so within a
    # few ulps of the boundary either side is right.
    out_of_range, in_range = np.abs(exact) > 65520 * 1.004, np.abs(exact) < 65504 * 0.996
    assert out_of_range.sum() > 100 and not np.isnan(y).any()
    assert np.isinf(y[out_of_range]).all() and np.isfinite(y[in_range]).all()
    assert np.array_equal(np.sign(y[out_of_range]), np.sign(exact[out_of_range]))


@pytest.mark.parametrize("lowering, start", [
    ("native", "RMSNormalization has no gate input"),
    ("ort", "SimplifiedLayerNormalization has no gate input"),
    ("plugin", "the TensorRT plugin's kernel has no gate input"),
])
def test_other_lowerings_refuse_a_gate_with_the_reason(lowering, start):
    reason = refusal(lowering, SPECS["mamba2"], True, 23)
    assert reason == f"{start}; this spec is gated by silu(z) (before norm): use the function or inline lowering"
    with pytest.raises(LoweringError, match=f"cannot lower RMSNorm node 'rmsnorm' to '{lowering}': {start}"):
        rmsnorm_model(SPECS["mamba2"], dtype="float16", shape=(2, 8), lowering=lowering)
    assert refusal("function", SPECS["mamba2"], True, 18) is None
    assert refusal("inline", SPECS["mamba2"], True, 18) is None


@pytest.mark.parametrize("lowering, message", [
    ("native", "RMSNormalization normalizes whole trailing dims; this spec normalizes the last dim in groups of 19"),
    ("ort", "SimplifiedLayerNormalization normalizes whole trailing dims; this spec normalizes the last dim in groups"),
    ("plugin", "the TensorRT plugin's kernel normalizes whole trailing dims; this spec normalizes the last dim in groups of 19"),
])
def test_other_lowerings_refuse_groups_with_the_reason(lowering, message):
    assert refusal(lowering, GROUPED["llama_groups"], False, 23).startswith(message)


def test_gated_node_carries_the_spec_and_the_gate_input():
    spec = GROUPED["mamba2_groups"]
    node = rmsnorm_node(spec, "float16", input_names(spec), ["y"], name="n")
    assert list(node.input) == ["x", "weight", "z"] and input_names(RMSNormSpec(gain="none", gate="silu")) == ["x", "z"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["gate"] == b"silu" and attrs["gate_placement"] == b"before_norm" and attrs["group_size"] == 19
    assert spec_from_node(node) == dataclasses.replace(spec, epsilon=spec.epsilon_float32)
    fn = function_proto(spec, True, 18)
    assert list(fn.input) == ["x", "weight", "z"] and "group_size" in fn.attribute
    assert fn.overload == node.overload == "weight.cast_then_scale.acc_float32.grouped.gate_silu_before_norm.upcast"
    # ONNX Runtime's CPU Sigmoid is an approximation (see test_onnxruntime_sigmoid_is_inexact): not used.
    assert "Sigmoid" not in {n.op_type for n in fn.node} and "Exp" in {n.op_type for n in fn.node}


def test_ungated_nodes_are_unchanged():
    node = rmsnorm_node(RMSNormSpec.llama(1e-5), "float16", ["x", "weight"], ["y"])
    assert sorted(a.name for a in node.attribute) == sorted(
        ["epsilon", "axes", "gain", "order", "accumulation", "epsilon_placement"])
    assert list(function_proto(RMSNormSpec.llama(1e-5), True, 18).input) == ["x", "weight"]


def test_a_node_whose_inputs_do_not_match_its_spec_is_refused():
    model = rmsnorm_model(SPECS["kimi"], dtype="float32", shape=(2, 8), lowering="function")
    node = model.graph.node[0]
    del node.input[2]  # the gate
    with pytest.raises(LoweringError, match=r"has inputs \['x', 'weight'\] but its spec .* takes 3: x, weight, z"):
        lower_model(model, "inline")


def test_audit_reports_the_gate_and_a_float32_reduction():
    for spec in list(SPECS.values()) + [GROUPED["mamba2_groups"]]:
        model = rmsnorm_model(spec, dtype="bfloat16", shape=(3, 38), lowering="function")
        (red,) = audit_model(model)
        assert red.kind == "RMSNorm" and red.accumulation == "float32" and not red.low_precision
        assert red.input_dtype == "bfloat16" and red.node == "rmsnorm"
        assert red.gate == f"{spec.gate}(z) {spec.gate_placement}"
        assert red.tensors.gate == "z" and red.tensors.output == "y"
        assert red.tensors.gain == ("weight" if spec.has_gain else None)
        assert red.implied_spec() == dataclasses.replace(spec, epsilon=spec.epsilon_float32)
        assert "gated by" in red.note


def test_onnxruntime_sigmoid_is_inexact():
    # Why the function body writes sigmoid as 1 / (1 + Exp(-z)): ONNX Runtime's CPU Sigmoid has an
    # absolute error of ~1.5e-7, which is millions of ulps where sigmoid(z) is tiny.
    z = np.linspace(-30, 0, 30001, dtype=np.float32)
    graph = helper.make_graph([helper.make_node("Sigmoid", ["z"], ["y"])], "g",
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"z": z})[0]
    exact = 1.0 / (1.0 + np.exp(-z.astype(np.float64)))
    ulps = np.abs(y - exact) / np.spacing(exact.astype(np.float32))
    spec = RMSNormSpec(gain="none", gate="sigmoid", gate_placement="after_norm")
    gated = rmsnorm_model(spec, dtype="float32", shape=(1, 30001))
    x = np.ones((1, 30001), dtype=np.float32)
    ours = ort.InferenceSession(gated.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "z": z[None]})[0][0]
    ideal = oracle(spec, to_torch(x), None, to_torch(z[None])).numpy()[0]
    ours_ulps = np.abs(ours - ideal) / np.spacing(ideal.astype(np.float32))
    assert ulps.max() > 1e4 and ours_ulps.max() <= 4
    onnx.checker.check_model(gated)


def test_a_float32_input_with_a_float16_weight_and_gate_gets_the_casting_variant(tmp_path):
    """Bamba's gated norm in a float16 model takes a float32 x with a float16 weight and gate:
    the function must cast them (the float32 variant mixed float16 and float32 and failed
    onnx.checker); the output stays float32, as the module's is."""
    spec = RMSNormSpec.mamba2_gated(1e-5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 8)).astype(np.float32)
    z = rng.normal(size=(3, 8)).astype(np.float16)
    w = rng.uniform(0.5, 1.5, 8).astype(np.float16)
    node = rmsnorm_node(spec, "float16", ["x", "w", "z"], ["y"], name="norm")
    graph = helper.make_graph(
        [node], "mixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8]),
                          helper.make_tensor_value_info("z", TensorProto.FLOAT16, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])], [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("rmsnorm_deploy", 1)])
    model = lower_model(model, "function")
    onnx.checker.check_model(model, full_check=True)
    y = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x, "z": z})[0]
    want = oracle(spec, to_torch(x), to_torch(w.astype(np.float32)), to_torch(z.astype(np.float32))).numpy()
    assert y.dtype == np.float32 and np.allclose(y, want, rtol=1e-6, atol=1e-6)
