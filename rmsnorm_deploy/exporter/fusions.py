"""Attention and rotary-embedding fusions: the ``--fuse-attention`` export (opset 23).

At opset 23 ``torch.onnx`` already writes ``scaled_dot_product_attention`` as ONNX's
``Attention`` op, but it leaves the rotary embeddings as ``x * cos + rotate_half(x) * sin``
(a dozen elementwise ops per query and key) and feeds ``Attention`` key and value heads that
were first copied once per query head (``repeat_kv`` / ``repeat_interleave``). Two rules, in
the onnxscript rewriter's pattern / check / rewrite style, turn them into what ONNX
Runtime's kernels run in one pass:

* :class:`RotaryFusion`: ``x * cos + rotate_half(x) * sin`` -> ``RotaryEmbedding(x, cos_cache,
  sin_cache)``. The caches are the half-width angles ``[batch, seq, head_dim / 2]``, expanded
  to the batch of ``x``: without position ids ONNX Runtime requires the caches' batch to be
  the input's. (torch.onnx's own opset-23 fusion passes ``[1, seq, head_dim / 2]``, which is
  why its graphs run at batch 1 and fail at batch 2.) The check proves the caches are halves
  of ``cos``/``sin``: both must come from ``Cos``/``Sin`` of ``Concat(f, f)`` of the same
  angles ``f``, through only a scalar ``Mul``, a ``Cast`` and an ``Unsqueeze`` over the head axis.
* :class:`SharedKVAttention`: ``Attention(q, repeat(k), repeat(v))`` -> ``Attention(q, k, v)``:
  ``Attention`` takes fewer key/value heads than query heads and shares each among a group
  of query heads, exactly as ``repeat_kv`` and ``repeat_interleave`` copy them.
* :func:`attention_with_cache` (KV-cache graphs): ``Attention(q, Concat(past_k, k), ...)`` ->
  ``Attention(q, k, v, mask, past_k, past_v)`` whose ``present_key``/``present_value`` outputs
  are the graph's ``present.{i}.*``: the cache update moves into the attention op.

Neither rule matches a norm, and :func:`fuse_attention` runs while every norm is still one
opaque ``rmsnorm_deploy::RMSNorm`` node (it checks that their number is unchanged), so no
norm can become ``SimplifiedLayerNormalization`` or ``SkipSimplifiedLayerNormalization``
here. Both ops are standard ONNX: ONNX Runtime runs them, and TensorRT's parser imports
``Attention`` from 10.14 and ``RotaryEmbedding`` from 10.15 (``rmsnorm-deploy check-trt``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from onnxscript.rewriter import pattern

from rmsnorm_deploy.errors import UserError

#: The opset the fused graph needs: ``Attention`` and ``RotaryEmbedding`` are opset-23 ops.
FUSED_OPSET = 23


class FusionError(UserError):
    """A ``--fuse-attention`` export whose graph has no attention to fuse, or bad options."""


@dataclasses.dataclass
class FusionCounts:
    """What :func:`fuse_attention` found and wrote (the export report keeps it)."""

    attention: int = 0  # Attention nodes in the graph after fusion
    shared_kv: int = 0  # of which take key/value heads shared among query heads
    rotary: int = 0  # RotaryEmbedding nodes written
    decomposed_rotary: int = 0  # rotate_half patterns left as they were (not provably rotary)
    with_cache: int = 0  # Attention nodes taking the KV cache as past_key/past_value (--kv-cache)

    def describe(self) -> str:
        text = (f"{self.attention} Attention ({self.shared_kv} on shared key/value heads"
                + (f", {self.with_cache} with past/present" if self.with_cache else "")
                + f"), {self.rotary} RotaryEmbedding")
        if self.decomposed_rotary:
            text += f"; {self.decomposed_rotary} rotary embedding(s) left decomposed"
        return text

    def to_dict(self) -> dict[str, int]:
        d = dataclasses.asdict(self)
        if not d["with_cache"]:  # only KV-cache graphs have attention with past/present
            del d["with_cache"]
        return d


def check_fusion_opset(opset: int) -> None:
    if opset != FUSED_OPSET:
        raise FusionError(f"--fuse-attention writes ONNX Attention and RotaryEmbedding, opset-{FUSED_OPSET} ops; "
                          f"this export asks for opset {opset} (leave --opset out or give --opset {FUSED_OPSET})")


# -- helpers over onnx_ir values ------------------------------------------------------------
def _const_ints(value: Any) -> list[int] | None:
    if value is None or value.const_value is None:
        return None
    try:
        return [int(v) for v in value.const_value.numpy().reshape(-1)]
    except (TypeError, ValueError):
        return None


def _scalar(value: Any) -> float | None:
    if value is None or value.const_value is None or value.const_value.size != 1:
        return None
    return float(value.const_value.numpy().reshape(-1)[0])


def _static(dim: Any) -> int | None:
    return dim if isinstance(dim, int) else None


def _same_dim(a: Any, b: Any) -> bool:
    """Two dims known to be equal: the same integer, or the same named symbol."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    name_a, name_b = getattr(a, "value", None), getattr(b, "value", None)
    return name_a is not None and name_a == name_b


@dataclasses.dataclass(frozen=True)
class _AngleChain:
    """How a full-width cos (or sin) table was computed from half-width angles ``freqs``:
    ``Cos``/``Sin`` of ``Concat(freqs, freqs)``, then elementwise ``steps`` (a scalar ``Mul``,
    a ``Cast``; innermost first) and at most one ``Unsqueeze`` over the head axis."""

    function: str  # "Cos" or "Sin"
    freqs: Any  # ir.Value, [..., seq, head_dim / 2]
    steps: tuple[tuple[str, Any], ...]  # ("mul", scale) / ("cast", dtype), innermost first
    head_axis_unsqueezed: bool


def _angle_chain(value: Any) -> tuple[_AngleChain | None, str]:
    """Trace ``value`` back to ``Cos``/``Sin`` of ``Concat(f, f)`` (or say why not)."""
    steps: list[tuple[str, Any]] = []  # outermost first while walking
    unsqueezed = False
    node = value.producer()
    for _ in range(5):
        if node is None:
            return None, "the table is not computed in the graph"
        if node.op_type == "Unsqueeze" and not unsqueezed:
            axes = _const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
            if axes != [1]:
                return None, f"the table is unsqueezed on axes {axes}, not on the head axis 1"
            unsqueezed = True
        elif node.op_type == "Cast" and not any(kind == "cast" for kind, _ in steps):
            steps.append(("cast", node.attributes["to"].as_int()))
        elif node.op_type == "Mul" and not any(kind == "mul" for kind, _ in steps):
            factors = [_scalar(v) for v in node.inputs]
            index = 1 if factors[1] is not None else 0 if factors[0] is not None else None
            if index is None:
                return None, "the table is multiplied by a non-constant"
            steps.append(("mul", factors[index]))
            node = node.inputs[1 - index].producer()
            continue
        elif node.op_type in ("Cos", "Sin"):
            angles = node.inputs[0].producer()
            if angles is None or angles.op_type != "Concat" or len(angles.inputs) != 2:
                return None, f"{node.op_type} is not of a concatenation of two halves"
            first, second = angles.inputs
            axis = angles.attributes["axis"].as_int()
            rank = len(first.shape) if first.shape is not None else None
            if first is not second or rank is None or axis not in (-1, rank - 1):
                return None, f"{node.op_type} is not of Concat(f, f) on the last axis"
            return _AngleChain(node.op_type, first, tuple(reversed(steps)), unsqueezed), ""
        else:
            return None, f"the table goes through {node.op_type}"
        node = node.inputs[0].producer()
    return None, "the table is not Cos/Sin of concatenated angles"


def _rotary_tables(x: Any, cos: Any, sin: Any) -> tuple[tuple[_AngleChain, _AngleChain] | None, str]:
    """The angle chains of ``cos`` and ``sin`` if they are rotary tables for ``x`` ``[B, H, S, D]``."""
    if x.shape is None or len(x.shape) != 4:
        return None, "the rotated tensor is not known to be [batch, heads, seq, head_dim]"
    head_dim = _static(x.shape[3])
    if head_dim is None or head_dim % 2:
        return None, "the head dim is not a static even number"
    c, why = _angle_chain(cos)
    if c is None:
        return None, f"cos: {why}"
    s, why = _angle_chain(sin)
    if s is None:
        return None, f"sin: {why}"
    if (c.function, s.function) != ("Cos", "Sin"):
        return None, "the tables are not cos and sin"
    if c.freqs is not s.freqs or (c.steps, c.head_axis_unsqueezed) != (s.steps, s.head_axis_unsqueezed):
        return None, "cos and sin are not computed from the same angles the same way"
    freqs_shape = c.freqs.shape
    rank = len(freqs_shape) if freqs_shape is not None else None
    # [seq, D/2] broadcasts over batch and heads; [b, seq, D/2] needs the head axis unsqueezed.
    if not ((rank == 2 and not c.head_axis_unsqueezed) or (rank == 3 and c.head_axis_unsqueezed)):
        return None, f"angles of rank {rank} do not broadcast over the heads only"
    if _static(freqs_shape[-1]) != head_dim // 2:
        return None, f"the angles are {freqs_shape[-1]} wide, not half of head dim {head_dim}"
    if not _same_dim(freqs_shape[-2], x.shape[2]):
        return None, "the angles' sequence axis is not known to be the input's"
    if rank == 3 and not (_static(freqs_shape[0]) == 1 or _same_dim(freqs_shape[0], x.shape[0])):
        return None, "the angles' batch is neither 1 nor the input's"
    return (c, s), ""


def _rotate_half_split(op: Any, x: Any) -> Any:
    halves = op.Split(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["first", "second"])
    return op.Concat(op.Neg(halves[1]), halves[0], axis=-1)


def _rotate_half_slices(op: Any, x: Any) -> Any:
    first = op.Slice(x, _allow_other_inputs=True, _outputs=["first"])
    second = op.Slice(x, _allow_other_inputs=True, _outputs=["second"])
    return op.Concat(op.Neg(second), first, axis=-1)


def _half_bounds(value: Any, head_dim: int) -> tuple[int, int] | None:
    """The [start, end) a Slice output covers on the last axis of a [B, H, S, D] tensor."""
    node = value.producer()
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, ends, axes, steps = (_const_ints(v) for v in inputs[1:5])
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if (axes if inputs[3] is not None else [0]) not in ([3], [-1]) or (steps if inputs[4] is not None else [1]) != [1]:
        return None
    start, end = starts[0], min(ends[0], head_dim)
    return (start + head_dim if start < 0 else start), (end + head_dim if end < 0 else end)


class RotaryFusion(pattern.RewriteRuleClassBase):
    """``x * cos + rotate_half(x) * sin`` -> ``RotaryEmbedding`` (see the module docstring).

    ``split``: rotate_half written with ``Split`` (else with two ``Slice``s)."""

    def __init__(self, split: bool):
        super().__init__(name=f"RotaryFusion{'Split' if split else 'Slice'}")
        self.split = split

    def pattern(self, op: Any, x: Any, cos: Any, sin: Any) -> Any:
        rotated = _rotate_half_split(op, x) if self.split else _rotate_half_slices(op, x)
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

    def check(self, context: Any, x: Any, cos: Any, sin: Any, first: Any, second: Any, **_: Any) -> Any:
        result = pattern.MatchResult()
        tables, why = _rotary_tables(x, cos, sin)
        if tables is None:
            return result.fail(why)
        head_dim = x.shape[3]
        half = head_dim // 2
        if self.split:
            node = first.producer()
            axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
            if axis not in (3, -1) or len(node.outputs) != 2:
                return result.fail("the split is not into two on the last axis")
            sizes = _const_ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
            if sizes is not None and sizes != [half, half]:
                return result.fail(f"the split sizes {sizes} are not two halves")
            if sizes is None and ("num_outputs" not in node.attributes or node.attributes["num_outputs"].as_int() != 2):
                return result.fail("the split is not into two equal halves")
        else:
            if _half_bounds(first, head_dim) != (0, half) or _half_bounds(second, head_dim) != (half, head_dim):
                return result.fail("rotate_half does not slice the head dim into two halves")
        return result

    def rewrite(self, op: Any, x: Any, cos: Any, sin: Any, **_: Any) -> Any:
        tables, _ = _rotary_tables(x, cos, sin)
        assert tables is not None
        cos_chain, sin_chain = tables
        # Expand to the input's batch: ORT requires the caches' batch to be x's (no position ids).
        # Read from the graph input of the same batch when there is one, so that every rotary
        # embedding of the model shares one pair of caches (common-subexpression elimination).
        batch = op.Concat(op.Shape(_batch_source(x), start=0, end=1), op.Constant(value_ints=[1, 1]), axis=0)
        caches = []
        for chain in (cos_chain, sin_chain):
            table = getattr(op, chain.function)(chain.freqs)
            for kind, arg in chain.steps:  # the same elementwise steps, in the same order
                if kind == "mul":
                    table = op.Mul(table, op.CastLike(op.Constant(value_float=arg), table))
                else:
                    table = op.Cast(table, to=arg)
            if len(chain.freqs.shape) == 2:
                table = op.Unsqueeze(table, op.Constant(value_ints=[0]))
            caches.append(op.Expand(table, batch))
        return op.RotaryEmbedding(x, caches[0], caches[1], interleaved=0)


def _batch_source(x: Any) -> Any:
    """A graph input whose first dim is the same named symbol as ``x``'s batch, else ``x``."""
    producer = x.producer()
    graph = producer.graph if producer is not None else getattr(x, "graph", None)
    batch = x.shape[0] if x.shape is not None else None
    if graph is None or isinstance(batch, int) or batch is None:
        return x
    for value in graph.inputs:
        if value.shape is not None and len(value.shape) >= 1 and _same_dim(value.shape[0], batch):
            return value
    return x


def _repeated_heads(value: Any) -> tuple[Any, str]:
    """``value`` as ``Reshape(Expand(Unsqueeze(kv, [2])))`` copying each of ``kv``'s heads over a
    group of consecutive query heads; returns ``kv`` or the reason it is not that."""
    reshape = value.producer()
    if reshape is None or reshape.op_type != "Reshape":
        return None, "not a reshape"
    expand = reshape.inputs[0].producer()
    if expand is None or expand.op_type != "Expand":
        return None, "not an expand"
    unsqueeze = expand.inputs[0].producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or _const_ints(unsqueeze.inputs[1]) != [2]:
        return None, "not unsqueezed on axis 2"
    kv = unsqueeze.inputs[0]
    grouped, out = expand.outputs[0].shape, value.shape
    if kv.shape is None or grouped is None or out is None or (len(kv.shape), len(grouped), len(out)) != (4, 5, 4):
        return None, "shapes unknown"
    b, h_kv, s, d = kv.shape
    kv_heads, group = _static(h_kv), _static(grouped[2])
    if kv_heads is None or group is None or _static(out[1]) != kv_heads * group:
        return None, "head counts not static"
    if not (_same_dim(grouped[0], b) and _static(grouped[1]) == kv_heads and _same_dim(grouped[3], s)
            and _same_dim(grouped[4], d) and _same_dim(out[0], b) and _same_dim(out[2], s) and _same_dim(out[3], d)):
        return None, "the expand or reshape moves more than the head groups"
    return kv, ""


class SharedKVAttention(pattern.RewriteRuleClassBase):
    """``Attention(q, repeat(k), repeat(v), ...)`` -> ``Attention(q, k, v, ...)``."""

    def __init__(self) -> None:
        super().__init__(name="SharedKVAttention", remove_nodes=False)

    def pattern(self, op: Any, q: Any, k: Any, v: Any) -> Any:
        return op.Attention(q, k, v, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["attention"])

    def rewrite(self, op: Any, q: Any, k: Any, v: Any, attention: Any, **_: Any) -> Any:
        node = attention.producer()
        kv_k, _ = _repeated_heads(k)
        kv_v, _ = _repeated_heads(v)
        rest = list(node.inputs[3:])
        return op.Attention(q, kv_k, kv_v, *rest, **{n: a for n, a in node.attributes.items()})

    def check(self, context: Any, q: Any, k: Any, v: Any, attention: Any, **_: Any) -> Any:
        result = pattern.MatchResult()
        node = attention.producer()
        if len(node.outputs) != 1 or any(i is not None for i in node.inputs[4:]):
            return result.fail("attention with a key/value cache is left as it is")
        if q.shape is None or len(q.shape) != 4:
            return result.fail("the query is not 4-D")
        kv_k, why_k = _repeated_heads(k)
        kv_v, why_v = _repeated_heads(v)
        if kv_k is None or kv_v is None:
            return result.fail(f"key: {why_k or 'ok'}; value: {why_v or 'ok'}")
        if kv_k.shape[1] != kv_v.shape[1] or _static(q.shape[1]) != _static(k.shape[1]):
            return result.fail("query, key and value head counts do not match")
        return result


#: The rules, made once: rotary embeddings (rotate_half by slices or by a split), then shared heads.
RULES = [RotaryFusion.rule(split=False), RotaryFusion.rule(split=True), SharedKVAttention.rule()]


def fuse_attention(model: Any, *, norm_op: tuple[str, str]) -> FusionCounts:
    """Apply the rules to an ``onnx_ir`` model in place; return the counts.

    ``norm_op``: (domain, op type) of the norm nodes, counted before and after to prove that no
    rule touched a norm.
    """
    import onnx_ir as ir

    def norm_count() -> int:
        return sum(1 for n in ir.traversal.RecursiveGraphIterator(model.graph) if (n.domain, n.op_type) == norm_op)

    norms_before = norm_count()
    pattern.RewriteRuleSet(RULES, commute=True).apply_to_model(model)
    with_cache = attention_with_cache(model)
    ir.passes.common.CommonSubexpressionEliminationPass()(model)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    if norm_count() != norms_before:
        raise AssertionError("an attention fusion changed the norm nodes")  # the rules cannot match them
    counts = FusionCounts(with_cache=with_cache)
    for node in model.graph:
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            counts.attention += 1
            k, q = node.inputs[1], node.inputs[0]
            if k.shape is not None and q.shape is not None and len(k.shape) == 4 and k.shape[1] != q.shape[1]:
                counts.shared_kv += 1
        elif node.op_type == "RotaryEmbedding" and node.domain in ("", "ai.onnx"):
            counts.rotary += 1
        elif node.op_type == "Neg" and _feeds_rotation(node):
            counts.decomposed_rotary += 1
    return counts


def _feeds_rotation(node: Any) -> bool:
    """A ``Neg`` feeding ``Concat`` -> ``Mul``: a rotate_half left decomposed."""
    for use in node.outputs[0].uses():
        consumer = use.node if hasattr(use, "node") else use[0]
        if consumer.op_type == "Concat":
            return True
    return False


def fusion_counts_in(nodes: Sequence[Any]) -> dict[str, int]:
    """Counts of the fused ops in an ``onnx.GraphProto``'s nodes (tests and the benchmark)."""
    counts = {"Attention": 0, "RotaryEmbedding": 0}
    for node in nodes:
        if node.op_type in counts and node.domain in ("", "ai.onnx"):
            counts[node.op_type] += 1
    return counts


# -- KV-cache graphs: the cache concatenation into Attention's past/present --------------------
def _cache_concat(value: Any, graph: Any) -> tuple[Any, Any] | None:
    """``(past, new)`` when ``value`` is ``Concat(past, new, axis=2)`` with ``past`` a graph input."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    axis = node.attributes.get("axis")
    if axis is None or axis.value not in (2, -2):
        return None
    past, new = node.inputs
    if past is None or new is None or not past.is_graph_input():
        return None
    return past, new


def attention_with_cache(model: Any) -> int:
    """``Attention(q, Concat(past_k, k), Concat(past_v, v), mask)`` -> ``Attention(q, k, v, mask, past_k,
    past_v)`` whose ``present_key``/``present_value`` outputs replace the concatenations.

    Opset-23 ``Attention`` concatenates the past itself (``present = Concat(past, new)`` on the
    sequence axis, the same tensor) and attends over it; ONNX Runtime and TensorRT then run the
    cache update inside the attention kernel. Only an explicit-mask attention (``is_causal`` 0)
    is rewritten, and only when both concatenations take a graph input as their past; the
    presents keep their graph-output names. Returns the number of nodes rewritten.
    """
    import onnx_ir as ir

    graph = model.graph
    rewritten = 0
    for node in list(graph):
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            continue
        inputs = list(node.inputs) + [None] * (4 - len(node.inputs))
        causal = node.attributes.get("is_causal")
        if any(i is not None for i in inputs[4:]) or (causal is not None and causal.value):
            continue
        key, value = _cache_concat(inputs[1], graph), _cache_concat(inputs[2], graph)
        if key is None or value is None:
            continue
        concat_k, concat_v = inputs[1], inputs[2]
        fused = ir.Node("", "Attention", [inputs[0], key[1], value[1], inputs[3], key[0], value[0]],
                        list(node.attributes.values()), num_outputs=3, name=node.name)
        graph.insert_after(node, fused)
        ir.convenience.replace_all_uses_with(node.outputs[0], fused.outputs[0], replace_graph_outputs=True)
        for old, new in ((node.outputs[0], fused.outputs[0]), (concat_k, fused.outputs[1]),
                         (concat_v, fused.outputs[2])):
            new.type, new.shape = old.type, old.shape
        for old, new in ((concat_k, fused.outputs[1]), (concat_v, fused.outputs[2])):
            name = old.name
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
            old.name = None
            new.name = name
        fused.outputs[0].name = node.outputs[0].name
        graph.remove(node, safe=True)
        rewritten += 1
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return rewritten
