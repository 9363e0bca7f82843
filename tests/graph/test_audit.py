"""The audit on graphs written op by op: every form of norm reduction, its dtype, epsilon and tensors."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.errors import LoweringError
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.reductions import low_precision_reductions
from rmsnorm_deploy.validate.audit import audit_after_onnxruntime
from rmsnorm_deploy.graph.lowerings import LOWERINGS
from rmsnorm_deploy.graph.standalone import rmsnorm_model

H = 64
F16, F32, BF16 = TP.FLOAT16, TP.FLOAT, TP.BFLOAT16
_NP = {F16: np.float16, F32: np.float32}


def graph(nodes, *, x_type=F16, opset=18, inits=(), domains=(), rank=3, outputs=("y",), y_type=None):
    """A model with input ``x`` [batch, seq, H] (rank 3) and outputs ``outputs`` of ``x``'s type."""
    dims = ["batch", "seq", H][-rank:]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", x_type, dims)],
        [helper.make_tensor_value_info(o, y_type or x_type, None) for o in outputs], initializer=list(inits))
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains])
    model.ir_version = 10
    return model


def const(name, value, elem=F16):
    return numpy_helper.from_array(np.array(value, dtype=_NP.get(elem, np.float32)), name)


def axes(name="axes", values=(-1,)):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def rms_chain(dtype=F16, *, square="Pow", eps_inside=True, cast_to=None, divide=True):
    """x [-> Cast] -> square -> ReduceMean -> Add(eps)/Sqrt -> Div or Reciprocal+Mul -> Mul(w) [-> Cast]."""
    nodes, xs = [], "x"
    work = dtype
    if cast_to is not None:
        nodes.append(helper.make_node("Cast", ["x"], ["xc"], to=cast_to))
        xs, work = "xc", cast_to
    nodes.append(helper.make_node("Pow", [xs, "two"], ["sq"]) if square == "Pow" else helper.make_node("Mul", [xs, xs], ["sq"]))
    nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1))
    if eps_inside:
        nodes += [helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["den"])]
    else:
        nodes += [helper.make_node("Sqrt", ["ms"], ["rms"]), helper.make_node("Add", ["rms", "eps"], ["den"])]
    if divide:
        nodes.append(helper.make_node("Div", [xs, "den"], ["n"]))
    else:
        nodes += [helper.make_node("Reciprocal", ["den"], ["inv"]), helper.make_node("Mul", [xs, "inv"], ["n"])]
    nodes.append(helper.make_node("Mul", ["n", "w"], ["yw"]))
    nodes.append(helper.make_node("Cast", ["yw"], ["y"], to=dtype) if cast_to is not None else helper.make_node("Identity", ["yw"], ["y"]))
    inits = [const("two", 2.0, work), const("eps", 1e-5, work), axes(), const("w", np.ones(H), work)]
    return graph(nodes, x_type=dtype, inits=inits)


@pytest.mark.parametrize("square", ["Pow", "Mul"])
@pytest.mark.parametrize("divide", [True, False], ids=["div", "reciprocal"])
def test_float16_chain_is_a_low_precision_finding(square, divide):
    (red,) = audit_model(rms_chain(F16, square=square, divide=divide))
    assert (red.kind, red.input_dtype, red.accumulation, red.squares) == ("RMSNorm", "float16", "float16", "float16")
    assert red.low_precision and red.op.startswith(f"{square}>ReduceMean>Add>Sqrt")
    assert red.epsilon == pytest.approx(float(np.float16(1e-5))) and red.axes == [-1] and red.normalized_dims == 1
    assert (red.tensors.inputs, red.tensors.gain, red.tensors.output) == (["x"], "w", "yw")


def test_upcast_chain_accumulates_in_float32_and_traces_its_boundary():
    (red,) = audit_model(rms_chain(F16, cast_to=F32))
    assert (red.input_dtype, red.accumulation, red.squares, red.low_precision) == ("float16", "float32", "float32", False)
    assert (red.tensors.inputs, red.tensors.gain, red.tensors.output) == (["x"], "w", "y")
    spec = red.implied_spec()
    assert (spec.epsilon, spec.normalized_dims, spec.gain, spec.epsilon_placement) == (
        pytest.approx(1e-5), 1, "weight", "inside_sqrt")


def test_epsilon_outside_the_square_root_is_recognized():
    (red,) = audit_model(rms_chain(F32, eps_inside=False))
    assert red.epsilon_placement == "outside_sqrt" and red.implied_spec().epsilon_placement == "outside_sqrt"


def test_squares_in_float16_summed_in_float32_are_still_low_precision():
    """Pow in float16, then Cast to float32 before ReduceMean: the squares overflow before the sum widens."""
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("Cast", ["sq"], ["sq32"], to=F32),
             helper.make_node("ReduceMean", ["sq32", "axes"], ["ms"]), helper.make_node("Add", ["ms", "eps"], ["mse"]),
             helper.make_node("Sqrt", ["mse"], ["den"]), helper.make_node("Cast", ["den"], ["den16"], to=F16),
             helper.make_node("Div", ["x", "den16"], ["y"])]
    (red,) = audit_model(graph(nodes, inits=[const("two", 2.0), const("eps", 1e-5, F32), axes()]))
    assert (red.squares, red.accumulation, red.precision) == ("float16", "float32", "float16 squares, float32 sum")
    assert red.low_precision


def test_narrowing_cast_marks_where_the_low_precision_value_starts():
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=F16), helper.make_node("Mul", ["x16", "x16"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]), helper.make_node("Add", ["ms", "eps"], ["mse"]),
             helper.make_node("Sqrt", ["mse"], ["den"]), helper.make_node("Div", ["x16", "den"], ["y"])]
    (red,) = audit_model(graph(nodes, x_type=F32, inits=[const("eps", 1e-5), axes()], y_type=F16))
    assert (red.input_dtype, red.accumulation, red.tensors.inputs) == ("float16", "float16", ["x16"])


@pytest.mark.parametrize("op", ["ReduceSumSquare", "ReduceSum"])
def test_sum_of_squares_divided_by_the_count(op):
    nodes = [helper.make_node("ReduceSumSquare", ["x", "axes"], ["ss"])] if op == "ReduceSumSquare" else [
        helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("ReduceSum", ["sq", "axes"], ["ss"])]
    nodes += [helper.make_node("Div", ["ss", "n"], ["ms"]), helper.make_node("Add", ["ms", "eps"], ["mse"]),
              helper.make_node("Sqrt", ["mse"], ["den"]), helper.make_node("Div", ["x", "den"], ["y"])]
    (red,) = audit_model(graph(nodes, x_type=F32, inits=[const("n", float(H), F32), const("eps", 1e-6, F32), axes()]))
    assert red.kind == "RMSNorm" and red.accumulation == "float32" and red.epsilon == pytest.approx(1e-6)
    assert red.tensors.output == "y" and red.tensors.gain is None and red.implied_spec().gain == "none"


def test_a_mean_of_squares_that_is_not_a_norm_is_ignored():
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["y"])]
    assert audit_model(graph(nodes, inits=[axes()])) == []


def test_decomposed_layer_norm_is_found_and_not_mistaken_for_rms():
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["mu"]), helper.make_node("Sub", ["x", "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["var"]),
             helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["y"])]
    (red,) = audit_model(graph(nodes, inits=[const("two", 2.0), const("eps", 1e-5), axes()]))
    assert red.kind == "LayerNorm" and red.low_precision and red.implied_spec() is None


@pytest.mark.parametrize(
    "op, attrs, domain, accumulation",
    [
        ("RMSNormalization", {"stash_type": F32}, "", "float32"),
        ("RMSNormalization", {"stash_type": F16}, "", "float16"),
        ("SimplifiedLayerNormalization", {}, "", "float32"),
        ("SimplifiedLayerNormalization", {"stash_type": F16}, "com.microsoft", "float16"),
        ("LayerNormalization", {}, "", "float32"),
    ],
)
def test_fused_ops_report_their_stash_type(op, attrs, domain, accumulation):
    inputs = ["x", "w", "b"] if op == "LayerNormalization" else ["x", "w"]
    node = helper.make_node(op, inputs, ["y"], axis=-1, epsilon=1e-6, domain=domain or None, **attrs)
    model = graph([node], opset=23, inits=[const("w", np.ones(H)), const("b", np.zeros(H))],
                  domains=[domain] if domain else ())
    (red,) = audit_model(model)
    assert red.op == op and red.accumulation == accumulation and red.low_precision == (accumulation == "float16")
    assert red.axes == [-1] and red.normalized_dims == 1 and red.epsilon == pytest.approx(1e-6)
    assert red.tensors.gain == "w" and red.tensors.output == "y"
    assert red.tensors.bias == ("b" if op == "LayerNormalization" else None)


def test_fused_op_with_a_positive_axis_covers_the_trailing_dims():
    node = helper.make_node("LayerNormalization", ["x", "w"], ["y"], axis=1, epsilon=1e-6)
    (red,) = audit_model(graph([node], inits=[const("w", np.ones((3, H)))], x_type=F16, rank=3))
    assert red.axes == [1, 2] and red.normalized_dims == 2


@pytest.mark.parametrize("version, accumulation", [("1.26.0", "float16"), ("1.27.0", "float32"), ("1.32.0", "float32")])
def test_skip_simplified_layer_norm_depends_on_the_onnx_runtime_version(version, accumulation):
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "w"], ["y", "", "", "sum"],
                            domain="com.microsoft")
    model = graph([node], inits=[const("skip", np.zeros((1, 1, H))), const("w", np.ones(H))],
                  domains=["com.microsoft"], outputs=("y", "sum"))
    (red,) = audit_model(model, onnxruntime_version=version)
    assert red.kind == "RMSNorm (skip)" and red.accumulation == accumulation
    assert red.epsilon == pytest.approx(1e-12) and "epsilon unset, ONNX Runtime's default is 1e-12" in red.note
    assert "onnxruntime#29034" in red.note
    assert red.tensors.inputs == ["x", "skip"] and red.tensors.sum_output == "sum"
    assert len(low_precision_reductions([red])) == (accumulation == "float16")


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec_name", ["llama", "gemma", "nogain"])
def test_every_lowering_of_ours_accumulates_in_float32(spec_name, dtype, lowering):
    spec = named_specs()[spec_name]
    try:
        model = rmsnorm_model(spec, dtype=dtype, shape=(3, 760), lowering=lowering)
    except LoweringError as exc:
        pytest.skip(f"the lowering refuses this spec: {exc}")
    (red,) = audit_model(model)
    assert not red.low_precision, red
    assert red.input_dtype == dtype and red.epsilon == pytest.approx(spec.epsilon_float32)
    assert red.tensors.inputs == ["x"] and red.tensors.output == "y"
    if spec.gain != "none":
        # the weight itself, or what the graph multiplies by: 1 + w, or w rounded to the input dtype
        assert red.tensors.gain is not None
        if lowering in ("function", "plugin"):
            assert red.tensors.gain == "weight"
    implied = red.implied_spec()
    assert (implied.epsilon, implied.normalized_dims) == (pytest.approx(spec.epsilon), 1)
    if lowering in ("function", "plugin"):
        assert red.spec == dataclasses.replace(spec, epsilon=spec.epsilon_float32).to_dict()
        assert red.op.startswith("rmsnorm_deploy::RMSNorm[")


def test_onnx_runtime_cpu_widens_a_float16_chain():
    """ONNX Runtime's CPU provider inserts float32 Casts around float16 ops: the chain it runs is float32."""
    model = rms_chain(F16)
    (written,) = audit_model(model)
    assert written.low_precision
    for level in ("disable", "all"):
        (ran,) = audit_after_onnxruntime(model, optimization=level)
        assert ran.stage == f"after onnxruntime ({level})"
        assert ran.accumulation == "float32" and not ran.low_precision, ran


def test_audit_leaves_the_model_untouched():
    model = rmsnorm_model(named_specs()["llama"], dtype="float16", shape=(3, 760))
    before = model.SerializeToString()
    audit_model(model)
    assert model.SerializeToString() == before
    assert onnx.checker.check_model(model, full_check=True) is None
