"""Where does each normalization reduction of a graph run, and in which dtype?

Works on any ONNX graph, ours or a third party's: it finds

* fused ops: ``RMSNormalization``, ``SimplifiedLayerNormalization``,
  ``SkipSimplifiedLayerNormalization``, ``LayerNormalization``, ``SkipLayerNormalization``;
* our ``rmsnorm_deploy::RMSNorm`` function nodes (their bodies are inlined and read);
* decomposed chains: ``Pow(t, 2)`` or ``Mul(t, t)`` into ``ReduceMean``, ``ReduceSumSquare``
  and ``ReduceL2``, followed by the ``Add(eps)``/``Sqrt`` that make it a norm.

For each it reports the dtype the reduction accumulates in, epsilon and axes. A reduction
that accumulates in float16 or bfloat16 is a finding: the sum of squares overflows float16
at |x| > 256 and loses precision long before.

:func:`audit_after_onnxruntime` runs the same audit on the graph ONNX Runtime actually
executes (``optimized_model_filepath``), after its fusions.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import onnx
import onnx.inliner
from onnx import numpy_helper

from rmsnorm_deploy.dtypes import dtype_name
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.onnx_function import is_rmsnorm_node, spec_from_node

LOW_PRECISION = ("float16", "bfloat16")
_FUSED_OPS = {
    "RMSNormalization": "RMSNorm",
    "SimplifiedLayerNormalization": "RMSNorm",
    "SkipSimplifiedLayerNormalization": "RMSNorm (skip)",
    "LayerNormalization": "LayerNorm",
    "SkipLayerNormalization": "LayerNorm (skip)",
}


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

    @property
    def low_precision(self) -> bool:
        return self.accumulation in LOW_PRECISION

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["low_precision"] = self.low_precision
        return data


def audit_model(model: onnx.ModelProto, *, stage: str = "as written") -> list[Reduction]:
    """Every normalization reduction of ``model`` with the dtype it accumulates in."""
    found: list[Reduction] = []
    ours = {}
    for node in model.graph.node:
        if is_rmsnorm_node(node):
            try:
                ours[node.output[0]] = spec_from_node(node).to_dict()
            except UserError:
                ours[node.output[0]] = None
    inlined = _inline_for_analysis(model)
    types = _value_types(inlined)
    consts = _constants(inlined)
    producers = {out: n for n in inlined.graph.node for out in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in inlined.graph.node:
        for inp in n.input:
            consumers.setdefault(inp, []).append(n)
    for node in inlined.graph.node:
        if node.op_type in _FUSED_OPS and node.domain in ("", "ai.onnx", "com.microsoft"):
            found.append(_fused(node, types, stage))
        elif node.op_type in ("ReduceMean", "ReduceSumSquare", "ReduceL2") and node.domain in ("", "ai.onnx"):
            red = _decomposed(node, types, consts, producers, consumers, stage)
            if red is not None:
                found.append(red)
    # Tie each chain to the rmsnorm_deploy node it came from (the inliner keeps the output name).
    for red in found:
        for out, spec in ours.items():
            if red.note.endswith(f"-> {out}") or red.node == out:
                red.spec = spec
    return found


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


def _value_types(model: onnx.ModelProto) -> dict[str, str]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:
        inferred = model
    types: dict[str, str] = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        elem = vi.type.tensor_type.elem_type
        if elem:
            types[vi.name] = _safe_dtype(elem)
    for init in g.initializer:
        types[init.name] = _safe_dtype(init.data_type)
    for node in g.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = _safe_dtype(attr.t.data_type)
                elif attr.name in ("value_float", "value_floats"):
                    types[node.output[0]] = "float32"
    _propagate_types(g, types)
    return types


def _propagate_types(g: onnx.GraphProto, types: dict[str, str]) -> None:
    """Fill types that shape inference left out (ops it has no schema for), in node order."""
    same_as_first = {"Pow", "Mul", "Add", "Sub", "Div", "Sqrt", "ReduceMean", "ReduceSumSquare", "ReduceL2",
                     "Reciprocal", "Neg", "Abs", "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze",
                     "Expand", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                     "LayerNormalization", "RMSNormalization", "SkipLayerNormalization"}
    for node in g.node:
        if not node.output or node.output[0] in types:
            continue
        if node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to":
                    types[node.output[0]] = _safe_dtype(attr.i)
        elif node.op_type == "CastLike" and len(node.input) > 1 and node.input[1] in types:
            types[node.output[0]] = types[node.input[1]]
        elif node.op_type in same_as_first and node.input and node.input[0] in types:
            src = node.input[1] if node.op_type in ("SimplifiedLayerNormalization",) and len(node.input) > 1 else node.input[0]
            types[node.output[0]] = types.get(src, types[node.input[0]])


def _safe_dtype(elem: int) -> str:
    try:
        return dtype_name(elem)
    except UserError:
        return onnx.TensorProto.DataType.Name(elem).lower()


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
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
                if attr.name == "value":
                    consts[node.output[0]] = numpy_helper.to_array(attr.t)
                elif attr.name == "value_float":
                    consts[node.output[0]] = np.array(attr.f, dtype=np.float32)
                elif attr.name == "value_floats":
                    consts[node.output[0]] = np.array(list(attr.floats), dtype=np.float32)
                elif attr.name == "value_ints":
                    consts[node.output[0]] = np.array(list(attr.ints), dtype=np.int64)
                elif attr.name == "value_int":
                    consts[node.output[0]] = np.array(attr.i, dtype=np.int64)
        elif node.op_type in ("Cast", "CastLike", "Identity") and node.input and node.input[0] in consts:
            # a constant that is only converted stays a constant (e.g. epsilon widened to float64)
            consts[node.output[0]] = consts[node.input[0]]
    return consts


def _numel(t: onnx.TensorProto) -> int:
    return int(np.prod(t.dims)) if t.dims else 1


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _label(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if node.output else node.op_type)


def _fused(node: onnx.NodeProto, types: dict[str, str], stage: str) -> Reduction:
    in_dtype = types.get(node.input[0], "unknown")
    eps_default = 1e-12 if node.op_type == "SkipSimplifiedLayerNormalization" else 1e-5
    eps = _attr(node, "epsilon", eps_default)
    axis = _attr(node, "axis", -1)
    note = ""
    if node.op_type == "SkipSimplifiedLayerNormalization":
        # No stash_type: ORT's CPU kernel widens to float32, its CUDA kernel (non-strict mode,
        # the default) accumulates in the input dtype (onnxruntime issue 29034).
        acc = "float32" if in_dtype not in LOW_PRECISION else in_dtype
        note = "no stash_type: ORT CUDA's default kernel accumulates in the input dtype"
        if _attr(node, "epsilon") is None:
            note += "; epsilon unset, ORT's default is 1e-12"
    elif node.op_type == "SkipLayerNormalization":
        acc = "float32" if in_dtype not in LOW_PRECISION else in_dtype
        note = "no stash_type: ORT CUDA's kernel may accumulate in the input dtype"
    else:
        stash = _attr(node, "stash_type", 1)
        acc = _safe_dtype(stash)
    return Reduction(stage, _label(node), _FUSED_OPS[node.op_type], node.op_type, in_dtype, acc,
                     float(eps) if eps is not None else None, [int(axis)], note)


def _decomposed(
    node: onnx.NodeProto,
    types: dict[str, str],
    consts: dict[str, np.ndarray],
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
    stage: str,
) -> Reduction | None:
    chain = [node.op_type]
    if node.op_type == "ReduceMean":
        src = producers.get(node.input[0])
        if src is None or not _is_square(src, consts):
            return None
        chain.insert(0, src.op_type)
        squared_input = src.input[0]
        acc = types.get(node.input[0]) or types.get(squared_input, "unknown")
    else:  # ReduceSumSquare / ReduceL2 square and sum in their input dtype
        squared_input = node.input[0]
        acc = types.get(squared_input, "unknown")
    kind = "RMSNorm"
    centered = producers.get(squared_input)
    if centered is not None and centered.op_type == "Sub":
        mean = producers.get(centered.input[1])
        if mean is not None and mean.op_type == "ReduceMean":
            kind = "LayerNorm"
    eps, tail = _follow_epsilon(node.output[0], consts, consumers)
    if eps is None and not tail:
        return None  # a bare mean of squares (e.g. a loss), not a normalization
    chain += tail
    axes = _reduce_axes(node, consts)
    in_dtype = types.get(squared_input, "unknown")
    x_src = producers.get(squared_input)
    if x_src is not None and x_src.op_type in ("Cast", "CastLike") and x_src.input:
        in_dtype = types.get(x_src.input[0], in_dtype)
    out = _norm_output(node.output[0], consumers)
    return Reduction(stage, _label(node), kind, ">".join(chain), in_dtype, acc, eps, axes, note=f"-> {out}" if out else "")


def _is_square(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> bool:
    if node.op_type == "Pow" and len(node.input) == 2 and node.input[1] in consts:
        return bool(np.all(consts[node.input[1]] == 2))
    return node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]


def _follow_epsilon(start: str, consts: dict[str, np.ndarray], consumers: dict[str, list[onnx.NodeProto]]) -> tuple[float | None, list[str]]:
    """Walk ``Add(eps)`` and ``Sqrt`` after the reduction (either order); return epsilon and the ops seen."""
    eps, tail, current = None, [], start
    for _ in range(3):
        nexts = consumers.get(current, [])
        if len(nexts) != 1:
            break
        nxt = nexts[0]
        if nxt.op_type == "Add":
            other = nxt.input[1] if nxt.input[0] == current else nxt.input[0]
            if other in consts and consts[other].size == 1:
                eps = float(consts[other].reshape(-1)[0])
        elif nxt.op_type not in ("Sqrt", "Reciprocal"):
            break
        tail.append(nxt.op_type)
        current = nxt.output[0]
    return eps, tail


def _norm_output(start: str, consumers: dict[str, list[onnx.NodeProto]]) -> str:
    """The last output of the elementwise chain after the reduction (where the norm's value leaves)."""
    current = start
    for _ in range(12):
        nexts = consumers.get(current, [])
        if len(nexts) != 1 or nexts[0].op_type not in ("Add", "Sqrt", "Reciprocal", "Div", "Mul", "Cast", "CastLike"):
            break
        current = nexts[0].output[0]
    return current


def _reduce_axes(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> list[int] | None:
    axes = _attr(node, "axes")
    if axes is not None:
        return [int(a) for a in axes]
    if len(node.input) > 1 and node.input[1] in consts:
        return [int(a) for a in np.atleast_1d(consts[node.input[1]])]
    return None


def audit_after_onnxruntime(
    model: onnx.ModelProto | str | os.PathLike, *, optimization: str = "all", providers: Iterable[str] = ("cpu",)
) -> list[Reduction]:
    """Audit the graph ONNX Runtime runs: the model after its graph optimizations."""
    from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner

    with tempfile.TemporaryDirectory(prefix="rmsnorm-audit-") as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        with OnnxRuntimeRunner(model, list(providers), optimization=optimization, optimized_model_path=optimized):
            pass
        result = onnx.load(str(optimized), load_external_data=False)
    return audit_model(result, stage=f"after onnxruntime ({optimization})")


def low_precision_reductions(reductions: Iterable[Reduction]) -> list[Reduction]:
    return [r for r in reductions if r.low_precision]
