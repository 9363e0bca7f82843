"""Where does each normalization reduction of a graph run, and in which dtype?

Works on any ONNX graph, ours or a third party's: it finds

* fused ops: ``RMSNormalization``, ``SimplifiedLayerNormalization``,
  ``SkipSimplifiedLayerNormalization``, ``LayerNormalization``, ``SkipLayerNormalization``;
* our ``rmsnorm_deploy::RMSNorm`` function nodes (their bodies are inlined and read);
* decomposed chains: ``Pow(t, 2)`` or ``Mul(t, t)`` into ``ReduceMean`` (or ``ReduceSum`` and
  a division), ``ReduceSumSquare`` and ``ReduceL2``, followed by the ``Add(eps)``/``Sqrt``
  that make it a norm; ``Cast`` nodes between the steps are seen through, as ONNX Runtime
  inserts them.

For each it reports the dtype the squares are computed in, the dtype the reduction
accumulates in, epsilon (and whether it sits inside the square root), the axes, and the
tensors at the norm's boundary (its input, gain, output), so that ``validate`` can compare
each norm with the float64 oracle of the spec it implies. A reduction whose squares or sum
are float16 or bfloat16 is a finding: the squares overflow float16 at ``|x| > 256`` and the
sum loses precision long before.

:func:`audit_after_onnxruntime` runs the same audit on the graph ONNX Runtime actually
executes (``optimized_model_filepath``), after its fusions and inserted casts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import onnx
import onnx.inliner
from onnx import numpy_helper

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import ModelFileError, UserError, one_line
from rmsnorm_deploy.graph.function import input_names, is_rmsnorm_node, spec_from_node

LOW_PRECISION = ("float16", "bfloat16")
_FUSED_OPS = {
    "RMSNormalization": "RMSNorm",
    "SimplifiedLayerNormalization": "RMSNorm",
    "SkipSimplifiedLayerNormalization": "RMSNorm (skip)",
    "LayerNormalization": "LayerNorm",
    "SkipLayerNormalization": "LayerNorm (skip)",
}
_SKIP_OPS = ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")
#: ONNX Runtime's CUDA kernels of the Skip*LayerNormalization ops accumulated in the input dtype
#: before this release (onnxruntime issue 29034, fixed by pull request 28682).
SKIP_FP32_ACCUMULATION_SINCE = (1, 27)
_REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2")
_DEFAULT_DOMAINS = ("", "ai.onnx")
_WIDTH = {"float64": 64, "float32": 32, "float16": 16, "bfloat16": 16}


@dataclasses.dataclass
class NormTensors:
    """The tensors at a norm's boundary: what ``validate`` exposes to check it in isolation.

    ``inputs`` are added to form the normalized value (one tensor, or input and skip [and
    bias] for the Skip ops); ``sum_output`` is the Skip ops' own ``input + skip`` output when
    the graph uses it; ``gain`` multiplies the normalized value (a weight, Gemma's ``1 + w``,
    or any tensor the graph multiplies by at that point), ``bias`` is LayerNorm's.
    """

    inputs: list[str]
    output: str
    gain: str | None = None
    bias: str | None = None
    sum_output: str | None = None
    gate: str | None = None  # the second input ``z`` of a gated rmsnorm_deploy::RMSNorm node

    def names(self) -> list[str]:
        return [n for n in [*self.inputs, self.gain, self.gate, self.bias, self.sum_output, self.output] if n]


@dataclasses.dataclass
class Reduction:
    """One normalization reduction found in a graph."""

    stage: str  # "as written" or "after onnxruntime (<level>)"
    node: str  # node name (or output name) of the op that reduces
    kind: str  # RMSNorm, LayerNorm, RMSNorm (skip), ...
    op: str  # the op or op chain, e.g. "SimplifiedLayerNormalization" or "Pow>ReduceMean>Add>Sqrt"
    input_dtype: str
    accumulation: str
    epsilon: float | None
    axes: list[int] | None
    note: str = ""
    spec: dict[str, Any] | None = None
    squares: str = ""  # dtype the squares are computed in ("" when the op does it internally)
    epsilon_placement: str = "inside_sqrt"
    order: str = "scale_then_cast"  # cast_then_scale when the normalized value is narrowed before the gain
    normalized_dims: int | None = None
    tensors: NormTensors | None = None
    placement: str = ""  # pre, post, sublayer_output, qk, final, other (graph/placement.py); "" if not placed
    gate: str = ""  # a gated norm's gate, e.g. "silu(z) before_norm" (our nodes: from the spec)

    @property
    def problem(self) -> str:
        """Why this norm cannot compute a correct result whatever its inputs ("" if none): an
        epsilon that is NaN, infinite, zero or negative (NaN, all-zero or NaN rows out)."""
        eps = self.epsilon
        if eps is None:
            return ""
        if math.isnan(eps):
            return "its epsilon is NaN: every output is NaN; the graph is broken, re-export it with a positive epsilon"
        if math.isinf(eps):
            return (f"its epsilon is {eps}: every output is 0 or NaN; the graph is broken, re-export it with a "
                    "finite positive epsilon")
        if eps <= 0:
            return (f"its epsilon is {eps:g}, not positive: rows of small or zero values give NaN or Inf; "
                    "re-export it with a positive epsilon")
        return ""

    @property
    def low_precision(self) -> bool:
        return self.accumulation in LOW_PRECISION or self.squares in LOW_PRECISION

    @property
    def precision(self) -> str:
        """Squares and sum in one word when they agree, e.g. ``float32`` or ``float16 squares, float32 sum``."""
        if not self.squares or self.squares == self.accumulation:
            return self.accumulation
        return f"{self.squares} squares, {self.accumulation} sum"

    def implied_spec(self) -> RMSNormSpec | None:
        """The RMSNorm spec this reduction computes (ours: the node's own), or ``None`` if it is no RMSNorm.

        The float64 oracle of this spec is what the norm's output is measured against; rounding
        order does not change the oracle, so it is left at its default.
        """
        if self.spec is not None:
            return RMSNormSpec.from_dict(self.spec)
        if not self.kind.startswith("RMSNorm") or self.epsilon is None or not self.normalized_dims:
            return None
        gain = "weight" if self.tensors is not None and self.tensors.gain else "none"
        try:
            return RMSNormSpec(self.epsilon, self.normalized_dims, gain, self.order,  # type: ignore[arg-type]
                               epsilon_placement=self.epsilon_placement)
        except UserError:
            return None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["low_precision"] = self.low_precision
        data["problem"] = self.problem
        if data["epsilon"] is not None and not math.isfinite(data["epsilon"]):
            data["epsilon"] = str(data["epsilon"])  # JSON has no NaN or Infinity
        return data


def audit_model(model: onnx.ModelProto, *, stage: str = "as written", onnxruntime_version: str | None = None) -> list[Reduction]:
    """Every normalization reduction of ``model`` with the dtype it accumulates in.

    ``onnxruntime_version`` decides what the Skip*LayerNormalization ops (which have no
    ``stash_type``) accumulate in; by default the installed ONNX Runtime's.
    """
    ours = {node.output[0]: node for node in model.graph.node if is_rmsnorm_node(node)}
    for node in ours.values():  # their attributes become the function body's constants: checked first
        _attr(node, "epsilon", None, "float")
        _attr(node, "axes", None, "ints")
    inlined = _inline_for_analysis(model)
    graph = _Graph(inlined)
    ort_version = _ort_version() if onnxruntime_version is None else _parse_version(onnxruntime_version)
    found: list[Reduction] = []
    for node in inlined.graph.node:
        if node.op_type in _FUSED_OPS and node.domain in (*_DEFAULT_DOMAINS, "com.microsoft"):
            found.append(_fused(node, graph, stage, ort_version))
        elif node.op_type in _REDUCTIONS and node.domain in _DEFAULT_DOMAINS:
            red = _decomposed(node, graph, stage)
            if red is not None:
                found.append(red)
    # Tie each chain to the rmsnorm_deploy node it came from: the inliner keeps the node's output
    # name, and the chain's reduction lies in the node's inlined body (a gate may follow the chain).
    owner = _body_owners(inlined, ours)
    for red in found:
        out = red.tensors.output if red.tensors else None
        out = out if out in ours else owner.get(red.node)
        if out in ours:
            node = ours[out]
            try:
                spec: RMSNormSpec | None = spec_from_node(node)
            except UserError:
                spec = None
            red.spec = spec.to_dict() if spec is not None else None
            named = dict(zip(input_names(spec), node.input)) if spec is not None else {}
            red.tensors = NormTensors(inputs=[node.input[0]], gain=named.get("weight") or None, output=out,
                                      gate=named.get("z") or None)
            red.input_dtype = graph.dtype(node.input[0])
            red.note = f"-> {out}"
            if spec is not None and spec.has_gate:
                red.gate = f"{spec.gate}(z) {spec.gate_placement}"
                red.note += f", gated by {red.gate}"
            red.node = node.name or red.node
            red.op = f"{node.domain}::{node.op_type}[{red.op}]"
    return found


def _body_owners(inlined: onnx.ModelProto, ours: dict[str, onnx.NodeProto]) -> dict[str, str]:
    """Label of each node of an inlined rmsnorm_deploy body -> the output of the node it came from:
    the nodes between the node's output and its inputs."""
    producers = {out: n for n in inlined.graph.node for out in n.output}
    owners: dict[str, str] = {}
    for out, node in ours.items():
        stop, todo, seen = set(node.input), [out], set()
        while todo and len(seen) < 256:
            name = todo.pop()
            producer = producers.get(name)
            if name in stop or producer is None or id(producer) in seen:
                continue
            seen.add(id(producer))
            owners.setdefault(_label(producer), out)
            todo.extend(producer.input)
    return owners


class _Graph:
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
            if _WIDTH.get(self.dtype(src.input[0]), 0) > _WIDTH.get(self.dtype(name), 0):
                break
            name = src.input[0]
        return name

    def scalar(self, name: str) -> float | None:
        value = self.consts.get(name)
        if value is None or value.size != 1:
            return None
        return float(value.reshape(-1)[0])


def _inline_for_analysis(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    # Weights are not needed to see types; keep the copy small.
    for init in copy.graph.initializer:
        if init.raw_data and len(init.raw_data) > 64:
            init.ClearField("raw_data")
            init.data_location = onnx.TensorProto.DEFAULT
            del init.external_data[:]
            _mark_placeholder(init)
    if copy.functions:
        copy = onnx.inliner.inline_local_functions(copy)
    return copy


def _mark_placeholder(init: onnx.TensorProto) -> None:
    # An empty raw_data with dims would fail shape inference's size check; the data is
    # irrelevant here, so declare it as external data that is never read.
    init.data_location = onnx.TensorProto.EXTERNAL
    init.external_data.add(key="location", value="__audit_placeholder__")


def _value_types(model: onnx.ModelProto) -> tuple[dict[str, str], dict[str, int]]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:
        inferred = model
    types: dict[str, str] = {}
    ranks: dict[str, int] = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tensor_type = vi.type.tensor_type
        if tensor_type.elem_type:
            types[vi.name] = _safe_dtype(tensor_type.elem_type)
        if tensor_type.HasField("shape"):
            ranks[vi.name] = len(tensor_type.shape.dim)
    for init in g.initializer:
        types[init.name] = _safe_dtype(init.data_type)
        ranks[init.name] = len(init.dims)
    for node in g.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = _safe_dtype(attr.t.data_type)
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
        if node.op_type in _FUSED_OPS and node.input and node.input[0] in ranks:
            ranks.setdefault(node.output[0], ranks[node.input[0]])
        if node.output[0] in types:
            continue
        if node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to":
                    types[node.output[0]] = _safe_dtype(attr.i)
        elif node.op_type == "CastLike" and len(node.input) > 1 and node.input[1] in types:
            types[node.output[0]] = types[node.input[1]]
        elif node.op_type in _TYPE_FROM_INPUT and node.input:
            index = _TYPE_FROM_INPUT[node.op_type]
            src = node.input[index] if len(node.input) > index and node.input[index] in types else node.input[0]
            if src in types:
                types[node.output[0]] = types[src]
                if node.op_type in _SKIP_OPS and len(node.output) > 3 and node.output[3]:
                    types[node.output[3]] = types[node.input[0]]
                if node.op_type == "Split":
                    for out in node.output:
                        types.setdefault(out, types[src])


def _safe_dtype(elem: int) -> str:
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
                    raise ModelFileError(f"Constant node {_label(node)!r}: attribute {attr.name!r} is "
                                         f"{onnx.AttributeProto.AttributeType.Name(attr.type)}; the graph is invalid: "
                                         "fix or re-export it")
                if attr.name == "value":
                    try:
                        consts[node.output[0]] = numpy_helper.to_array(attr.t)
                    except (TypeError, ValueError) as exc:
                        raise ModelFileError(f"Constant node {_label(node)!r}: its value is not a valid tensor "
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


def _attr(node: onnx.NodeProto, name: str, default: Any = None, kind: str | None = None) -> Any:
    """Attribute ``name`` of ``node``; with ``kind`` (float, int, ints) one of another type is a
    one-line :class:`ModelFileError` (the graph is invalid), not a crash further on."""
    for a in node.attribute:
        if a.name == name:
            if kind is not None and a.type != _ATTR_TYPES[kind]:
                raise ModelFileError(
                    f"node {_label(node)!r} ({node.op_type}): attribute {name!r} is "
                    f"{onnx.AttributeProto.AttributeType.Name(a.type)}, not {kind.upper()}; "
                    "the graph is invalid: fix or re-export it")
            return onnx.helper.get_attribute_value(a)
    return default


def _label(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if node.output else node.op_type)


def _ort_version() -> tuple[int, ...] | None:
    from rmsnorm_deploy.resources import package_version

    for dist in ("onnxruntime", "onnxruntime-gpu"):
        version = package_version(dist)
        if version != "not installed":
            return _parse_version(version)
    return None


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _normalized_dims(axes: list[int], rank: int | None) -> int | None:
    """How many trailing dims ``axes`` cover, or ``None`` if they are not exactly the trailing dims."""
    if not axes:
        return None
    if rank is None:
        if any(a >= 0 for a in axes):
            return None
        relative = sorted(axes)
    else:
        relative = sorted(a - rank if a >= 0 else a for a in axes)
    return len(relative) if relative == list(range(-len(relative), 0)) else None


def _fused(node: onnx.NodeProto, graph: _Graph, stage: str, ort_version: tuple[int, ...] | None) -> Reduction:
    in_dtype = graph.dtype(node.input[0])
    eps_default = 1e-12 if node.op_type == "SkipSimplifiedLayerNormalization" else 1e-5
    eps = _attr(node, "epsilon", eps_default, "float")
    axis = int(_attr(node, "axis", -1, "int"))
    rank = graph.ranks.get(node.input[0])
    note = ""
    if node.op_type in _SKIP_OPS:
        acc, note = _skip_accumulation(node, in_dtype, ort_version)
    else:
        acc = _safe_dtype(_attr(node, "stash_type", 1, "int"))
        if acc in LOW_PRECISION:
            note = f"stash_type asks for {acc} accumulation"
    if rank is not None and axis >= 0:
        axes = list(range(axis, rank))
    elif axis < 0:
        axes = list(range(axis, 0))
    else:
        axes = [axis]
    tensors = _fused_tensors(node)
    tensors.output = _through_casts_forward(tensors.output, graph)
    # ONNX's RMSNormalization rounds the normalized value to the input type before scaling; ONNX
    # Runtime's ops scale in float32 and round once.
    order = "cast_then_scale" if node.op_type == "RMSNormalization" else "scale_then_cast"
    return Reduction(stage, _label(node), _FUSED_OPS[node.op_type], node.op_type, in_dtype, acc,
                     float(eps) if eps is not None else None, axes, note, order=order,
                     normalized_dims=_normalized_dims(axes, rank), tensors=tensors)


def _skip_accumulation(node: onnx.NodeProto, in_dtype: str, ort_version: tuple[int, ...] | None) -> tuple[str, str]:
    """What a Skip*LayerNormalization op accumulates in under ONNX Runtime (it has no stash_type).

    The CPU kernel widens to float32; the CUDA kernel (non-strict mode, the default) summed in
    the input dtype until ONNX Runtime 1.27. The worst of the two is reported.
    """
    fixed = ".".join(map(str, SKIP_FP32_ACCUMULATION_SINCE))
    unset_eps = "; epsilon unset, ONNX Runtime's default is 1e-12" if (
        node.op_type == "SkipSimplifiedLayerNormalization" and _attr(node, "epsilon", None, "float") is None) else ""
    if in_dtype not in LOW_PRECISION:
        return "float32", "no stash_type" + unset_eps
    if ort_version is not None and ort_version[:2] >= SKIP_FP32_ACCUMULATION_SINCE:
        return "float32", (f"no stash_type: ONNX Runtime {'.'.join(map(str, ort_version))} accumulates in float32; "
                           f"its CUDA kernel before {fixed} summed in {in_dtype} (onnxruntime#29034)" + unset_eps)
    seen = "not installed" if ort_version is None else ".".join(map(str, ort_version))
    return in_dtype, (f"no stash_type: ONNX Runtime's CUDA kernel before {fixed} sums in {in_dtype} "
                      f"(onnxruntime#29034; installed: {seen})" + unset_eps)


def _fused_tensors(node: onnx.NodeProto) -> NormTensors:
    def opt(i: int, names: Any) -> str | None:
        return names[i] if len(names) > i and names[i] else None

    op = node.op_type
    if op == "SkipSimplifiedLayerNormalization":  # input, skip, gamma, [bias]
        inputs = [node.input[0], node.input[1]] + ([node.input[3]] if opt(3, node.input) else [])
        return NormTensors(inputs, node.output[0], gain=opt(2, node.input), sum_output=opt(3, node.output))
    if op == "SkipLayerNormalization":  # input, skip, gamma, [beta], [bias]
        inputs = [node.input[0], node.input[1]] + ([node.input[4]] if opt(4, node.input) else [])
        return NormTensors(inputs, node.output[0], gain=opt(2, node.input), bias=opt(3, node.input),
                           sum_output=opt(3, node.output))
    if op == "LayerNormalization":  # X, scale, [B]
        return NormTensors([node.input[0]], node.output[0], gain=opt(1, node.input), bias=opt(2, node.input))
    return NormTensors([node.input[0]], node.output[0], gain=opt(1, node.input))


def _through_casts_forward(name: str, graph: _Graph) -> str:
    """Where a norm's value ends up after the narrowing Casts that alone consume it (back to the model
    dtype); a widening Cast belongs to the next op (ONNX Runtime's CPU provider inserts those)."""
    for _ in range(4):
        nxt = graph.single_consumer(name)
        if nxt is None or nxt.op_type not in ("Cast", "CastLike") or nxt.input[0] != name:
            break
        if _WIDTH.get(graph.dtype(nxt.output[0]), 0) > _WIDTH.get(graph.dtype(name), 0):
            break
        name = nxt.output[0]
    return name


def _decomposed(node: onnx.NodeProto, graph: _Graph, stage: str) -> Reduction | None:
    chain = [node.op_type]
    if node.op_type in ("ReduceMean", "ReduceSum"):
        square_out = graph.through_casts_back(node.input[0])
        src = graph.producers.get(square_out)
        if src is None or not _is_square(src, graph.consts):
            return None
        chain.insert(0, src.op_type)
        squared_input = src.input[0]
        squares = graph.dtype(square_out)
        acc = graph.dtype(node.input[0])
    else:  # ReduceSumSquare / ReduceL2 square and sum in their input dtype
        squared_input = node.input[0]
        acc = squares = graph.dtype(squared_input)
    kind = "RMSNorm"
    centered = graph.producers.get(graph.through_casts_back(squared_input))
    if centered is not None and centered.op_type == "Sub":
        mean = graph.producers.get(graph.through_casts_back(centered.input[1]))
        if mean is not None and mean.op_type == "ReduceMean":
            kind = "LayerNorm"
    tail = _follow_denominator(node.output[0], graph)
    if tail.epsilon is None and not tail.ops:
        return None  # a bare sum or mean of squares (e.g. a loss), not a normalization
    if node.op_type == "ReduceSum" and not tail.scaled:
        return None  # a sum of squares never divided by the count is a norm, not a mean square
    chain += tail.ops
    axes = _reduce_axes(node, graph.consts)
    x = graph.through_casts_back(squared_input)
    in_dtype = graph.dtype(x)
    tensors, order = (_decomposed_tensors(x, squared_input, tail.denominator, tail.reciprocal, graph)
                      if kind == "RMSNorm" else (None, "scale_then_cast"))
    rank = graph.ranks.get(squared_input)
    normalized = _normalized_dims(axes, rank) if axes is not None else None
    return Reduction(stage, _label(node), kind, ">".join(chain), in_dtype, acc, tail.epsilon, axes,
                     note=f"-> {tensors.output}" if tensors else "", squares=squares,
                     epsilon_placement=tail.placement, order=order, normalized_dims=normalized, tensors=tensors)


def _is_square(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> bool:
    if node.op_type == "Pow" and len(node.input) == 2 and node.input[1] in consts:
        return bool(np.all(consts[node.input[1]] == 2))
    return node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]


@dataclasses.dataclass
class _Tail:
    ops: list[str]
    epsilon: float | None
    placement: str
    denominator: str
    reciprocal: bool
    scaled: bool  # divided by a constant count (ReduceSum -> mean)


def _follow_denominator(start: str, graph: _Graph) -> _Tail:
    """Walk ``Div/Mul(count)``, ``Add(eps)``, ``Sqrt``, ``Reciprocal`` and Casts after the reduction."""
    eps, ops, current = None, [], start
    placement, seen_sqrt, reciprocal, scaled = "inside_sqrt", False, False, False
    for _ in range(6):
        nxt = graph.single_consumer(current)
        if nxt is None:
            break
        if nxt.op_type == "Add":
            other = nxt.input[1] if nxt.input[0] == current else nxt.input[0]
            value = graph.scalar(other)
            if value is None or eps is not None:
                break
            eps = value
            placement = "outside_sqrt" if seen_sqrt else "inside_sqrt"
        elif nxt.op_type in ("Div", "Mul") and not seen_sqrt and eps is None:
            other = nxt.input[1] if nxt.input[0] == current else nxt.input[0]
            if graph.scalar(other) is None or (nxt.op_type == "Div" and nxt.input[0] != current):
                break
            scaled = True
        elif nxt.op_type == "Sqrt" and not seen_sqrt:
            seen_sqrt = True
        elif nxt.op_type == "Reciprocal" and seen_sqrt:
            reciprocal = True
        elif nxt.op_type not in ("Cast", "CastLike"):
            break
        if nxt.op_type not in ("Cast", "CastLike"):
            ops.append(nxt.op_type)
        current = nxt.output[0]
        if reciprocal:
            break
    return _Tail(ops, eps, placement, current, reciprocal, scaled)


def _decomposed_tensors(
    x: str, squared_input: str, denominator: str, reciprocal: bool, graph: _Graph
) -> tuple[NormTensors | None, str]:
    """Follow the normalized value to the norm's output: ``Div(x, den)`` or ``Mul(x, 1/den)``,
    then Casts, at most one ``Mul`` by the gain, and Casts. Also the rounding order: whether the
    normalized value is narrowed (rounded to the input dtype) before the gain multiplies it."""
    numerators = {x, squared_input}
    normalized = None
    for cand in graph.consumers.get(denominator, []):
        if reciprocal and cand.op_type == "Mul":
            other = cand.input[1] if cand.input[0] == denominator else cand.input[0]
        elif not reciprocal and cand.op_type == "Div" and cand.input[1] == denominator:
            other = cand.input[0]
        else:
            continue
        if other in numerators or graph.through_casts_back(other) == x:
            normalized = cand
            break
    if normalized is None:
        return None, "scale_then_cast"
    current, gain, narrowed = normalized.output[0], None, False
    for _ in range(6):
        nxt = graph.single_consumer(current)
        if nxt is None:
            break
        if nxt.op_type in ("Cast", "CastLike"):
            narrowed |= _WIDTH.get(graph.dtype(nxt.output[0]), 64) < _WIDTH.get(graph.dtype(current), 0)
            current = nxt.output[0]
        elif nxt.op_type == "Mul" and gain is None and len(nxt.input) == 2 and nxt.input[0] != nxt.input[1]:
            gain = nxt.input[1] if nxt.input[0] == current else nxt.input[0]
            current = nxt.output[0]
            break
        else:
            break
    order = "cast_then_scale" if gain is not None and narrowed else "scale_then_cast"
    return NormTensors([x], _through_casts_forward(current, graph), gain=gain), order


def _reduce_axes(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> list[int] | None:
    axes = _attr(node, "axes", None, "ints")
    if axes is not None:
        return [int(a) for a in axes]
    if len(node.input) > 1 and node.input[1] in consts:
        return [int(a) for a in np.atleast_1d(consts[node.input[1]])]
    return None


def audit_after_onnxruntime(
    model: onnx.ModelProto | str | os.PathLike,
    *,
    optimization: str = "all",
    providers: Iterable[str] = ("cpu",),
    onnxruntime_version: str | None = None,
) -> list[Reduction]:
    """Audit the graph ONNX Runtime runs: the model after its graph optimizations."""
    result = optimized_by_onnxruntime(model, optimization=optimization, providers=providers)
    return audit_model(result, stage=f"after onnxruntime ({optimization})", onnxruntime_version=onnxruntime_version)


def optimized_by_onnxruntime(model: onnx.ModelProto | str | os.PathLike, *, optimization: str = "all",
                             providers: Iterable[str] = ("cpu",)) -> onnx.ModelProto:
    """The graph ONNX Runtime runs for ``model`` (``optimized_model_filepath``), without its weights' data."""
    from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner

    with tempfile.TemporaryDirectory(prefix="rmsnorm-audit-") as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        with OnnxRuntimeRunner(model, list(providers), optimization=optimization, optimized_model_path=optimized):
            pass
        return onnx.load(str(optimized), load_external_data=False)


def low_precision_reductions(reductions: Iterable[Reduction]) -> list[Reduction]:
    return [r for r in reductions if r.low_precision]


def broken_reductions(reductions: Iterable[Reduction]) -> list[Reduction]:
    """Reductions that cannot give a correct result (``Reduction.problem``: e.g. a NaN or negative epsilon)."""
    return [r for r in reductions if r.problem]
