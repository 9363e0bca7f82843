"""An ONNX graph as the audit reads it: local functions inlined, every value's dtype and rank
(shape inference, then propagation through the ops inference leaves untyped), constants, and
attributes read with their types checked (a damaged graph is a one-line ``ModelFileError``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.inliner
from onnx import numpy_helper

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.errors import ModelFileError, UserError, one_line
from rmsnorm_deploy.graph.reductions import DTYPE_WIDTH

FUSED_OPS = {
    "RMSNormalization": "RMSNorm",
    "SimplifiedLayerNormalization": "RMSNorm",
    "SkipSimplifiedLayerNormalization": "RMSNorm (skip)",
    "LayerNormalization": "LayerNorm",
    "SkipLayerNormalization": "LayerNorm (skip)",
}
SKIP_OPS = ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")
DEFAULT_DOMAINS = ("", "ai.onnx")


class GraphView:
    """Types, constants, producers and consumers of one (inlined) graph."""

    def __init__(self, model: onnx.ModelProto):
        self.types, self.ranks = _value_types(model)
        self.consts = _constants(model)
        self.producers = {out: n for n in model.graph.node for out in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in model.graph.node:
            for inp in n.input:
                self.consumers.setdefault(inp, []).append(n)

    def dtype(self, name: str) -> str:
        return self.types.get(name, "unknown")

    def single_consumer(self, name: str) -> onnx.NodeProto | None:
        nexts = self.consumers.get(name, [])
        return nexts[0] if len(nexts) == 1 else None

    def through_casts_back(self, name: str) -> str:
        """The tensor ``name`` was widened from (following widening Casts upward; a narrowing Cast,
        e.g. a float32 graph input cast to float16, is where the low-precision value starts)."""
        for _ in range(4):
            src = self.producers.get(name)
            if src is None or src.op_type not in ("Cast", "CastLike") or not src.input:
                break
            if DTYPE_WIDTH.get(self.dtype(src.input[0]), 0) > DTYPE_WIDTH.get(self.dtype(name), 0):
                break
            name = src.input[0]
        return name

    def scalar(self, name: str) -> float | None:
        value = self.consts.get(name)
        if value is None or value.size != 1:
            return None
        return float(value.reshape(-1)[0])


def inline_for_analysis(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = weightless_copy(model)
    if copy.functions:
        copy = onnx.inliner.inline_local_functions(copy)
    return copy


#: initializers up to this many bytes keep their data in a weightless copy (shapes, axes, epsilons)
_SMALL_TENSOR_BYTES = 64


def weightless_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the data of its large initializers: types and shapes are all the readers of a
    graph need, and copying (or shape-inferring) a model with its weights costs seconds per GB."""
    light = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(light, field, value)
    for field, value in model.graph.ListFields():
        if field.name != "initializer":
            _copy_field(light.graph, field, value)
    for init in model.graph.initializer:
        if len(init.raw_data) <= _SMALL_TENSOR_BYTES:
            light.graph.initializer.add().CopyFrom(init)
            continue
        copy = light.graph.initializer.add(name=init.name, data_type=init.data_type, doc_string=init.doc_string)
        copy.dims.extend(init.dims)
        _mark_placeholder(copy)
    return light


def _copy_field(target: Any, field: Any, value: Any) -> None:
    if hasattr(value, "extend"):  # a repeated field
        getattr(target, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def _mark_placeholder(init: onnx.TensorProto) -> None:
    # An empty raw_data with dims would fail shape inference's size check; the data is
    # irrelevant here, so declare it as external data that is never read.
    init.data_location = onnx.TensorProto.EXTERNAL
    init.external_data.add(key="location", value="__audit_placeholder__")


def _value_types(model: onnx.ModelProto) -> tuple[dict[str, str], dict[str, int]]:
    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_copy(model), check_type=False, strict_mode=False)
    except Exception:
        inferred = model
    types: dict[str, str] = {}
    ranks: dict[str, int] = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tensor_type = vi.type.tensor_type
        if tensor_type.elem_type:
            types[vi.name] = safe_dtype(tensor_type.elem_type)
        if tensor_type.HasField("shape"):
            ranks[vi.name] = len(tensor_type.shape.dim)
    for init in g.initializer:
        types[init.name] = safe_dtype(init.data_type)
        ranks[init.name] = len(init.dims)
    for node in g.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = safe_dtype(attr.t.data_type)
                elif attr.name in ("value_float", "value_floats"):
                    types[node.output[0]] = "float32"
    _propagate_types(g, types, ranks)
    return types, ranks


#: Ops whose first output has the type of one of their inputs (which one: the index), for graphs
#: whose ops shape inference does not know (com.microsoft fusions, or nodes downstream of them).
_TYPE_FROM_INPUT = {
    **dict.fromkeys(
        ["Pow", "Mul", "Add", "Sub", "Div", "Sqrt", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2",
         "Reciprocal", "Neg", "Abs", "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Tile",
         "Flatten", "Concat", "Split", "Slice", "Gather", "Pad", "MatMul", "Gemm", "Relu", "Gelu", "FastGelu",
         "BiasGelu", "QuickGelu", "Sigmoid", "Tanh", "Erf", "Softmax", "Max", "Min", "Clip", "Exp", "Log",
         "SkipSimplifiedLayerNormalization", "LayerNormalization", "RMSNormalization", "SkipLayerNormalization",
         "RotaryEmbedding", "MultiHeadAttention", "GroupQueryAttention", "Attention", "MatMulNBits", "BiasAdd"], 0),
    "Where": 1,
    # Its output type follows the scale (input 1), not the input.
    "SimplifiedLayerNormalization": 1,
}


def _propagate_types(g: onnx.GraphProto, types: dict[str, str], ranks: dict[str, int]) -> None:
    """Fill types that shape inference left out (ops it has no schema for), in node order."""
    for node in g.node:
        if not node.output:
            continue
        if node.op_type in FUSED_OPS and node.input and node.input[0] in ranks:
            ranks.setdefault(node.output[0], ranks[node.input[0]])
        if node.output[0] in types:
            continue
        if node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to":
                    types[node.output[0]] = safe_dtype(attr.i)
        elif node.op_type == "CastLike" and len(node.input) > 1 and node.input[1] in types:
            types[node.output[0]] = types[node.input[1]]
        elif node.op_type in _TYPE_FROM_INPUT and node.input:
            index = _TYPE_FROM_INPUT[node.op_type]
            src = node.input[index] if len(node.input) > index and node.input[index] in types else node.input[0]
            if src in types:
                types[node.output[0]] = types[src]
                if node.op_type in SKIP_OPS and len(node.output) > 3 and node.output[3]:
                    types[node.output[3]] = types[node.input[0]]
                if node.op_type == "Split":
                    for out in node.output:
                        types.setdefault(out, types[src])


def safe_dtype(elem: int) -> str:
    try:
        return dtype_name(elem)
    except UserError:
        return onnx.TensorProto.DataType.Name(elem).lower()


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Small constant tensors: initializers, Constant nodes, and Casts/Identities of those."""
    consts: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL and _numel(init) <= 16:
            try:
                consts[init.name] = numpy_helper.to_array(init)
            except Exception:
                pass
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name.startswith("value") and attr.type not in _CONSTANT_TYPES.get(attr.name, ()):
                    raise ModelFileError(f"Constant node {node_label(node)!r}: attribute {attr.name!r} is "
                                         f"{onnx.AttributeProto.AttributeType.Name(attr.type)}; the graph is invalid: "
                                         "fix or re-export it")
                if attr.name == "value":
                    try:
                        consts[node.output[0]] = numpy_helper.to_array(attr.t)
                    except (TypeError, ValueError) as exc:
                        raise ModelFileError(f"Constant node {node_label(node)!r}: its value is not a valid tensor "
                                             f"({one_line(exc)}); the graph is invalid: fix or re-export it") from None
                elif attr.name == "value_float":
                    consts[node.output[0]] = np.array(attr.f, dtype=np.float32)
                elif attr.name == "value_floats":
                    consts[node.output[0]] = np.array(list(attr.floats), dtype=np.float32)
                elif attr.name == "value_ints":
                    consts[node.output[0]] = np.array(list(attr.ints), dtype=np.int64)
                elif attr.name == "value_int":
                    consts[node.output[0]] = np.array(attr.i, dtype=np.int64)
        elif node.op_type in ("Cast", "CastLike", "Identity") and node.input and node.input[0] in consts:
            # ONNX Runtime casts constants in front of ops it runs in another precision.
            consts[node.output[0]] = consts[node.input[0]].astype(np.float64)
    return consts


_A = onnx.AttributeProto
#: the attribute type each ``value*`` attribute of a Constant must have
_CONSTANT_TYPES = {"value": (_A.TENSOR,), "value_float": (_A.FLOAT,), "value_floats": (_A.FLOATS,),
                   "value_int": (_A.INT,), "value_ints": (_A.INTS,), "value_string": (_A.STRING,),
                   "value_strings": (_A.STRINGS,), "value_sparse": (_A.SPARSE_TENSOR,)}


def _numel(t: onnx.TensorProto) -> int:
    return int(np.prod(t.dims)) if t.dims else 1


_ATTR_TYPES = {"float": onnx.AttributeProto.FLOAT, "int": onnx.AttributeProto.INT, "ints": onnx.AttributeProto.INTS}


def attribute(node: onnx.NodeProto, name: str, default: Any = None, kind: str | None = None) -> Any:
    """Attribute ``name`` of ``node``; with ``kind`` (float, int, ints) one of another type is a
    one-line :class:`ModelFileError` (the graph is invalid), not a crash further on."""
    for a in node.attribute:
        if a.name == name:
            if kind is not None and a.type != _ATTR_TYPES[kind]:
                raise ModelFileError(
                    f"node {node_label(node)!r} ({node.op_type}): attribute {name!r} is "
                    f"{onnx.AttributeProto.AttributeType.Name(a.type)}, not {kind.upper()}; "
                    "the graph is invalid: fix or re-export it")
            return onnx.helper.get_attribute_value(a)
    return default


def node_label(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if node.output else node.op_type)
