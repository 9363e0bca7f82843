"""Where each norm stands in the computation: the placement half of the contract.

Long: the placement rules and both readers of them (the op graph's rules, the ONNX side) must agree, so they sit together.

A checkpoint trained with pre-norm blocks ``x + f(norm(x))`` is not a post-norm model
``norm(x + f(x))``: the formula of each norm is half of the contract, its position in the graph
is the other half. This module classifies each norm's position on a small *op graph* (values,
and ops that read and write them), written once and built from two sources: an ONNX graph
(:func:`graph_placements`, here) and a PyTorch module run eagerly (``exporter/placement.py``).
Export compares the two per norm and refuses a mismatch; the audit reports the ONNX side for any
graph.

The op graph
------------
Each op has a kind: ``norm`` (a whole normalization, its internal nodes collapsed), ``add``,
``matmul`` (``MatMul``/``Gemm``/``Einsum``, ``F.linear``/``torch.matmul``), ``softmax``,
``attention`` (a fused attention op; which inputs are its queries and keys), ``cast``
(``Cast``/``CastLike``/``Identity``, ``Tensor.to``: the same value in another dtype), ``scale``
(``Mul``/``Div``, ``*``/``/``: with one activation operand, a constant scaling), ``shape``
(``Shape``/``Size``: metadata, not data; nothing flows through it) or ``op`` (anything else:
reshapes, transposes, rotary arithmetic, activations, slices...).

A value is an *activation* when it derives from a graph input (not through ``shape``);
everything else (weights, rotary caches from positions, masks from shapes) is constant. A
``matmul`` with one activation operand applies a weight (a projection, the LM head); with two
it is an activation product (``Q·Kᵀ``, ``P·V``). A *residual add* is an ``add`` of two
activations one of which derives from the other (``x + f(x)``); the rotary ``q·cos + rot(q)·sin``
is not one (neither term derives from the other). Casts are seen through everywhere: a value
and its casts are one value.

The rules (first match wins), for a norm with input ``x`` and output ``y``
--------------------------------------------------------------------------
``qk``
    ``y`` reaches, without applying a weight (no weight ``matmul``, no other norm), the query
    or key side of attention: an activation product whose result reaches a ``softmax`` through
    scaling, masking and casts, or the query/key input of a fused attention op. Reshapes,
    transposes and the rotary arithmetic are passed through. Per head (Qwen3, Gemma3) or over
    all heads (OLMo2) alike.
``final``
    ``y`` reaches a graph output through at most one weight ``matmul`` (the LM head) and no
    residual add, activation product, attention or other norm (the last norm of a model
    without a head counts too). A KV cache's ``present.*`` outputs do not count.
``pre``
    ``x`` also bypasses the norm into a residual add whose other operand derives from ``y``:
    ``x + f(norm(x))``.
``sublayer_output``
    ``y`` is an operand of a residual add whose other operand is upstream of ``x``:
    ``x + norm(f(x))`` (OLMo2; the post-norms of Gemma2/3), also through a constant scaling of
    ``y`` (``x + norm(f(x)) * α``, HyperCLOVA X's residual multiplier, which an optimizer may
    fold away when ``α`` is 1).
``post``
    ``x`` is a residual sum and ``y`` is the new residual stream: ``y`` bypasses into a later
    residual add whose other operand derives from ``y`` (``norm(x + f(x))``). The last
    post-norm of a stack feeds the LM head and is ``final``.
``other``
    anything else (e.g. a norm of the values).

ONNX Runtime's fused ``SkipSimplifiedLayerNormalization`` (and ``SkipLayerNormalization``)
computes ``norm(input + skip [+ bias])``: it becomes an ``add`` (its ``input_skip_bias_sum``
output, when the graph uses it, is the residual stream) followed by a ``norm``. A norm whose
boundary the audit cannot trace (a decomposed LayerNorm) has no placement (``""``).

:func:`mean_subtracting_findings` is the audit's other contract check: a mean-subtracting
normalization (LayerNorm) standing where the source has an RMS norm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_reading import inline_for_analysis
from rmsnorm_deploy.graph.reductions import Reduction

PLACEMENTS: tuple[str, ...] = ("pre", "post", "sublayer_output", "qk", "final", "other")
#: a KV-cache graph's ``present.{i}.key/value`` outputs: a key or value projection of a normalized
#: value reaches them through one weight matmul, which does not make that norm the final one
KV_CACHE_OUTPUT_PREFIX = "present"
KINDS = ("norm", "add", "matmul", "softmax", "attention", "cast", "scale", "shape", "op")


@dataclasses.dataclass
class Op:
    """One op of the op graph: its kind, the values it reads and writes, and (norms) its name."""

    kind: str
    inputs: list[str]
    outputs: list[str]
    name: str = ""
    #: for ``attention``: the indices of ``inputs`` that are queries and keys
    qk_inputs: tuple[int, ...] = ()


@dataclasses.dataclass
class OpGraph:
    ops: list[Op]
    inputs: set[str]
    outputs: set[str]


class Placer:
    """The rules of the module docstring, evaluated on one :class:`OpGraph`."""

    def __init__(self, graph: OpGraph):
        self.graph = graph
        self.consumers: dict[str, list[Op]] = {}
        self.producer: dict[str, Op] = {}
        for op in graph.ops:
            for i in op.inputs:
                self.consumers.setdefault(i, []).append(op)
            for o in op.outputs:
                self.producer[o] = op
        self.root: dict[str, str] = {}
        for op in graph.ops:  # topological order: a cast's input has its root already
            if op.kind == "cast" and op.inputs:
                for o in op.outputs:
                    self.root[o] = self.root.get(op.inputs[0], op.inputs[0])
        self.activation: set[str] = set(graph.inputs)
        for op in graph.ops:
            if op.kind != "shape" and any(i in self.activation for i in op.inputs):
                self.activation.update(op.outputs)
        self._reach: dict[str, set[str]] = {}

    # -- helpers ----------------------------------------------------------------------------
    def same(self, a: str) -> str:
        return self.root.get(a, a)

    def aliases(self, value: str) -> list[str]:
        """``value`` and every cast of it (downstream, transitively)."""
        out, stack = [], [value]
        while stack:
            v = stack.pop()
            out.append(v)
            stack += [o for op in self.consumers.get(v, []) if op.kind == "cast" for o in op.outputs]
        return out

    def constant_scalings(self, value: str) -> list[str]:
        """``value`` and what chains of constant scalings (``scale`` ops with one activation operand)
        make of it: ``y * α`` stands where ``y`` stands."""
        out, stack = [], [value]
        while stack:
            v = stack.pop()
            out.append(v)
            stack += [o for op in self.consumers.get(v, []) if op.kind == "scale"
                      and sum(i in self.activation for i in op.inputs) == 1 for o in op.outputs]
        return out

    def reachable(self, value: str) -> set[str]:
        """Every value derived from ``value`` or the value it is a cast of (not through ``shape``)."""
        value = self.same(value)
        if value not in self._reach:
            seen, stack = {value}, [value]
            while stack:
                for op in self.consumers.get(stack.pop(), []):
                    if op.kind == "shape":
                        continue
                    for o in op.outputs:
                        if o not in seen:
                            seen.add(o)
                            stack.append(o)
            self._reach[value] = seen
        return self._reach[value]

    def is_weight_matmul(self, op: Op) -> bool:
        return op.kind == "matmul" and sum(i in self.activation for i in op.inputs[:2]) == 1

    def is_activation_product(self, op: Op) -> bool:
        return op.kind == "matmul" and all(i in self.activation for i in op.inputs[:2])

    def residual_operands(self, op: Op) -> tuple[str, str] | None:
        """``(upstream, downstream)`` operands of a residual add, or ``None``."""
        if op.kind != "add" or len(op.inputs) < 2:
            return None
        a, b = op.inputs[0], op.inputs[1]
        if a not in self.activation or b not in self.activation or self.same(a) == self.same(b):
            return None
        if b in self.reachable(a):
            return a, b
        if a in self.reachable(b):
            return b, a
        return None

    def residual_adds_of(self, value: str) -> list[tuple[Op, str, str]]:
        """Residual adds with ``value`` (or a cast of it) as an operand: (op, this operand, the other)."""
        found = []
        for alias in self.aliases(self.same(value)):
            for op in self.consumers.get(alias, []):
                pair = self.residual_operands(op)
                if pair is not None and alias in pair:
                    other = pair[1] if pair[0] == alias else pair[0]
                    found.append((op, alias, other))
        return found

    # -- the rules --------------------------------------------------------------------------
    def place(self, norm: Op) -> str:
        x, y = norm.inputs[0], norm.outputs[0]
        if self._feeds_query_or_key(y):
            return "qk"
        if self._feeds_output(y):
            return "final"
        for _, _, other in self.residual_adds_of(x):
            if other in self.reachable(y):
                return "pre"
        for scaled in self.constant_scalings(y):
            for _, _, other in self.residual_adds_of(scaled):
                if self.same(x) in self.reachable(other) or x in self.reachable(other):
                    return "sublayer_output"
        if self._is_residual_sum(x):
            for _, mine, other in self.residual_adds_of(y):
                if other in self.reachable(mine):
                    return "post"
        return "other"

    def _is_residual_sum(self, value: str) -> bool:
        op = self.producer.get(self.same(value))
        return op is not None and self.residual_operands(op) is not None

    def _feeds_query_or_key(self, y: str) -> bool:
        seen, stack = {y}, [y]
        while stack:
            v = stack.pop()
            for op in self.consumers.get(v, []):
                if op.kind in ("norm", "shape", "softmax") or self.is_weight_matmul(op):
                    continue
                if op.kind == "attention":
                    if any(op.inputs[i] == v for i in op.qk_inputs if i < len(op.inputs)):
                        return True
                    continue
                if self.is_activation_product(op):
                    if self._reaches_softmax(op.outputs[0]):
                        return True
                    continue
                for o in op.outputs:
                    if o not in seen:
                        seen.add(o)
                        stack.append(o)
        return False

    def _reaches_softmax(self, scores: str, depth: int = 8) -> bool:
        frontier = [scores]
        for _ in range(depth):
            nxt = []
            for v in frontier:
                for op in self.consumers.get(v, []):
                    if op.kind == "softmax":
                        return True
                    if op.kind in ("op", "cast", "scale", "add"):
                        nxt += op.outputs
            frontier = nxt
        return False

    def _feeds_output(self, y: str) -> bool:
        seen, stack = {(y, 0)}, [(y, 0)]
        while stack:
            v, matmuls = stack.pop()
            if v in self.graph.outputs and not v.startswith(KV_CACHE_OUTPUT_PREFIX):
                return True
            for op in self.consumers.get(v, []):
                if op.kind in ("norm", "shape", "attention") or self.is_activation_product(op):
                    continue
                if op.kind == "add" and self.residual_operands(op) is not None:
                    continue
                count = matmuls + (1 if self.is_weight_matmul(op) else 0)
                if count > 1:
                    continue
                for o in op.outputs:
                    if (o, count) not in seen:
                        seen.add((o, count))
                        stack.append((o, count))
        return False


def place_norms(graph: OpGraph) -> dict[str, str]:
    """``{norm op name: placement}`` for every ``norm`` op of ``graph``."""
    placer = Placer(graph)
    return {op.name: placer.place(op) for op in graph.ops if op.kind == "norm"}


# -- the ONNX side ----------------------------------------------------------------------------
_ONNX_KINDS = {
    "Add": "add", "Sum": "add",
    "MatMul": "matmul", "Gemm": "matmul", "Einsum": "matmul", "FusedMatMul": "matmul", "MatMulNBits": "matmul",
    "MatMulInteger": "matmul",
    "Softmax": "softmax", "LogSoftmax": "softmax",
    "Cast": "cast", "CastLike": "cast", "Identity": "cast", "Mul": "scale", "Div": "scale",
    "Shape": "shape", "Size": "shape",
    # ONNX Runtime's packed Attention projects its input with its own weights first.
    "Attention@com.microsoft": "matmul",
    "FusedMatMul@com.microsoft": "matmul", "MatMulNBits@com.microsoft": "matmul",
    "MatMulIntegerToFloat@com.microsoft": "matmul",
}
#: fused attention ops and the inputs that are queries and keys
_ATTENTION = {
    ("Attention", ""): (0, 1), ("Attention", "ai.onnx"): (0, 1),
    ("MultiHeadAttention", "com.microsoft"): (0, 1), ("GroupQueryAttention", "com.microsoft"): (0, 1),
    ("SparseAttention", "com.microsoft"): (0, 1), ("PagedAttention", "com.microsoft"): (0, 1),
}


def onnx_op_graph(model: onnx.ModelProto, reductions: Iterable[Reduction],
                  names: dict[str, str] | None = None) -> tuple[OpGraph, dict[str, Reduction]]:
    """The op graph of ``model`` (functions inlined) with each traced reduction collapsed to a ``norm``.

    ``names``: ``{norm output tensor: name}`` for the norms (export passes each node's module
    path, which survives every lowering as the output tensor's producer); by default the
    reduction's node label. Returns the graph and ``{norm name: reduction}``.
    """
    inlined = inline_for_analysis(model) if model.functions else model
    nodes = list(inlined.graph.node)
    producers = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for inp in n.input:
            consumers.setdefault(inp, []).append(i)
    names = names or {}
    removed: set[int] = set()
    norms: dict[int, list[Op]] = {}  # index of the op the norm replaces -> ops to put there
    by_name: dict[str, Reduction] = {}
    for red in reductions:
        t = red.tensors
        if t is None or not t.inputs or t.output not in producers:
            continue
        name = names.get(t.output, red.node)
        if name in by_name:
            name = f"{name}@{t.output}"
        by_name[name] = red
        internal = _internal_nodes(nodes, producers, consumers, t.inputs, t.output)
        removed |= internal
        ops: list[Op] = []
        x = t.inputs[0]
        if len(t.inputs) > 1:  # the Skip ops' residual add (and bias), fused into the norm
            x = t.sum_output or f"{t.output}#sum"
            if len(t.inputs) > 2:
                ops.append(Op("add", list(t.inputs[:2]), [f"{x}#unbiased"]))
                ops.append(Op("add", [f"{x}#unbiased", t.inputs[2]], [x]))
            else:
                ops.append(Op("add", list(t.inputs[:2]), [x]))
        ops.append(Op("norm", [x], [t.output], name=name))
        norms[max(internal | {producers[t.output]})] = ops
    ops: list[Op] = []
    for i, node in enumerate(nodes):
        if i in norms:
            ops += norms[i]
        if i in removed:
            continue
        ops.append(_onnx_op(node))
    initializers = {t.name for t in inlined.graph.initializer}
    inputs = {vi.name for vi in inlined.graph.input if vi.name not in initializers}
    return OpGraph(ops, inputs, {vi.name for vi in inlined.graph.output}), by_name


def _onnx_op(node: onnx.NodeProto) -> Op:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    if (node.op_type, domain) in _ATTENTION:
        return Op("attention", list(node.input), list(node.output), qk_inputs=_ATTENTION[(node.op_type, domain)])
    kind = _ONNX_KINDS.get(f"{node.op_type}@{domain}" if domain else node.op_type, "op")
    inputs = list(node.input) if kind != "matmul" or node.op_type != "Gemm" else list(node.input[:2])
    return Op(kind, [i for i in inputs if i], [o for o in node.output if o], name=node.name)


def _internal_nodes(nodes: list[onnx.NodeProto], producers: dict[str, int], consumers: dict[str, list[int]],
                    inputs: list[str], output: str) -> set[int]:
    """Indices of the nodes on a path from the norm's inputs to its output (its own nodes)."""
    start = set(inputs)
    back: set[int] = set()
    stack = [output]
    seen = set(stack)
    while stack:
        v = stack.pop()
        if v in start or v not in producers:
            continue
        i = producers[v]
        if i not in back:
            back.add(i)
            for inp in nodes[i].input:
                if inp and inp not in seen:
                    seen.add(inp)
                    stack.append(inp)
    internal: set[int] = set()
    stack = list(start)
    seen = set(stack)
    while stack:
        v = stack.pop()
        for i in consumers.get(v, []):
            if i in back and i not in internal:
                internal.add(i)
                for o in nodes[i].output:
                    if o not in seen:
                        seen.add(o)
                        stack.append(o)
    return internal


def graph_placements(model: onnx.ModelProto, reductions: list[Reduction] | None = None, *,
                     names: dict[str, str] | None = None) -> dict[str, str]:
    """``{norm name: placement}`` for every norm of ``model`` whose boundary the audit traces."""
    if reductions is None:
        reductions = audit_model(model)
    graph, _ = onnx_op_graph(model, reductions, names)
    return place_norms(graph)


def assign_placements(model: onnx.ModelProto, reductions: list[Reduction]) -> None:
    """Set ``placement`` on each reduction of ``model`` (``""`` where its boundary is not traced)."""
    graph, by_name = onnx_op_graph(model, reductions)
    placed = place_norms(graph)
    for name, red in by_name.items():
        red.placement = placed.get(name, "")


# -- the audit's mean-subtraction check -------------------------------------------------------------
@dataclasses.dataclass
class Finding:
    """A contract finding of the audit: ``error`` fails it (exit 1), ``warning`` is reported."""

    level: str  # "error" or "warning"
    norm: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def mean_subtracting_findings(model: onnx.ModelProto, reductions: list[Reduction], rms_norms: Iterable[str] | None,
                              *, base_dir: str | Path | None = None) -> list[Finding]:
    """LayerNorms standing where the source has an RMS norm (RMSNorm is not LayerNorm).

    ``rms_norms``: the norm names our metadata lists (``None`` for a third party's graph).
    For our exports a LayerNorm named as one of them, or any LayerNorm while fewer RMSNorm
    reductions than listed norms remain, is an error. For any graph, a ``LayerNormalization``
    whose bias is absent or all zeros is a warning: it equals an RMS norm only where the
    mean of its input is zero, so it may be an RMSNorm swapped for a LayerNorm module.
    """
    findings: list[Finding] = []
    layer_norms = [r for r in reductions if r.kind.startswith("LayerNorm")]
    if rms_norms is not None:
        expected = set(rms_norms)
        bases = {n.split("#")[0] for n in expected}
        rms_count = sum(r.kind.startswith("RMSNorm") for r in reductions)
        for red in layer_norms:
            if red.node in expected or red.node.split("#")[0] in bases or rms_count < len(expected):
                findings.append(Finding("error", red.node, (
                    f"{red.op} subtracts the mean where the model's metadata says RMSNorm; RMSNorm is not "
                    "LayerNorm: a model trained with one cannot be run with the other")))
    if not layer_norms:
        return findings
    flagged = {f.norm for f in findings}
    inits = {t.name: t for t in model.graph.initializer}
    nodes = {(n.name or n.output[0]): n for n in model.graph.node}
    for red in layer_norms:
        node = nodes.get(red.node)
        if red.node in flagged or node is None or node.op_type not in ("LayerNormalization", "SkipLayerNormalization"):
            continue
        bias_index = 2 if node.op_type == "LayerNormalization" else 3
        bias = node.input[bias_index] if len(node.input) > bias_index else ""
        zero = True if not bias else _all_zero(inits.get(bias), base_dir)
        if zero:
            what = "has no bias" if not bias else f"has an all-zero bias ({bias})"
            findings.append(Finding("warning", red.node, (
                f"{node.op_type} {what}: it may be a substituted RMSNorm, which it equals only where the mean "
                "of its input is zero")))
    return findings


def name_norms(reductions: list[Reduction], metadata: ModelMetadata | None) -> list[Reduction]:
    """``reductions``, each named (its ``node`` set) by the module path our metadata's placements
    give its output tensor (a second call of one module is ``path#2``; also in the ``inline``
    lowering, where no node is left to name it); the others keep their node's name."""
    by_output = {v["output"]: k for k, v in (metadata.placements if metadata is not None else {}).items()}
    for red in reductions:
        name = by_output.get(red.tensors.output) if red.tensors is not None else None
        if name is not None:
            red.node = name
    return reductions


def contract_findings(model: onnx.ModelProto, reductions: list[Reduction], metadata: ModelMetadata | None,
                      *, base_dir: str | Path | None = None) -> list[Finding]:
    """Place each norm of ``model`` (as written) and check it against what its metadata records.

    Sets ``placement`` on the reductions; for our exports names each norm by its module path
    (also in the ``inline`` lowering, where the node is gone: its output tensor names it) and
    makes an error of each norm the graph places other than the source model did, or that the
    graph lacks. Adds :func:`mean_subtracting_findings`.
    """
    assign_placements(model, reductions)
    findings: list[Finding] = []
    if metadata is not None and metadata.placements:
        seen = set()
        for red in name_norms(reductions, metadata):
            name = red.node
            if name not in metadata.placements:
                continue
            seen.add(name)
            want = metadata.placements[name]["placement"]
            if red.placement != want:
                findings.append(Finding("error", name, (
                    f"the graph places it {red.placement or 'nowhere'!r}, the source model {want!r}: the graph does "
                    "not compute the model's architecture")))
        for name in metadata.placements:
            if name not in seen and not any(f.norm == name for f in findings):
                findings.append(Finding("error", name, "the source model calls this norm here, the graph has no "
                                        f"norm writing {metadata.placements[name]['output']!r}"))
    rms_norms = None if metadata is None else list(metadata.placements or metadata.specs)
    return findings + mean_subtracting_findings(model, reductions, rms_norms, base_dir=base_dir)


def _all_zero(tensor: onnx.TensorProto | None, base_dir: str | Path | None) -> bool:
    if tensor is None:
        return False
    try:
        value = numpy_helper.to_array(tensor, base_dir=str(base_dir) if base_dir else "")
    except (OSError, ValueError, TypeError, onnx.checker.ValidationError):  # data not found: unknown, not flagged
        return False
    return bool(np.all(value == 0))
