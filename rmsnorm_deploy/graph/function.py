"""The ``rmsnorm_deploy::RMSNorm`` ONNX function, traced from the formula with onnxscript.

One graph runs everywhere: ONNX Runtime inlines the local function and fuses its body,
TensorRT inlines it (or, with our plugin loaded, runs the plugin), and every reader can
see that the reduction runs in float32.

The node carries the whole spec as attributes (``epsilon``, ``axes``, ``gain``,
``order``, ``accumulation``, ``epsilon_placement``; a gated spec adds ``gate`` and
``gate_placement``, a grouped one ``group_size``) so the spec can be read back from
any graph; the body of each spec *variant* (see :meth:`RMSNormSpec.variant`) is one
overload of the function, with ``epsilon`` and ``axes`` as attribute references. The
body is written in the op chain that ONNX Runtime's ``SimplifiedLayerNormFusion``
recognizes: ``Pow(x, 2) -> ReduceMean -> Add(eps) -> Sqrt -> Div(x, .) -> Mul(w)``
inside the casts to and from the accumulation dtype; no-op casts are left out.

Inputs are ``(x[, weight][, z])``: the weight when the spec has a gain, the gate input ``z``
when it is gated (:func:`input_names`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import onnx
import onnxscript
from onnxscript import ir

from rmsnorm_deploy.contract import formula
from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import LoweringError, SpecError

DOMAIN = "rmsnorm_deploy"
DOMAIN_VERSION = 1
OP_TYPE = "RMSNorm"
#: What TensorRT's ONNX parser reads to map a node to a registered plugin: the op type
#: (``RMSNorm``), ``plugin_namespace`` and ``plugin_version``. A TensorRT plugin has a fixed
#: number of inputs, so nodes without a weight (gain "none") map to a second plugin of the
#: same name in its own namespace (see :func:`plugin_namespace`).
PLUGIN_NAMESPACE = DOMAIN
PLUGIN_NAMESPACE_NO_WEIGHT = f"{DOMAIN}_noweight"
PLUGIN_VERSION = "1"
MIN_OPSET, MAX_OPSET = 18, 23
#: ONNX IR version 10 introduced function overloads.
MIN_IR_VERSION = 10

_SPEC_STRING_ATTRIBUTES = ("gain", "order", "accumulation", "epsilon_placement")
#: Written only on gated nodes, so that ungated nodes stay as they were before gates existed.
_GATE_STRING_ATTRIBUTES = ("gate", "gate_placement")
_ACC_IR = {"float32": ir.DataType.FLOAT, "float64": ir.DataType.DOUBLE}


class OnnxOps:
    """Formula primitives as ONNX nodes, emitted through an onnxscript op builder.

    ``attribute_refs=True`` writes ``epsilon`` and ``axes`` as references to the
    enclosing function's attributes; otherwise as the spec's constants (inline nodes).
    """

    def __init__(self, op: Any, spec: RMSNormSpec, *, upcast: bool, attribute_refs: bool):
        self.op = op
        self.spec = spec
        self.upcast = upcast
        self.attribute_refs = attribute_refs
        self.acc = _ACC_IR[spec.accumulation]

    def _constant(self, value: float) -> Any:
        return self.op.Constant(value=ir.tensor(value, dtype=self.acc))

    def to_accumulation(self, t: Any) -> Any:
        return self.op.Cast(t, to=self.acc) if self.upcast else t

    def to_input_dtype(self, t: Any, like: Any) -> Any:
        return self.op.CastLike(t, like) if self.upcast else t

    def round_to_input_dtype(self, t: Any, like: Any) -> Any:
        return self.op.Cast(self.op.CastLike(t, like), to=self.acc) if self.upcast else t

    def mean_square(self, t: Any, axes: tuple[int, ...]) -> Any:
        if self.attribute_refs:
            axes_value = self.op.Constant(value_ints=ir.RefAttr("value_ints", "axes", ir.AttributeType.INTS))
        else:
            axes_value = self.op.Constant(value_ints=list(axes))
        return self.op.ReduceMean(self.op.Pow(t, self._constant(2.0)), axes_value, keepdims=1)

    def add_epsilon(self, t: Any) -> Any:
        if self.attribute_refs:
            eps = self.op.Constant(value_float=ir.RefAttr("value_float", "epsilon", ir.AttributeType.FLOAT))
            if self.acc != ir.DataType.FLOAT:
                eps = self.op.Cast(eps, to=self.acc)
        else:
            eps = self._constant(self.spec.epsilon_float32)
        return self.op.Add(t, eps)

    def add_one(self, t: Any) -> Any:
        return self.op.Add(t, self._constant(1.0))

    def sqrt(self, t: Any) -> Any:
        return self.op.Sqrt(t)

    def normalize(self, t: Any, mean_square_plus_eps: Any) -> Any:
        # Div(x, Sqrt(.)) rather than Mul(x, Reciprocal(Sqrt(.))): the form ORT fuses.
        return self.op.Div(t, self.op.Sqrt(mean_square_plus_eps))

    def divide(self, a: Any, b: Any) -> Any:
        return self.op.Div(a, b)

    def multiply(self, a: Any, b: Any) -> Any:
        return self.op.Mul(a, b)

    def activation(self, t: Any, name: str) -> Any:
        # 1 + exp(-t) and a divide, not Sigmoid: ONNX Runtime's CPU Sigmoid is an approximation with
        # an absolute error of ~1.5e-7, millions of ulps where sigmoid(t) is small (t < -15);
        # its Exp is within ~2 ulp, as torch's sigmoid and silu are. (opset 18 has no Silu op.)
        denominator = self.op.Add(self._constant(1.0), self.op.Exp(self.op.Neg(t)))
        return self.op.Div(t if name == "silu" else self._constant(1.0), denominator)

    def group(self, t: Any, group_size: int) -> Any:
        if self.attribute_refs:
            size = self.op.Constant(value_int=ir.RefAttr("value_int", "group_size", ir.AttributeType.INT))
            tail = self.op.Concat(self.op.Constant(value_ints=[-1]),
                                  self.op.Reshape(size, self.op.Constant(value_ints=[1])), axis=0)
        else:
            tail = self.op.Constant(value_ints=[-1, int(group_size)])
        return self.op.Reshape(t, self.op.Concat(self.op.Shape(t, end=-1), tail, axis=0))

    def ungroup(self, t: Any, like: Any) -> Any:
        return self.op.Reshape(t, self.op.Shape(like))


def input_names(spec: RMSNormSpec) -> list[str]:
    """The node's (and function's) inputs: ``x``, ``weight`` with a gain, ``z`` (the gate input) when gated."""
    return ["x"] + (["weight"] if spec.has_gain else []) + (["z"] if spec.has_gate else [])


def plugin_namespace(spec: RMSNormSpec) -> str:
    """The TensorRT plugin namespace of ``spec``'s nodes: inputs ``(x, weight)`` or ``(x)``."""
    return PLUGIN_NAMESPACE if spec.has_gain else PLUGIN_NAMESPACE_NO_WEIGHT


def check_opset(opset: int) -> None:
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise LoweringError(f"opset {opset!r} is not supported; choose an ONNX opset from {MIN_OPSET} to {MAX_OPSET}")


def _variant_spec(spec: RMSNormSpec) -> RMSNormSpec:
    """The spec with epsilon, axes and group size reset: they are attributes, not part of the body."""
    return dataclasses.replace(spec, epsilon=1e-6, normalized_dims=1,
                               group_size=None if spec.group_size is None else 1)


@functools.lru_cache(maxsize=256)
def _function_proto_cached(spec: RMSNormSpec, upcast: bool, opset: int) -> bytes:

    names = input_names(spec)

    def body(op: Any, *values: Any) -> Any:
        given = dict(zip(names, values))
        return formula.rms_norm(OnnxOps(op, spec, upcast=upcast, attribute_refs=True), spec, given["x"],
                                given.get("weight"), given.get("z"))

    inputs = [ir.Value(name=n) for n in names]
    # String attributes describe the variant (their defaults are its values); epsilon and
    # axes are required on every node (and group_size on grouped ones).
    described = [ir.Attr(key, ir.AttributeType.STRING, getattr(spec, key)) for key in _string_attributes(spec)]
    described += [
        ir.Attr("plugin_namespace", ir.AttributeType.STRING, ""),
        ir.Attr("plugin_version", ir.AttributeType.STRING, PLUGIN_VERSION),
    ]
    fn = onnxscript.build_function(
        body, inputs, domain=DOMAIN, name=OP_TYPE, attributes=described, opset_imports={"": opset}
    )
    fn.overload = spec.variant(upcast)
    fn.outputs[0].name = "y"
    proto = ir.serde.serialize_function(fn)
    # The tracer's value_info would pin shapes of the attribute-driven constants; the body
    # must stay shape-generic, so let each runtime infer them.
    del proto.value_info[:]
    proto.attribute.extend(["epsilon", "axes"] + (["group_size"] if spec.group_size is not None else []))
    proto.doc_string = f"RMSNorm, variant {fn.overload}: gain={spec.gain}, order={spec.order}, " + (
        f"accumulation={spec.accumulation}, epsilon {spec.epsilon_placement.replace('_', ' ')}"
    )
    if spec.group_size is not None:
        proto.doc_string += ", normalized per group of group_size elements of the last dim"
    if spec.has_gate:
        proto.doc_string += f", gated by {spec.gate}(gate) {spec.gate_placement.replace('_', ' ')}"
    return proto.SerializeToString()


def function_proto(spec: RMSNormSpec, upcast: bool, opset: int) -> onnx.FunctionProto:
    """The FunctionProto (one overload of ``rmsnorm_deploy::RMSNorm``) of ``spec``'s variant.

    ``upcast``: whether the input dtype differs from the accumulation dtype
    (``spec.upcasts(input_dtype)``).
    """
    check_opset(opset)
    proto = onnx.FunctionProto()
    proto.ParseFromString(_function_proto_cached(_variant_spec(spec), bool(upcast), opset))
    return proto


def rmsnorm_node(
    spec: RMSNormSpec,
    input_dtype: Any,
    inputs: list[str],
    outputs: list[str],
    *,
    name: str = "",
    plugin: bool = False,
) -> onnx.NodeProto:
    """A ``rmsnorm_deploy::RMSNorm`` node carrying ``spec``; ``plugin`` adds TensorRT's plugin fields."""
    attrs: dict[str, Any] = {"epsilon": spec.epsilon, "axes": list(spec.axes)}
    attrs.update({key: getattr(spec, key) for key in _string_attributes(spec)})
    if spec.group_size is not None:
        attrs["group_size"] = spec.group_size
    if plugin:
        attrs.update(plugin_namespace=plugin_namespace(spec), plugin_version=PLUGIN_VERSION)
    node = onnx.helper.make_node(OP_TYPE, inputs, outputs, name=name or None, domain=DOMAIN, **attrs)
    node.overload = spec.variant(spec.upcasts(dtype_name(input_dtype)))
    return node


def _string_attributes(spec: RMSNormSpec) -> tuple[str, ...]:
    return _SPEC_STRING_ATTRIBUTES + (_GATE_STRING_ATTRIBUTES if spec.has_gate else ())


def is_rmsnorm_node(node: onnx.NodeProto) -> bool:
    return node.domain == DOMAIN and node.op_type == OP_TYPE


def spec_from_node(node: onnx.NodeProto) -> RMSNormSpec:
    """Read the spec back from a ``rmsnorm_deploy::RMSNorm`` node's attributes."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    try:
        return spec_from_attributes(attrs, f"node {node.name!r}")
    except (TypeError, ValueError) as exc:  # an attribute of the wrong type (SpecError is a ValueError too)
        if isinstance(exc, SpecError):
            raise
        raise SpecError(f"node {node.name!r}: epsilon {attrs.get('epsilon')!r} or axes {attrs.get('axes')!r} are not "
                        "a float and a list of ints; the node is invalid: re-export the model") from None


def spec_from_attributes(attrs: dict[str, Any], where: str = "RMSNorm") -> RMSNormSpec:
    """The spec of a node's attributes (``epsilon``, ``axes`` and the string fields, as
    ``bytes`` or ``str``), wherever they were read: an ONNX node, TensorRT plugin fields."""
    axes = [int(a) for a in attrs.get("axes", [-1])]
    k = len(axes)
    if axes != list(range(-k, 0)):
        raise LoweringError(f"{where}: axes {axes} are not the trailing dims; RMSNorm normalizes the last k dims")
    fields: dict[str, Any] = {"epsilon": float(attrs.get("epsilon", 1e-6)), "normalized_dims": k}
    for key in _SPEC_STRING_ATTRIBUTES + _GATE_STRING_ATTRIBUTES:
        if key in attrs:
            value = attrs[key]
            fields[key] = value.decode() if isinstance(value, bytes) else value
    if "group_size" in attrs:
        fields["group_size"] = int(attrs["group_size"])
    return RMSNormSpec(**fields)


def node_upcasts(node: onnx.NodeProto) -> bool | None:
    """Whether the node's variant converts its input before the reduction, from its overload.

    ``None`` when the node has no overload (a graph not written by this project).
    """
    if node.overload.endswith(".upcast"):
        return True
    if node.overload.endswith(".same_dtype"):
        return False
    return None
