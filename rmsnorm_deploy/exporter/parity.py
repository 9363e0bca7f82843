"""Parity of an exported model: ONNX Runtime CPU against its PyTorch module, the evidence table.

Three runs on the same seeded inputs (the export passes two shapes: the example it traced
and a larger one, so the dynamic batch and sequence axes are exercised too):

* the PyTorch module in the model's dtype (the numbers the user has today);
* the same module in float64 with every norm computing its spec's float64 oracle
  (``upcast.float64_view``): the ideal;
* the ONNX model in ONNX Runtime CPU at its default optimization level (``all``).

Checks: ONNX Runtime against float64 no farther than the ``("model_vs_float64",
"onnxruntime", dtype)`` accuracy bound allows *relative to PyTorch's own distance from
float64* (an exported model may not be less accurate than its source); and every norm
reduction of the graph ONNX Runtime actually ran accumulates in float32. ONNX Runtime against
PyTorch in the same dtype is shown as context: two runtimes summing in different orders drift
apart with depth, on a trained 30-layer model further than either is from float64, so that
distance cannot decide (the tolerance table says why). A parity that compared nothing fails.
When ONNX Runtime CPU has no kernel for an op of the model (bfloat16 ``MatMul``), the
parity is *not run* and says why: it is never reported as passed.

The PyTorch run records its ``topk`` and ``sort`` calls (``routing.TopKRecorder``). When a feed
fails and the graph routes with ``TopK`` (mixture-of-experts models), ``routing.diagnose_routing``
says whether a top-k choice went the other way on a near-tie and, with PyTorch's routing imposed
on the graph, ONNX Runtime then agrees with PyTorch: the status is then ``routing tie``, with the
token, the experts and the margin. It is not a pass (``failed`` is true): the exported model's
outputs differ from PyTorch's on that input, through no fault of the export.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from rmsnorm_deploy.contract.compare import CompareResult, compare
from rmsnorm_deploy.contract.tolerances import Tolerance, accuracy_bound_for, tolerance_for
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.routing import TopKRecorder, diagnose_routing, has_topk
from rmsnorm_deploy.exporter.upcast import float64_outputs
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner
from rmsnorm_deploy.table import format_table

BACKEND = "onnxruntime"
#: The status of a parity whose every failure is a routing tie (``routing.py``).
ROUTING_TIE = "routing tie"
#: Models larger than this are not re-saved by ONNX Runtime for the audit of what it ran.
AUDIT_LIMIT_BYTES = 1 << 30


@dataclasses.dataclass
class Comparison:
    label: str
    result: CompareResult
    checked: bool  # False: shown for context, not a pass/fail criterion

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "checked": self.checked, **self.result.to_dict()}


@dataclasses.dataclass
class ModelParity:
    dtype: str
    inputs: dict[str, list[int]]
    status: str  # "pass", "FAIL", "routing tie" (see the module docstring) or "not run"
    reason: str = ""
    comparisons: list[Comparison] = dataclasses.field(default_factory=list)
    ort_norm_ops: str = ""
    ort_accumulation: str = ""
    #: per failed feed with TopK nodes in the graph: ``routing.RoutingDiagnosis.to_dict()``
    routing: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", ROUTING_TIE)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status, "reason": self.reason, "dtype": self.dtype, "inputs": self.inputs,
            "comparisons": [c.to_dict() for c in self.comparisons],
            "onnxruntime_norm_ops": self.ort_norm_ops, "onnxruntime_norm_accumulation": self.ort_accumulation,
            "routing": self.routing,
        }

    def table(self) -> str:
        headers = ["comparison", "output", "max abs", "max rel", "max ulp", "tolerance", "status"]
        rows = []
        for c in self.comparisons:
            r = c.result
            status = ("pass" if r.passed else "FAIL") if c.checked else "(context)"
            rows.append([c.label, f"{r.name} {r.dtype}{list(r.shape)}", _g(r.max_abs), _g(r.max_rel), _g(r.max_ulp),
                         r.tolerance.describe() if c.checked else "-", status])
        text = format_table(headers, rows) if rows else ""
        lines = [text] if text else []
        if self.ort_norm_ops:
            lines.append(f"ONNX Runtime CPU ran the norms as {self.ort_norm_ops}, accumulating in {self.ort_accumulation}")
        verdict = f"parity: {self.status.upper()}"
        lines.append(verdict + (f": {self.reason}" if self.reason else ""))
        return "\n".join(lines)


def _g(v: float) -> str:
    return f"{v:.3g}"


@dataclasses.dataclass
class Expected:
    """What the PyTorch module gives for one feed: in its dtype, in float64, and their distance."""

    feed: dict[str, torch.Tensor]
    same_dtype: dict[str, torch.Tensor]
    float64: dict[str, torch.Tensor]
    baseline: dict[str, CompareResult]
    #: the topk/sort calls of the same-dtype run (``None``: not recorded)
    topk: list[Any] | None = None


@torch.no_grad()
def torch_expectations(
    module: torch.nn.Module,
    norms: Sequence[Any],
    feeds: Sequence[dict[str, torch.Tensor]],
    *,
    dtype: str,
    torch_outputs: Sequence[dict[str, torch.Tensor] | None] = (),
    torch_topk: Sequence[list[Any] | None] = (),
) -> list[Expected]:
    """The PyTorch side of the parity check, computed once so the module can be freed before
    ONNX Runtime loads its own copy of the weights. ``torch_outputs``: outputs of ``module``
    already computed for the first feeds; ``torch_topk``: their recorded topk calls."""

    expected = []
    for i, feed in enumerate(feeds):
        if i < len(torch_outputs) and torch_outputs[i] is not None:
            same, calls = torch_outputs[i], (torch_topk[i] if i < len(torch_topk) else None)
        else:
            with TopKRecorder() as recorder:
                same = module(**feed)
            calls = recorder.calls if recorder.complete else None
        ideal = float64_outputs(module, norms, **feed)
        info = Tolerance(reason="context: how far the PyTorch module itself is from float64")
        baseline = {name: compare(out, ideal[name], info, name=name, dtype=dtype) for name, out in same.items()}
        expected.append(Expected(feed, same, ideal, baseline, calls))
    return expected


def check_parity(
    model_path: str | os.PathLike,
    module: torch.nn.Module,
    norms: Sequence[Any],
    feeds: Sequence[dict[str, torch.Tensor]],
    *,
    dtype: str,
    torch_outputs: Sequence[dict[str, torch.Tensor] | None] = (),
) -> ModelParity:
    """Run and compare on each feed (see the module docstring). ``norms``: the detected norms of ``module``."""
    expected = torch_expectations(module, norms, feeds, dtype=dtype, torch_outputs=torch_outputs)
    return compare_with_onnxruntime(model_path, expected, dtype=dtype)


def compare_with_onnxruntime(model_path: str | os.PathLike, expected: Sequence[Expected], *, dtype: str) -> ModelParity:
    """The ONNX Runtime side of the parity check, against :func:`torch_expectations`."""
    feeds = [e.feed for e in expected]
    parity = ModelParity(dtype, {k: [list(f[k].shape) for f in feeds] for k in feeds[0]}, "pass")
    try:
        ort_runs, ran = _run_onnxruntime(Path(model_path), [{k: v.numpy() for k, v in f.items()} for f in feeds])
    except UserError as exc:
        message = str(exc)
        if "NOT_IMPLEMENTED" in message:
            parity.status = "not run"
            parity.reason = ("ONNX Runtime CPU has no kernel for an op of this model ("
                             f"{_after(message, 'NOT_IMPLEMENTED : ')}); validate it on a GPU runtime")
        else:
            parity.status = "FAIL"
            parity.reason = message
        for e in expected:
            parity.comparisons += [Comparison(f"torch {dtype} vs float64", r, checked=False) for r in e.baseline.values()]
        return parity
    context = Tolerance(reason="context: the distance to PyTorch in the same dtype decides nothing (see module doc)")
    bound = accuracy_bound_for("model_vs_float64", BACKEND, dtype)
    failed_feeds = []
    for ort_outputs, e in zip(ort_runs, expected):
        before = len(parity.comparisons)
        for name, out in ort_outputs.items():
            if name not in e.same_dtype:
                parity.status, parity.reason = "FAIL", f"ONNX output {name!r} has no PyTorch counterpart"
                continue
            allowed = bound.tolerance(e.baseline[name].max_abs)
            parity.comparisons.append(Comparison(
                "onnxruntime[cpu] vs float64", compare(out, e.float64[name], allowed, name=name, dtype=dtype), True))
            parity.comparisons.append(Comparison(f"torch {dtype} vs float64", e.baseline[name], checked=False))
            parity.comparisons.append(Comparison(
                f"onnxruntime[cpu] vs torch {dtype}", compare(out, e.same_dtype[name], context, name=name, dtype=dtype),
                checked=False))
        if any(c.checked and not c.result.passed for c in parity.comparisons[before:]):
            failed_feeds.append((ort_outputs, e))
    if ran is not None:
        parity.ort_norm_ops = ",".join(sorted({r.op for r in ran})) or "?"
        parity.ort_accumulation = ",".join(sorted({r.accumulation for r in ran})) or "?"
        low = [r for r in ran if r.low_precision]
        if low:
            parity.status = "FAIL"
            parity.reason = f"ONNX Runtime ran {len(low)} norm reduction(s) in {low[0].accumulation}"
    failed = [c for c in parity.comparisons if c.checked and not c.result.passed]
    if not any(c.checked for c in parity.comparisons) and parity.status != "FAIL":
        parity.status, parity.reason = "FAIL", "no output of the graph was compared with the float64 reference"
    if failed and parity.status != "FAIL":
        parity.status = "FAIL"
        parity.reason = "; ".join(f"{c.label}: {c.result.summary()}" for c in failed)
        _diagnose_routing(parity, Path(model_path), failed_feeds, tolerance_for("model", BACKEND, dtype), dtype)
    return parity


def _diagnose_routing(parity: ModelParity, path: Path, failed_feeds: list[tuple[dict[str, np.ndarray], Expected]],
                      tol: Tolerance, dtype: str) -> None:
    """For a graph with TopK nodes: whether each failed feed is a routing tie (``routing.py``).
    When every one is, the status becomes ``routing tie``; otherwise what the routing says is
    added to the reason."""

    if not failed_feeds or not has_topk(path):
        return
    diagnoses = []
    for ort_outputs, e in failed_feeds:
        feed = {k: v.numpy() for k, v in e.feed.items()}
        diagnoses.append(diagnose_routing(path, feed, ort_outputs, e.same_dtype, e.topk, tol, dtype=dtype))
    parity.routing = [{"inputs": {k: list(v.shape) for k, v in e.feed.items()}, **d.to_dict()}
                      for (_, e), d in zip(failed_feeds, diagnoses)]
    shapes = [" x ".join(str(n) for n in next(iter(e.feed.values())).shape) for _, e in failed_feeds]
    text = "; ".join(f"input {s}: {d.describe()}" for s, d in zip(shapes, diagnoses))
    if all(d.tie for d in diagnoses):
        parity.status = ROUTING_TIE
        parity.reason = f"{text}. Before imposing the routing: {parity.reason}"
    else:
        parity.reason = f"{parity.reason}; {text}"


def _run_onnxruntime(path: Path, feeds: list[dict[str, np.ndarray]]) -> tuple[list[dict[str, np.ndarray]], list[Any] | None]:
    """ONNX Runtime CPU outputs per feed, and the norm reductions of the graph it ran (small models only)."""
    import onnx


    data = path.parent / (path.name + ".data")
    audit = path.stat().st_size + (data.stat().st_size if data.is_file() else 0) < AUDIT_LIMIT_BYTES
    with tempfile.TemporaryDirectory(prefix="rmsnorm-export-parity-") as tmp:
        optimized = Path(tmp) / "optimized.onnx" if audit else None
        with OnnxRuntimeRunner(path, ["cpu"], optimization="all", optimized_model_path=optimized) as runner:
            outputs = [runner.infer(feed) for feed in feeds]
        ran = None
        if optimized is not None and optimized.exists():
            ran = [r for r in audit_model(onnx.load(str(optimized), load_external_data=False),
                                          stage="after onnxruntime (all)")
                   if r.kind.startswith("RMSNorm")]
    return outputs, ran


def _after(text: str, marker: str) -> str:
    return text.split(marker, 1)[1] if marker in text else text

