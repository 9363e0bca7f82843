"""Routing ties: whether a failed parity check is a top-k decision that went the other way.

A mixture-of-experts router picks its experts with ``topk`` on scores computed in the model's
dtype. Where two scores of a token are nearly equal, the rounding of ONNX Runtime and of
PyTorch (a float16 ``MatMul`` accumulated differently, a fused softmax) can order them
differently: the token then goes to another expert and its logits differ far beyond any
rounding tolerance, although both runtimes compute the model correctly. Such a *routing tie*
is a property of the input, not of the export; it is reported as such, never as a pass, and
never by loosening a tolerance.

:class:`TopKRecorder` records every ``aten.topk`` call of the PyTorch run (its scores and the
indices it chose). When the parity of a feed fails and the graph has ``TopK`` nodes,
:func:`diagnose_routing` runs ONNX Runtime twice more on that feed, on copies of the graph
written beside it (so external weights resolve; removed afterwards):

1. the graph with each ``TopK``'s scores and indices as extra outputs: ONNX Runtime's own
   routing, compared token by token with PyTorch's (the ``TopK`` nodes of the graph matched
   to the ``topk`` calls in order, by shape, ``k``, axis and direction). Its regular outputs
   must equal those of the parity run bit for bit (else the exposed tensors changed what ONNX
   Runtime ran, and nothing is concluded);
2. the graph with each ``TopK`` replaced by ``GatherElements`` at indices fed from PyTorch's
   run: ONNX Runtime computing everything else itself, with PyTorch's routing imposed.

The verdict is ``tie`` only when the routing differs somewhere, every router's scores agree
with PyTorch's within the model tolerance (so no router is wrong), and with PyTorch's routing
imposed every output agrees within the model tolerance: then the routing flips explain the
whole difference. Otherwise ``not a tie`` (a real difference), or ``not compared`` with the
reason. Each flip names the ``TopK`` node, the token, the experts each runtime chose and
PyTorch's margin between them (absolute, and in ULPs of the score's dtype).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rmsnorm_deploy.contract.compare import CompareResult, compare, ulp_of
from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.contract.tolerances import Tolerance
from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner

#: At most this many bytes of topk scores are recorded per run (beyond: the routing is not compared).
RECORD_LIMIT_BYTES = 256 << 20
#: Graph inputs that carry PyTorch's routing into the imposed copy: ``<prefix><i>``.
IMPOSED_PREFIX = "rmsnorm_deploy.routing."
#: A model file (its weights inside) larger than this is not copied for the diagnosis.
COPY_LIMIT_BYTES = 1 << 30
#: At most this many flips are described in a message.
MAX_DESCRIBED = 3


@dataclasses.dataclass
class TopKCall:
    """One ``topk`` of the PyTorch run: its input scores and the indices it returned."""

    scores: np.ndarray
    indices: np.ndarray
    k: int
    axis: int  # normalized: 0 <= axis < scores.ndim
    largest: bool
    dtype: str  # the scores' dtype


class TopKRecorder(TorchDispatchMode):
    """Records every ``aten.topk`` and ``aten.sort`` called while it is active (``calls``); ``complete`` is False
    once more than :data:`RECORD_LIMIT_BYTES` of scores were seen (nothing more is kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[TopKCall] = []
        self.complete = True
        self._bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.topk, torch.ops.aten.sort) and self.complete:
            self._record(func, args, kwargs or {}, out)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        # torch.onnx writes sort (and argsort) as a TopK over the whole axis: recorded alike
        if func.overloadpacket is torch.ops.aten.topk:
            bound = {**dict(zip(("self", "k", "dim", "largest", "sorted"), args)), **kwargs}
        elif func is torch.ops.aten.sort.stable:
            bound = {**dict(zip(("self",), args)), **kwargs}
        else:
            bound = {**dict(zip(("self", "dim", "descending"), args)), **kwargs}
        x: torch.Tensor = bound["self"]
        self._bytes += x.numel() * x.element_size()
        if self._bytes > RECORD_LIMIT_BYTES:
            self.complete = False
            self.calls.clear()
            return
        dim = int(bound.get("dim", -1)) % max(1, x.dim())
        if func.overloadpacket is torch.ops.aten.topk:
            k, largest = int(bound["k"]), bool(bound.get("largest", True))
        else:
            k, largest = (x.shape[dim] if x.dim() else 1), bool(bound.get("descending", False))
        self.calls.append(TopKCall(scores=_numpy(x), indices=out[1].detach().cpu().numpy().astype(np.int64), k=k,
                                   axis=dim, largest=largest, dtype=_dtype(x.dtype)))


def _dtype(dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except UserError:  # integer scores (a sort of expert ids)
        return str(dtype).replace("torch.", "")


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


@dataclasses.dataclass
class Flip:
    """A token routed to other experts by ONNX Runtime than by PyTorch."""

    node: str  # the TopK node of the graph
    row: tuple[int, ...]  # the token: the scores' index without the top-k axis
    torch_only: list[int]
    onnx_only: list[int]
    margin: float  # PyTorch's score of its own pick minus its score of ONNX Runtime's pick (worst pair)
    margin_ulp: float  # the margin in ULPs of the scores' dtype at that score
    dtype: str
    #: max |ONNX Runtime's score - PyTorch's| over this token's scores (the rounding between them)
    runtimes_differ: float

    def describe(self) -> str:
        return (f"{self.node}, scores row {list(self.row)}: torch chose expert(s) {self.torch_only}, ONNX Runtime "
                f"{self.onnx_only}; torch's scores for them differ by {self.margin:.3g} "
                f"({self.margin_ulp:.3g} ulp of {self.dtype}), the two runtimes' scores of that row by up to "
                f"{self.runtimes_differ:.3g}")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "row": list(self.row)}


@dataclasses.dataclass
class RoutingDiagnosis:
    """What the routing says about a failed comparison (see the module docstring)."""

    verdict: str  # "tie", "not a tie" or "not compared"
    detail: str
    flips: list[Flip] = dataclasses.field(default_factory=list)
    routers: int = 0
    scores: list[CompareResult] = dataclasses.field(default_factory=list)  # router scores, routing imposed
    imposed: list[CompareResult] = dataclasses.field(default_factory=list)  # outputs, routing imposed

    @property
    def tie(self) -> bool:
        return self.verdict == "tie"

    def describe(self) -> str:
        if self.verdict == "not compared":
            return f"routing not compared: {self.detail}"
        head = "routing tie" if self.tie else "not a routing tie"
        if not self.flips:
            return f"{head}: {self.detail}"
        first = [f for f in self.flips if f.node == self.flips[0].node]
        flips = "; ".join(f.describe() for f in first[:MAX_DESCRIBED])
        more = f" (and {len(first) - MAX_DESCRIBED} more rows there)" if len(first) > MAX_DESCRIBED else ""
        later = len(self.flips) - len(first)
        after = f"; {later} later choice(s) differ downstream of it" if later else ""
        return (f"{head}: the first of {self.routers} TopK nodes to route differently is {flips}{more}{after}; "
                f"{self.detail}")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "detail": self.detail, "routers": self.routers,
                "flips": [f.to_dict() for f in self.flips],
                "router_scores_routing_imposed": [c.to_dict() for c in self.scores],
                "outputs_routing_imposed": [c.to_dict() for c in self.imposed]}


def _is_topk(node: Any) -> bool:
    return node.op_type == "TopK" and node.domain in ("", "ai.onnx")


def has_topk(path: str | os.PathLike) -> bool:
    """Whether the model file's main graph has a TopK node (read without its external data)."""
    import onnx

    try:
        return bool(topk_nodes(onnx.load(str(path), load_external_data=False)))
    except Exception:  # noqa: BLE001 - unreadable here: the diagnosis is not attempted
        return False


def topk_nodes(model: Any) -> list[Any]:
    """The ``TopK`` nodes of the model's main graph, in graph order."""
    return [n for n in model.graph.node if _is_topk(n)]


def _attr(node: Any, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _exposed_model(model: Any, nodes: list[Any]) -> Any:
    """A copy of ``model`` whose outputs also hold each TopK node's scores and indices."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    for node in nodes:
        for name in (node.input[0], node.output[1]):
            if name not in present:
                copy.graph.output.append(onnx.ValueInfoProto(name=name))
                present.add(name)
    return copy


def _imposed_model(model: Any, calls: list[TopKCall]) -> Any:
    """A copy of ``model`` whose TopK nodes take their indices from new int64 inputs (PyTorch's
    choices) and gather their values from their own scores; the scores stay exposed as outputs."""
    import onnx
    from onnx import TensorProto, helper

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    new_nodes = []
    present = {o.name for o in copy.graph.output}
    i = -1
    for original in model.graph.node:
        if not _is_topk(original):
            new_nodes.append(original)
            continue
        i += 1
        feed = f"{IMPOSED_PREFIX}{i}"
        copy.graph.input.append(helper.make_tensor_value_info(feed, TensorProto.INT64, list(calls[i].indices.shape)))
        axis = _attr(original, "axis", -1)
        new_nodes.append(helper.make_node("GatherElements", [original.input[0], feed], [original.output[0]],
                                          name=f"{original.name or 'TopK'}/imposed_values", axis=axis))
        if len(original.output) > 1 and original.output[1]:
            new_nodes.append(helper.make_node("Identity", [feed], [original.output[1]],
                                              name=f"{original.name or 'TopK'}/imposed_indices"))
        if original.input[0] not in present:
            copy.graph.output.append(onnx.ValueInfoProto(name=original.input[0]))
            present.add(original.input[0])
    del copy.graph.node[:]
    copy.graph.node.extend(new_nodes)
    return copy


def _run(model: Any, folder: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``model`` run by ONNX Runtime CPU from a file in ``folder`` (beside the original, so its
    external data resolves), removed afterwards."""
    import onnx


    fd, name = tempfile.mkstemp(prefix=".routing-", suffix=".onnx", dir=folder)
    os.close(fd)
    try:
        onnx.save(model, name)
        with OnnxRuntimeRunner(name, ["cpu"], optimization="all") as runner:
            return runner.infer(feed)
    finally:
        Path(name).unlink(missing_ok=True)


def _is_float(dtype: str) -> bool:
    return dtype in ("float64", "float32", "float16", "bfloat16")


def _sets_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row (last axis: the k choices), whether the sets of chosen indices differ."""
    return np.any(np.sort(a, axis=-1) != np.sort(b, axis=-1), axis=-1)


def _flips(node_name: str, call: TopKCall, onnx_indices: np.ndarray, onnx_scores: np.ndarray) -> list[Flip]:
    torch_idx = np.moveaxis(call.indices, call.axis, -1)
    onnx_idx = np.moveaxis(onnx_indices, call.axis, -1)
    scores = np.moveaxis(call.scores, call.axis, -1).astype(np.float64)
    theirs_scores = np.moveaxis(onnx_scores, call.axis, -1).astype(np.float64)
    found = []
    for row in np.argwhere(_sets_differ(torch_idx, onnx_idx)):
        row = tuple(int(r) for r in row)
        mine, theirs = set(torch_idx[row].tolist()), set(onnx_idx[row].tolist())
        torch_only, onnx_only = sorted(mine - theirs), sorted(theirs - mine)
        s = scores[row]
        sign = 1.0 if call.largest else -1.0
        # equal scores (masked -inf ones included) are an exact tie: margin 0, not inf - inf
        margin = max(0.0 if s[a] == s[b] else sign * (s[a] - s[b]) for a in torch_only for b in onnx_only)
        ulp = float(ulp_of(np.array([s[torch_only[0]]]), call.dtype)[0]) if _is_float(call.dtype) else 1.0
        with np.errstate(invalid="ignore"):
            differ = float(np.max(np.where(theirs_scores[row] == s, 0.0, np.abs(theirs_scores[row] - s))))
        found.append(Flip(node_name, row, torch_only, onnx_only, float(margin), float(margin / ulp), call.dtype, differ))
    return found


def _align(nodes: list[Any], exposed: dict[str, np.ndarray], calls: list[TopKCall]) -> list[TopKCall] | str:
    """PyTorch's call for each TopK node, in order: the next call of the same scores shape, indices
    shape, axis and direction. PyTorch may call topk or sort where the traced graph has none (the
    experts implementation of transformers' MoE blocks is another while tracing); the graph may not
    have a TopK PyTorch did not call. A node left without a call: the reason, as a string."""
    matched: list[TopKCall] = []
    rest = iter(enumerate(calls))
    for i, node in enumerate(nodes):
        scores, got = exposed[node.input[0]], exposed[node.output[1]]
        axis, largest = _attr(node, "axis", -1) % max(1, got.ndim), bool(_attr(node, "largest", 1))
        for _, call in rest:
            if (call.scores.shape, call.indices.shape, call.axis, call.largest) == \
                    (scores.shape, got.shape, axis, largest):
                matched.append(call)
                break
        else:
            return (f"TopK node {i} of the graph (scores {list(scores.shape)}, k {got.shape[axis] if got.ndim else 1}) "
                    f"matches none of PyTorch's {len(calls)} topk/sort calls left in order")
    return matched


def diagnose_routing(
    model_path: str | os.PathLike,
    feed: dict[str, np.ndarray],
    onnx_outputs: dict[str, np.ndarray],
    torch_outputs: dict[str, Any],
    calls: Sequence[TopKCall] | None,
    tolerance: Tolerance,
    *,
    dtype: str,
) -> RoutingDiagnosis:
    """Whether the failed comparison of ``onnx_outputs`` with ``torch_outputs`` on ``feed`` is a
    routing tie (see the module docstring). ``calls``: the topk calls of PyTorch's run on ``feed``
    (``None``: not recorded). Never raises for a model it cannot diagnose: the verdict says why."""
    import onnx

    path = Path(model_path)
    if path.stat().st_size > COPY_LIMIT_BYTES:
        return RoutingDiagnosis("not compared", f"the model file holds over {COPY_LIMIT_BYTES >> 30} GiB (weights "
                                "inside): it is not copied for the diagnosis")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - a diagnosis, not a check: say why and stop
        return RoutingDiagnosis("not compared", f"the model could not be read ({one_line(exc, limit=120)})")
    nodes = topk_nodes(model)
    if not nodes:
        return RoutingDiagnosis("not compared", "the graph has no TopK node")
    if calls is None:
        return RoutingDiagnosis("not compared", "PyTorch's topk calls were not recorded (their scores exceed "
                                f"{RECORD_LIMIT_BYTES >> 20} MiB)")
    names = [n.name or f"TopK#{i}" for i, n in enumerate(nodes)]
    try:
        exposed = _run(_exposed_model(model, nodes), path.parent, feed)
    except UserError as exc:
        return RoutingDiagnosis("not compared", f"ONNX Runtime could not run the graph with its routing exposed: "
                                f"{one_line(exc, limit=160)}", routers=len(nodes))
    changed = [k for k, v in onnx_outputs.items() if not np.array_equal(exposed[k], v, equal_nan=True)]
    if changed:
        return RoutingDiagnosis("not compared", f"exposing the routing changed ONNX Runtime's {changed[0]!r}",
                                routers=len(nodes))
    matched = _align(nodes, exposed, list(calls))
    if isinstance(matched, str):
        return RoutingDiagnosis("not compared", matched, routers=len(nodes))
    calls = matched
    flips: list[Flip] = []
    for i, (node, call) in enumerate(zip(nodes, calls)):
        flips += _flips(names[i], call, exposed[node.output[1]].astype(np.int64), exposed[node.input[0]])
    if not flips:
        return RoutingDiagnosis("not a tie", "every token went to the same experts in both runtimes", routers=len(nodes))
    imposed_feed = {**feed, **{f"{IMPOSED_PREFIX}{i}": c.indices for i, c in enumerate(calls)}}
    try:
        imposed = _run(_imposed_model(model, calls), path.parent, imposed_feed)
    except UserError as exc:
        return RoutingDiagnosis("not compared", f"ONNX Runtime could not run the graph with PyTorch's routing "
                                f"imposed: {one_line(exc, limit=160)}", flips, len(nodes))
    # integer scores (a sort of expert ids) must be equal: exact, an atol of 0 on integers
    scores = [compare(imposed[n.input[0]], c.scores, tolerance if _is_float(c.dtype) else Tolerance(),
                      name=f"{names[i]} scores", dtype=c.dtype if _is_float(c.dtype) else "float64")
              for i, (n, c) in enumerate(zip(nodes, calls))]
    outputs = [compare(imposed[k], torch_outputs[k], tolerance, name=k, dtype=dtype) for k in onnx_outputs
               if k in torch_outputs]
    bad_scores = [c for c in scores if not c.passed]
    bad_outputs = [c for c in outputs if not c.passed]
    if not outputs:
        return RoutingDiagnosis("not compared", "no output to compare with PyTorch's routing imposed", flips,
                                len(nodes), scores, outputs)
    if bad_scores:
        return RoutingDiagnosis("not a tie", f"the router scores differ beyond the tolerance: {bad_scores[0].summary()}",
                                flips, len(nodes), scores, outputs)
    if bad_outputs:
        return RoutingDiagnosis("not a tie", "with PyTorch's routing imposed, ONNX Runtime still differs: "
                                f"{bad_outputs[0].summary()}", flips, len(nodes), scores, outputs)
    worst = max(outputs, key=lambda c: c.max_abs)
    worst_scores = max(scores, key=lambda c: c.max_abs)
    return RoutingDiagnosis(
        "tie", f"every router's scores agree with torch's (max abs {worst_scores.max_abs:.3g}), and with torch's "
        f"routing imposed ONNX Runtime's {worst.name} agree with torch within {tolerance.describe()} (max abs "
        f"{worst.max_abs:.3g}): the export is not at fault", flips, len(nodes), scores, outputs)
