"""Every norm reduction in every model we build for float16/bfloat16 accumulates in float32.

The static half of the audit: read the graph as written (functions expanded) and find each
reduction with the dtype it accumulates in.
"""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.errors import LoweringError
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.reductions import low_precision_reductions
from rmsnorm_deploy.graph.lowerings import LOWERINGS
from rmsnorm_deploy.graph.standalone import rmsnorm_model

SPECS = {**named_specs(), "f64": RMSNormSpec(accumulation="float64"), "dims2": RMSNormSpec(normalized_dims=2)}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_every_half_model_reduces_in_its_accumulation_dtype(lowering, dtype):
    checked = 0
    for name, spec in SPECS.items():
        try:
            model = rmsnorm_model(spec, dtype=dtype, shape=(3, 4, 16), lowering=lowering)
        except LoweringError:
            continue
        found = audit_model(model)
        assert len(found) == 1, (name, found)
        (red,) = found
        assert red.kind == "RMSNorm" and red.input_dtype == dtype
        assert red.accumulation == spec.accumulation, (name, red)
        assert abs(red.epsilon - spec.epsilon) < 1e-9 * max(1.0, spec.epsilon)
        assert red.axes == [-1] if spec.normalized_dims == 1 else red.axes in ([-2, -1], [-2])
        assert not low_precision_reductions(found)
        checked += 1
    assert checked >= 2  # native represents only cast_then_scale and gain-free specs on half inputs


def test_function_reductions_are_tied_to_their_spec():
    model = rmsnorm_model(SPECS["gemma"], dtype="float16", shape=(2, 8))
    (red,) = audit_model(model)
    assert RMSNormSpec.from_dict(red.spec).epsilon_float32 == SPECS["gemma"].epsilon_float32
    assert red.spec["gain"] == "offset" and red.op == "rmsnorm_deploy::RMSNorm[Pow>ReduceMean>Add>Sqrt]"


def _half_chain(square: str) -> onnx.ModelProto:
    """The float16 norm a naive exporter writes: the reduction in float16."""
    nodes = []
    if square == "pow":
        nodes.append(helper.make_node("Pow", ["x", "two"], ["sq"]))
    else:
        nodes.append(helper.make_node("Mul", ["x", "x"], ["sq"]))
    nodes += [
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Div", ["x", "rms"], ["y"]),
    ]
    inits = [
        helper.make_tensor("two", TensorProto.FLOAT16, [], [2.0]),
        helper.make_tensor("eps", TensorProto.FLOAT16, [], [1e-5]),
        helper.make_tensor("axes", TensorProto.INT64, [1], [-1]),
    ]
    graph = helper.make_graph(nodes, "naive", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["n", 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("square", ["pow", "mul"])
def test_a_half_precision_reduction_is_found(square):
    found = audit_model(_half_chain(square))
    assert [(r.kind, r.accumulation, r.input_dtype) for r in found] == [("RMSNorm", "float16", "float16")]
    assert low_precision_reductions(found) == found
    assert found[0].epsilon == pytest.approx(1e-5, rel=1e-2)  # 1e-5 rounded to float16


def test_a_mean_of_squares_without_epsilon_is_not_a_norm():
    model = _half_chain("pow")
    del model.graph.node[2:]
    model.graph.output[0].name = "ms"
    assert audit_model(model) == []
