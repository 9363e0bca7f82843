"""The graph given to TensorRT's parser: our functions inlined per overload, or mapped to the
plugin, and every norm located (no TensorRT needed; ONNX Runtime proves the numbers unchanged)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from tests.tensorrt._models import two_norm_model

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.contract.inputs import activations, gain_weights
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.function import DOMAIN, is_rmsnorm_node
from rmsnorm_deploy.graph.lowerings import LOWERINGS
from rmsnorm_deploy.tensorrt.prepare import parser_node_name, prepare_for_tensorrt


def spec_for(lowering: str) -> RMSNormSpec:
    return RMSNormSpec.torch_rmsnorm() if lowering == "ort" else RMSNormSpec.llama()


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_without_the_plugin_no_function_node_reaches_the_parser(lowering):
    model = rmsnorm_model(spec_for(lowering), dtype="float16", shape=(4, 8), lowering=lowering)
    before = model.SerializeToString()
    prepared = prepare_for_tensorrt(model, plugin=False)
    assert model.SerializeToString() == before  # the caller's model is untouched
    assert not any(is_rmsnorm_node(n) for n in prepared.model.graph.node)
    assert not any(f.domain == DOMAIN for f in prepared.model.functions)
    assert all(n.name for n in prepared.model.graph.node)
    (site,) = prepared.sites
    if lowering in ("function", "plugin"):
        assert site.label == "rmsnorm" and site.kind == "function"
        assert all(name.startswith("rmsnorm/") for name in site.nodes)
        (reduction,) = site.reduction_nodes
        assert "ReduceMean" in reduction
        assert prepared.notes and "inlined before parsing (1 overload(s))" in prepared.notes[0]
        # The plugin fields must not survive: a registered plugin would otherwise capture the node.
        assert not any(a.name == "plugin_namespace" for n in prepared.model.graph.node for a in n.attribute)
    elif lowering == "inline":
        assert site.label == "y" and site.kind == "Pow>ReduceMean>Add>Sqrt"
    else:
        assert site.label == "rmsnorm" and site.nodes == site.reduction_nodes == frozenset({"rmsnorm"})
        assert site.kind == {"native": "RMSNormalization", "ort": "SimplifiedLayerNormalization"}[lowering]
    assert site.accumulation == "float32"


def test_two_overloads_are_inlined_each_with_its_own_body_and_location():
    model = two_norm_model(RMSNormSpec.llama(), RMSNormSpec.gemma(), dtype="float16", hidden=8)
    prepared = prepare_for_tensorrt(model, plugin=False)
    onnx.checker.check_model(prepared.model, full_check=True)
    a, b = prepared.sites
    assert (a.label, b.label) == ("norm_a", "norm_b")
    assert (a.spec["gain"], a.spec["order"]) == ("weight", "cast_then_scale")
    assert (b.spec["gain"], b.spec["order"]) == ("offset", "scale_then_cast")
    assert a.nodes.isdisjoint(b.nodes)
    assert all(n.startswith("norm_a/") for n in a.nodes) and all(n.startswith("norm_b/") for n in b.nodes)
    # Gemma's body adds 1 to the weight; Llama's does not: each site holds its own overload's nodes.
    ops = {n.name: n.op_type for n in prepared.model.graph.node}
    assert sum(ops[n] == "Add" for n in a.nodes) == 1 and sum(ops[n] == "Add" for n in b.nodes) == 2
    assert "2 overload(s)" in prepared.notes[0]


@pytest.mark.parametrize("rows, hidden", [(1, 7), (199, 760)])
def test_inlining_leaves_every_output_bit_identical_in_onnxruntime(rows, hidden):
    from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner

    specs = (RMSNormSpec.llama(), RMSNormSpec.torch_rmsnorm())  # differ in rounding order: overloads matter
    model = two_norm_model(*specs, dtype="float16", hidden=hidden)
    prepared = prepare_for_tensorrt(model, plugin=False).model
    feed = {"x": activations((rows, hidden), "float16", seed=3, kind="stress"),
            "w1": gain_weights((hidden,), "float16", "weight", seed=4),
            "w2": gain_weights((hidden,), "float16", "weight", seed=5)}
    with OnnxRuntimeRunner(model, ["cpu"], optimization="disable") as runner:
        want = runner.infer(feed)
    with OnnxRuntimeRunner(prepared, ["cpu"], optimization="disable") as runner:
        got = runner.infer(feed)
    for name in ("y1", "y2"):
        np.testing.assert_array_equal(got[name].view(np.uint16), want[name].view(np.uint16))


@pytest.mark.parametrize("lowering", ["function", "plugin"])
def test_with_the_plugin_every_node_carries_the_plugin_fields(lowering):
    model = two_norm_model(RMSNormSpec.llama(), RMSNormSpec.gemma(), dtype="bfloat16", hidden=8, lowering=lowering)
    prepared = prepare_for_tensorrt(model, plugin=True)
    ours = [n for n in prepared.model.graph.node if is_rmsnorm_node(n)]
    assert len(ours) == 2
    for node in ours:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == b"rmsnorm_deploy" and attrs["plugin_version"] == b"1"
        assert sum(a.name == "plugin_namespace" for a in node.attribute) == 1
    assert [(s.label, s.kind, s.nodes) for s in prepared.sites] == [
        ("norm_a", "plugin", frozenset({"norm_a"})), ("norm_b", "plugin", frozenset({"norm_b"}))]
    assert "mapped to the plugin RMSNorm v1 in namespace(s) rmsnorm_deploy" in prepared.notes[0]


@pytest.mark.parametrize("lowering", ["inline", "native", "ort"])
def test_the_plugin_needs_our_nodes(lowering):
    model = rmsnorm_model(spec_for(lowering), dtype="float16", shape=(4, 8), lowering=lowering)
    with pytest.raises(UserError, match=rf"the plugin replaces rmsnorm_deploy::RMSNorm nodes and this model has none "
                                        rf"\(its norms are lowered to '{lowering}'\); export it with --lowering plugin"):
        prepare_for_tensorrt(model, plugin=True)


@pytest.mark.parametrize("plugin", [False, True])
def test_float64_accumulation_is_refused_for_tensorrt(plugin):
    model = rmsnorm_model(RMSNormSpec(accumulation="float64"), dtype="float16", shape=(4, 8))
    with pytest.raises(UserError, match=r"norm\(s\) rmsnorm accumulate in float64, which TensorRT does not compute"):
        prepare_for_tensorrt(model, plugin=plugin)


def test_unnamed_nodes_get_the_parser_s_name():
    node = onnx.helper.make_node("Relu", ["x"], ["y"])
    assert parser_node_name(node) == "node_of_y"
    node.name = "relu"
    assert parser_node_name(node) == "relu"
