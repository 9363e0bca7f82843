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

The result types are ``reductions``, the graph reading ``onnx_reading``; this module holds the
pattern matchers. ``validate.audit`` runs the same audit on the graph ONNX Runtime actually
executes (``optimized_model_filepath``), after its fusions and inserted casts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.function import input_names, is_rmsnorm_node, spec_from_node
from rmsnorm_deploy.graph.onnx_reading import (
    DEFAULT_DOMAINS,
    FUSED_OPS,
    SKIP_OPS,
    GraphView,
    attribute,
    inline_for_analysis,
    node_label,
    safe_dtype,
)
from rmsnorm_deploy.graph.reductions import DTYPE_WIDTH, LOW_PRECISION, NormTensors, Reduction
from rmsnorm_deploy.resources import package_version

#: ONNX Runtime's CUDA kernels of the Skip*LayerNormalization ops accumulated in the input dtype
#: before this release (onnxruntime issue 29034, fixed by pull request 28682).
SKIP_FP32_ACCUMULATION_SINCE = (1, 27)
_REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2")


def audit_model(model: onnx.ModelProto, *, stage: str = "as written", onnxruntime_version: str | None = None) -> list[Reduction]:
    """Every normalization reduction of ``model`` with the dtype it accumulates in.

    ``onnxruntime_version`` decides what the Skip*LayerNormalization ops (which have no
    ``stash_type``) accumulate in; by default the installed ONNX Runtime's.
    """
    ours = {node.output[0]: node for node in model.graph.node if is_rmsnorm_node(node)}
    for node in ours.values():  # their attributes become the function body's constants: checked first
        attribute(node, "epsilon", None, "float")
        attribute(node, "axes", None, "ints")
    inlined = inline_for_analysis(model)
    graph = GraphView(inlined)
    ort_version = _ort_version() if onnxruntime_version is None else _parse_version(onnxruntime_version)
    found: list[Reduction] = []
    for node in inlined.graph.node:
        if node.op_type in FUSED_OPS and node.domain in (*DEFAULT_DOMAINS, "com.microsoft"):
            found.append(_fused(node, graph, stage, ort_version))
        elif node.op_type in _REDUCTIONS and node.domain in DEFAULT_DOMAINS:
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
            owners.setdefault(node_label(producer), out)
            todo.extend(producer.input)
    return owners


def _ort_version() -> tuple[int, ...] | None:

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


def _fused(node: onnx.NodeProto, graph: GraphView, stage: str, ort_version: tuple[int, ...] | None) -> Reduction:
    in_dtype = graph.dtype(node.input[0])
    eps_default = 1e-12 if node.op_type == "SkipSimplifiedLayerNormalization" else 1e-5
    eps = attribute(node, "epsilon", eps_default, "float")
    axis = int(attribute(node, "axis", -1, "int"))
    rank = graph.ranks.get(node.input[0])
    note = ""
    if node.op_type in SKIP_OPS:
        acc, note = _skip_accumulation(node, in_dtype, ort_version)
    else:
        acc = safe_dtype(attribute(node, "stash_type", 1, "int"))
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
    return Reduction(stage, node_label(node), FUSED_OPS[node.op_type], node.op_type, in_dtype, acc,
                     float(eps) if eps is not None else None, axes, note, order=order,
                     normalized_dims=_normalized_dims(axes, rank), tensors=tensors)


def _skip_accumulation(node: onnx.NodeProto, in_dtype: str, ort_version: tuple[int, ...] | None) -> tuple[str, str]:
    """What a Skip*LayerNormalization op accumulates in under ONNX Runtime (it has no stash_type).

    The CPU kernel widens to float32; the CUDA kernel (non-strict mode, the default) summed in
    the input dtype until ONNX Runtime 1.27. The worst of the two is reported.
    """
    fixed = ".".join(map(str, SKIP_FP32_ACCUMULATION_SINCE))
    unset_eps = "; epsilon unset, ONNX Runtime's default is 1e-12" if (
        node.op_type == "SkipSimplifiedLayerNormalization" and attribute(node, "epsilon", None, "float") is None) else ""
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


def _through_casts_forward(name: str, graph: GraphView) -> str:
    """Where a norm's value ends up after the narrowing Casts that alone consume it (back to the model
    dtype); a widening Cast belongs to the next op (ONNX Runtime's CPU provider inserts those)."""
    for _ in range(4):
        nxt = graph.single_consumer(name)
        if nxt is None or nxt.op_type not in ("Cast", "CastLike") or nxt.input[0] != name:
            break
        if DTYPE_WIDTH.get(graph.dtype(nxt.output[0]), 0) > DTYPE_WIDTH.get(graph.dtype(name), 0):
            break
        name = nxt.output[0]
    return name


def _decomposed(node: onnx.NodeProto, graph: GraphView, stage: str) -> Reduction | None:
    chain = [node.op_type]
    if node.op_type in ("ReduceMean", "ReduceSum"):
        square_out = _squares_of(node.input[0], graph)
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
    return Reduction(stage, node_label(node), kind, ">".join(chain), in_dtype, acc, tail.epsilon, axes,
                     note=f"-> {tensors.output}" if tensors else "", squares=squares,
                     epsilon_placement=tail.placement, order=order, normalized_dims=normalized, tensors=tensors)


def _squares_of(summed: str, graph: GraphView) -> str:
    """The tensor a reduction's input was cast from, through any Casts: squares narrowed before
    the sum (``Pow -> Cast(float16) -> ReduceMean``) still make a norm, one that sums in float16."""
    for _ in range(4):
        src = graph.producers.get(summed)
        if src is None or src.op_type not in ("Cast", "CastLike") or not src.input:
            break
        summed = src.input[0]
    return summed


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


def _follow_denominator(start: str, graph: GraphView) -> _Tail:
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
    x: str, squared_input: str, denominator: str, reciprocal: bool, graph: GraphView
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
            narrowed |= DTYPE_WIDTH.get(graph.dtype(nxt.output[0]), 64) < DTYPE_WIDTH.get(graph.dtype(current), 0)
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
    axes = attribute(node, "axes", None, "ints")
    if axes is not None:
        return [int(a) for a in axes]
    if len(node.input) > 1 and node.input[1] in consts:
        return [int(a) for a in np.atleast_1d(consts[node.input[1]])]
    return None
