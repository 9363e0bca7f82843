"""The rmsnorm_deploy::RMSNorm function: one overload per variant, valid at opsets 18-23."""

from __future__ import annotations

import itertools

import onnx
import pytest

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.spec import (
    ACCUMULATIONS,
    EPSILON_PLACEMENTS,
    GAINS,
    ORDERS,
)
from rmsnorm_deploy.errors import LoweringError
from rmsnorm_deploy.graph.function import (
    DOMAIN,
    OP_TYPE,
    function_proto,
    node_upcasts,
    plugin_namespace,
    rmsnorm_node,
    spec_from_node,
)
from rmsnorm_deploy.graph.standalone import rmsnorm_model

ALL_SPECS = [
    RMSNormSpec(1e-5, dims, gain, order, acc, eps)
    for dims, gain, order, acc, eps in itertools.product((1, 2), GAINS, ORDERS, ACCUMULATIONS, EPSILON_PLACEMENTS)
]


@pytest.mark.parametrize("opset", range(18, 24))
@pytest.mark.parametrize("upcast", [False, True])
def test_every_variant_passes_the_full_checker(opset, upcast):
    for spec in ALL_SPECS:
        fn = function_proto(spec, upcast, opset)
        assert (fn.domain, fn.name, fn.overload) == (DOMAIN, OP_TYPE, spec.variant(upcast))
        assert [(i.domain, i.version) for i in fn.opset_import] == [("", opset)]
        # A model using it must pass the full check (types and shapes through the body).
        dtype = "float16" if upcast and spec.accumulation == "float32" else ("float32")
        if spec.accumulation == "float64" and not upcast:
            continue  # float64 activations are not a model dtype
        model = rmsnorm_model(spec, dtype=dtype, shape=(3, 4, 8), opset=opset)
        onnx.checker.check_model(model, full_check=True)


def _body_ops(spec: RMSNormSpec, upcast: bool) -> list[str]:
    return [n.op_type for n in function_proto(spec, upcast, 18).node if n.op_type != "Constant"]


def test_same_dtype_body_is_the_chain_onnxruntime_fuses():
    # DESIGN: Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul, no Casts when nothing converts.
    assert _body_ops(RMSNormSpec.llama(), upcast=False) == ["Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"]


def test_upcast_body_converts_before_the_reduction_and_after():
    ops = _body_ops(RMSNormSpec.torch_rmsnorm(), upcast=True)
    assert ops[0] == "Cast" and ops[-1] == "CastLike"
    assert ops.index("ReduceMean") > ops.index("Cast")


def test_cast_then_scale_rounds_both_factors_before_the_product():
    ops = _body_ops(RMSNormSpec.llama(), upcast=True)
    mul = ops.index("Mul")
    # the normalized value and the gain are each rounded to the input dtype (CastLike) and widened (Cast)
    assert ops[:mul].count("CastLike") == 2
    assert ops[mul + 1:] == ["CastLike"]


def test_epsilon_and_axes_are_attribute_references():
    fn = function_proto(RMSNormSpec.llama(), True, 18)
    refs = {a.ref_attr_name for n in fn.node for a in n.attribute if a.ref_attr_name}
    assert refs == {"epsilon", "axes"}
    assert set(fn.attribute) == {"epsilon", "axes"}
    described = {a.name: a.s.decode() for a in fn.attribute_proto}
    assert described["gain"] == "weight" and described["order"] == "cast_then_scale"


def test_float64_accumulation_widens_epsilon_too():
    fn = function_proto(RMSNormSpec(accumulation="float64"), True, 18)
    casts = [a.i for n in fn.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"]
    assert set(casts) == {onnx.TensorProto.DOUBLE}


@pytest.mark.parametrize("spec", [RMSNormSpec.gemma(3e-6), RMSNormSpec(1e-5, 3, "none", "cast_then_scale", "float64", "outside_sqrt")])
def test_spec_round_trips_through_node_attributes(spec):
    node = rmsnorm_node(spec, "float16", ["x", "w"], ["y"], plugin=True)
    back = spec_from_node(node)
    # ONNX float attributes are float32: the epsilon comes back as the float32 every graph adds.
    assert back.epsilon_float32 == spec.epsilon_float32
    assert {k: v for k, v in back.to_dict().items() if k != "epsilon"} == {
        k: v for k, v in spec.to_dict().items() if k != "epsilon"
    }
    assert node_upcasts(node) is True
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["plugin_namespace"] == plugin_namespace(spec).encode() and attrs["plugin_version"] == b"1"


def test_node_with_non_trailing_axes_is_refused():
    node = rmsnorm_node(RMSNormSpec(), "float32", ["x", "w"], ["y"], name="n1")
    for a in node.attribute:
        if a.name == "axes":
            del a.ints[:]
            a.ints.extend([0])
    with pytest.raises(LoweringError, match=r"node 'n1': axes \[0\] are not the trailing dims"):
        spec_from_node(node)


@pytest.mark.parametrize("opset", [17, 24, "18"])
def test_unsupported_opset_is_refused(opset):
    with pytest.raises(LoweringError, match=f"opset {opset!r} is not supported; choose an ONNX opset from 18 to 23"):
        function_proto(RMSNormSpec(), True, opset)
