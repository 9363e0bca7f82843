"""Parity of the standalone RMSNorm model in ONNX Runtime CPU, per lowering, spec and dtype.

For each case the model is built (or the lowering's refusal recorded), run in ONNX Runtime
on seeded inputs, compared with the float64 oracle under the tolerance table and with the
torch reference, and the graph ONNX Runtime actually ran is audited: which op the norm
became (``SimplifiedLayerNormalization`` when ORT fused it) and the dtype its reduction
accumulated in.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import onnx

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import to_torch
from rmsnorm_deploy.contract.inputs import activations, gain_weights
from rmsnorm_deploy.contract.reference import oracle, reference
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import (
    LoweringError,
    MissingDependencyError,
    ProviderError,
    UserError,
)
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.lowerings import LOWERINGS
from rmsnorm_deploy.graph.standalone import rmsnorm_model
from rmsnorm_deploy.resources import check_memory
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner
from rmsnorm_deploy.table import format_table


@dataclasses.dataclass
class SweepCase:
    spec_name: str
    spec: RMSNormSpec
    dtype: str
    lowering: str
    optimization: str = "all"
    shape: tuple[int, ...] = (199, 760)
    inputs: str = "normal"
    seed: int = 0
    #: ONNX Runtime's provider (``cpu``, ``cuda``, ``tensorrt``); a provider that does not run raises
    provider: str = "cpu"
    #: refuse (``ProviderError``) a session in which a compute node runs off ``provider``
    require_all_nodes_on_provider: bool = False


@dataclasses.dataclass
class SweepRow:
    case: SweepCase
    status: str  # pass, FAIL, refused, unsupported
    detail: str = ""
    ulp_vs_oracle: float | None = None
    ulp_vs_reference: float | None = None
    ort_op: str = ""
    ort_accumulation: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def to_dict(self) -> dict[str, Any]:
        c = self.case
        return {
            "spec": c.spec_name, "spec_fields": c.spec.to_dict(), "dtype": c.dtype, "lowering": c.lowering,
            "optimization": c.optimization, "shape": list(c.shape), "inputs": c.inputs, "status": self.status,
            "detail": self.detail, "ulp_vs_oracle": self.ulp_vs_oracle, "ulp_vs_reference": self.ulp_vs_reference,
            "ort_op": self.ort_op, "ort_accumulation": self.ort_accumulation,
        }


#: float64 arrays of the input's size one case holds at its peak: the generated activations (and
#: gate), the oracle's input, square and result, and the comparison's copies.
PEAK_FLOAT64_COPIES = 6


def check_case_memory(shape: Sequence[int], what: str) -> None:
    """Refuse (one line) a shape whose case would not fit the memory budget, before anything is allocated."""
    check_memory(math.prod(int(d) for d in shape) * 8 * PEAK_FLOAT64_COPIES,
                 f"{what} ({math.prod(int(d) for d in shape):,} elements)", "give a smaller shape")


def run_case(case: SweepCase) -> SweepRow:
    """Build, run, compare and audit one case; never raises for a refusal or a runtime's gap."""

    try:
        model = rmsnorm_model(case.spec, dtype=case.dtype, shape=case.shape, lowering=case.lowering)
    except LoweringError as exc:
        return SweepRow(case, "refused", str(exc).split(": ", 1)[-1])
    x = activations(case.shape, case.dtype, seed=case.seed, kind=case.inputs)
    w = gain_weights(case.shape[-case.spec.normalized_dims:], case.dtype, case.spec.gain, seed=case.seed + 1)
    feed = {"x": x} if w is None else {"x": x, "weight": w}
    z = activations(case.shape, case.dtype, seed=case.seed + 2, kind=case.inputs) if case.spec.has_gate else None
    if z is not None:
        feed["z"] = z
    with tempfile.TemporaryDirectory(prefix="rmsnorm-sweep-") as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        try:
            with OnnxRuntimeRunner(model, [case.provider], optimization=case.optimization, optimized_model_path=optimized,
                                   require_all_nodes_on_provider=case.require_all_nodes_on_provider) as runner:
                y = runner.infer(feed)["y"]
        except (MissingDependencyError, ProviderError):
            raise
        except UserError as exc:  # ONNX Runtime has no kernel for this graph on this provider
            return SweepRow(case, "unsupported", _short_ort_error(str(exc)))
        ran = audit_model(onnx.load(str(optimized)), stage=f"after onnxruntime ({case.optimization})")
    x_t, w_t, z_t = to_torch(x), (to_torch(w) if w is not None else None), (to_torch(z) if z is not None else None)
    vs_oracle = compare(y, oracle(case.spec, x_t, w_t, z_t), tolerance_for("norm", "onnxruntime", case.dtype),
                        dtype=case.dtype, name="y vs float64")
    vs_ref = compare(y, reference(case.spec, x_t, w_t, z_t), tolerance_for("norm_vs_torch", "onnxruntime", case.dtype),
                     dtype=case.dtype, name="y vs torch")
    passed = vs_oracle.passed and vs_ref.passed
    failure = "; ".join(r.summary() for r in (vs_oracle, vs_ref) if not r.passed)
    row = SweepRow(
        case, "pass" if passed else "FAIL", failure,
        vs_oracle.max_ulp, vs_ref.max_ulp,
        ort_op=",".join(sorted({r.op for r in ran})) or "?",
        ort_accumulation=",".join(sorted({r.accumulation for r in ran})) or "?",
    )
    if any(r.low_precision for r in ran):
        row.status, row.detail = "FAIL", "ONNX Runtime ran the reduction in " + row.ort_accumulation
    return row


def _short_ort_error(text: str) -> str:
    marker = "NOT_IMPLEMENTED : "
    return text.split(marker, 1)[1] if marker in text else text


def cases(
    specs: dict[str, RMSNormSpec],
    dtypes: Sequence[str],
    lowerings: Sequence[str] = LOWERINGS,
    optimizations: Sequence[str] = ("disable", "all"),
    shapes: Sequence[tuple[int, ...]] = ((199, 760),),
    inputs: Sequence[str] = ("normal",),
) -> list[SweepCase]:
    return [
        SweepCase(name, spec, dt, low, opt, shape, kind)
        for (name, spec), dt, low, opt, shape, kind in itertools.product(
            specs.items(), dtypes, lowerings, optimizations, shapes, inputs
        )
    ]


def sweep_table(rows: Iterable[SweepRow]) -> str:
    """The rows as a table; refusals and runtime gaps are numbered notes below it."""
    headers = ["spec", "dtype", "lowering", "ort opt", "inputs", "shape", "status", "ulp vs f64", "ulp vs torch",
               "ORT ran", "acc"]
    body, notes = [], {}
    for r in rows:
        c = r.case
        status = r.status
        if r.status in ("refused", "unsupported") or (r.failed and r.detail):
            number = notes.setdefault(f"{r.status}: {r.detail}", len(notes) + 1)
            status = f"{r.status} [{number}]"
        body.append([
            c.spec_name, c.dtype, c.lowering, c.optimization, c.inputs, "x".join(map(str, c.shape)), status,
            _num(r.ulp_vs_oracle), _num(r.ulp_vs_reference), r.ort_op, r.ort_accumulation,
        ])
    text = format_table(headers, body)
    if notes:
        text += "\n\n" + "\n".join(f"[{n}] {note}" for note, n in notes.items())
    return text


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary_table(rows: Iterable[SweepRow]) -> str:
    """Per lowering and dtype: the worst ULP error over all specs and inputs, and what ORT ran."""
    groups: dict[tuple[str, str], list[SweepRow]] = {}
    for r in rows:
        groups.setdefault((r.case.lowering, r.case.dtype), []).append(r)
    body = []
    for (lowering, dtype), group in groups.items():
        ran = [r for r in group if r.ulp_vs_oracle is not None]
        worst = max((r.ulp_vs_oracle for r in ran), default=None)
        worst_ref = max((r.ulp_vs_reference for r in ran), default=None)
        fused = sorted({f"{r.case.spec_name}:{'fused' if r.ort_op in _FUSED_OPS else 'unfused'}" for r in ran
                        if r.case.optimization == "all"})
        body.append([lowering, dtype, f"{sum(r.status == 'pass' for r in group)}/{len(group)}",
                     _num(worst), _num(worst_ref), " ".join(fused)])
    return format_table(["lowering", "dtype", "passed", "max ulp vs f64", "max ulp vs torch", "ORT (ENABLE_ALL)"], body)


_FUSED_OPS = ("SimplifiedLayerNormalization", "RMSNormalization")
