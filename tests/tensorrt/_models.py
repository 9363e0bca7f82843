"""Models for the TensorRT tests: a graph with two norms of different specs (two overloads
of ``rmsnorm_deploy::RMSNorm``), built with the same public pieces as ``rmsnorm_model``."""

from __future__ import annotations

import onnx
from onnx import helper

from rmsnorm_deploy.contract.dtypes import onnx_type
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.graph.function import DOMAIN, DOMAIN_VERSION, rmsnorm_node
from rmsnorm_deploy.graph.lowerings import lower_model
from rmsnorm_deploy.graph.metadata import ModelMetadata, tool_versions
from rmsnorm_deploy.graph.standalone import ir_version_for


def two_norm_model(spec_a: RMSNormSpec, spec_b: RMSNormSpec, *, dtype: str, hidden: int, lowering: str = "function",
                   opset: int = 18, rows: int = 8) -> onnx.ModelProto:
    """``y1 = norm_a(x, w1)``, ``y2 = norm_b(y1, w2)``: inputs ``x [d0, hidden]``, ``w1``, ``w2``."""
    elem = onnx_type(dtype)
    nodes = [
        rmsnorm_node(spec_a, dtype, ["x", "w1"], ["y1"], name="norm_a"),
        rmsnorm_node(spec_b, dtype, ["y1", "w2"], ["y2"], name="norm_b"),
    ]
    graph = helper.make_graph(
        nodes, "two_norms",
        [helper.make_tensor_value_info("x", elem, ["d0", hidden]),
         helper.make_tensor_value_info("w1", elem, [hidden]),
         helper.make_tensor_value_info("w2", elem, [hidden])],
        [helper.make_tensor_value_info("y1", elem, ["d0", hidden]),
         helper.make_tensor_value_info("y2", elem, ["d0", hidden])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])
    model.ir_version = ir_version_for(model.opset_import)
    model = lower_model(model, lowering)
    ModelMetadata(
        specs={"norm_a": spec_a, "norm_b": spec_b}, lowering=lowering, dtype=dtype, source={"kind": "test"},
        inputs={"x": {"dtype": dtype, "shape": ["d0", hidden], "kind": "activations"},
                "w1": {"dtype": dtype, "shape": [hidden], "kind": "weight", "gain": spec_a.gain},
                "w2": {"dtype": dtype, "shape": [hidden], "kind": "weight", "gain": spec_b.gain}},
        dims={"d0": [1, rows, rows * 4]}, versions=tool_versions(),
    ).write(model)
    return model
