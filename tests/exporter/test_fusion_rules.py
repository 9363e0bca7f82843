"""The attention fusion rules one by one, on small hand-written graphs: each rewrites what it can
prove, and its rejection carries the reason (as onnxscript's rules do)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxscript.rewriter import pattern

from rmsnorm_deploy.exporter.fusions import RULES, RotaryFusion, SharedKVAttention

B, H, S, D = 1, 2, 5, 8


def _rotary_graph(*, tables_from_angles: bool) -> ir.Model:
    """``x * cos + rotate_half(x) * sin`` with rotate_half by Split; cos/sin computed from angles
    (``Cos``/``Sin`` of ``Concat(f, f)``), or given as graph inputs (nothing proves them rotary)."""
    nodes = [
        helper.make_node("Split", ["x", "halves"], ["first", "second"], axis=-1),
        helper.make_node("Neg", ["second"], ["neg"]),
        helper.make_node("Concat", ["neg", "first"], ["rotated"], axis=-1),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Mul", ["rotated", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, H, S, D])]
    inits = [numpy_helper.from_array(np.array([D // 2, D // 2], dtype=np.int64), "halves")]
    if tables_from_angles:
        inputs.append(helper.make_tensor_value_info("freqs", TensorProto.FLOAT, [S, D // 2]))
        nodes = [helper.make_node("Concat", ["freqs", "freqs"], ["angles"], axis=-1),
                 helper.make_node("Cos", ["angles"], ["cos"]), helper.make_node("Sin", ["angles"], ["sin"])] + nodes
    else:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [S, D]) for n in ("cos", "sin")]
    graph = helper.make_graph(nodes, "rotary", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    return ir.serde.deserialize_model(model)


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def test_rotary_rule_rewrites_a_provable_rotary_embedding():
    model = _rotary_graph(tables_from_angles=True)
    count = pattern.RewriteRuleSet([RotaryFusion.rule(split=True)], commute=True).apply_to_model(model)
    assert count == 1
    assert "RotaryEmbedding" in _ops(model) and "Neg" not in _ops(model)


def test_rotary_rule_rejects_tables_it_cannot_prove_and_says_why():
    model = _rotary_graph(tables_from_angles=False)
    rule = RotaryFusion(split=True)
    x = next(v for v in model.graph.inputs if v.name == "x")
    cos, sin = (next(v for v in model.graph.inputs if v.name == n) for n in ("cos", "sin"))
    split = next(n for n in model.graph if n.op_type == "Split")
    result = rule.check(None, x, cos, sin, split.outputs[0], split.outputs[1])
    assert not result
    assert result.reason == "cos: the table is not computed in the graph"
    assert pattern.RewriteRuleSet([RotaryFusion.rule(split=True)]).apply_to_model(model) == 0


def test_shared_kv_rule_leaves_attention_without_repeated_heads_and_says_why():
    graph = helper.make_graph(
        [helper.make_node("Attention", ["q", "k", "v"], ["y"])], "attention",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H, S, D]) for n in ("q", "k", "v")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    q, k, v = model.graph.inputs
    node = next(iter(model.graph))
    result = SharedKVAttention().check(None, q, k, v, node.outputs[0])
    assert not result and result.reason == "key: not a reshape; value: not a reshape"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_the_rules_are_made_once_at_module_level_with_their_names(rule):
    assert rule.name in ("RotaryFusionSlice", "RotaryFusionSplit", "SharedKVAttention")
