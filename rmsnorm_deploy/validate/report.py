"""What ``validate`` reports: one row per comparison, one entry per norm, the whole report."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rmsnorm_deploy.contract.compare import CompareResult
from rmsnorm_deploy.table import format_table


@dataclasses.dataclass
class CheckRow:
    """One comparison: a backend's output (or one norm's) against its reference."""

    backend: str
    output: str
    against: str
    check: str
    result: CompareResult | None = None
    status: str = "pass"  # pass, FAIL, skipped
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "result"}
        data["result"] = self.result.to_dict() if self.result is not None else None
        return data


@dataclasses.dataclass
class NormReport:
    """One norm of the graph: what the graph says, and what each ONNX Runtime backend ran."""

    name: str
    kind: str
    op: str
    precision: str
    epsilon: float | None
    axes: list[int] | None
    spec: str
    ran: dict[str, str] = dataclasses.field(default_factory=dict)  # backend -> "op (precision)"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.epsilon is not None and not math.isfinite(self.epsilon):
            data["epsilon"] = str(self.epsilon)  # JSON has no NaN or Infinity
        return data


@dataclasses.dataclass
class ValidationReport:
    model: str
    source: str
    reference: str
    inputs: dict[str, dict[str, Any]]
    backends: list[str]
    rows: list[CheckRow]
    norms: list[NormReport]
    notes: list[str]
    #: backend -> nodes per provider (ONNX Runtime backends, where ONNX Runtime reports it)
    node_assignment: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """No comparison failed and at least one passed: zero comparisons is not a pass."""
        return not self.failure()

    def failure(self) -> str:
        """Why the report does not pass, in one line ("" when it passes)."""
        failed = [r for r in self.rows if r.status == "FAIL"]
        if failed:
            return f"{len(failed)} comparison(s) failed (first: {failed[0].backend} {failed[0].output})"
        if not any(r.status == "pass" for r in self.rows):
            return ("nothing was compared (no output or norm could be checked), so nothing is verified; see the "
                    "notes, or compare outputs with a second backend or a PyTorch source")
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "source": self.source, "reference": self.reference, "inputs": self.inputs,
            "backends": self.backends, "passed": self.passed, "failure": self.failure(),
            "rows": [r.to_dict() for r in self.rows], "norms": [n.to_dict() for n in self.norms], "notes": self.notes,
            "nodes_per_provider": self.node_assignment,
        }

    def table(self) -> str:
        headers = ["backend", "output", "vs", "dtype", "max abs", "max rel", "max ulp", "tolerance", "status"]
        body = []
        for r in self.rows:
            res = r.result
            if res is None:
                body.append([r.backend, r.output, r.against, "-", "-", "-", "-", "-", f"{r.status}: {r.detail}"])
                continue
            status = r.status if not res.nan_mismatch and not res.inf_mismatch else (
                f"{r.status} (nan {res.nan_mismatch}, inf {res.inf_mismatch})")
            if res.nan_expected:
                status += f" (reference NaN at {res.nan_expected}: not comparable)"
            body.append([r.backend, r.output, r.against, res.dtype, _num(res.max_abs), _num(res.max_rel),
                         _num(res.max_ulp), res.tolerance.describe(), status])
        text = [f"model: {self.model}", f"source: {self.source}", f"reference: {self.reference}",
                "inputs: " + ", ".join(f"{k} {v['dtype']}{v['shape']} ({v['kind']})" for k, v in self.inputs.items()),
                *[f"nodes per provider, {b}: " + ", ".join(f"{n} on {p}" for p, n in c.items())
                  for b, c in self.node_assignment.items()],
                "", format_table(headers, body)]
        if self.norms:
            norm_headers = ["norm", "kind", "as written", "accumulates", "epsilon", "axes", *self.backends_ran(), "spec"]
            norm_body = [[n.name, n.kind, n.op, n.precision, "-" if n.epsilon is None else f"{n.epsilon:.3g}",
                          n.axes, *[n.ran.get(b, "-") for b in self.backends_ran()], n.spec] for n in self.norms]
            text += ["", format_table(norm_headers, norm_body)]
        failed = [r for r in self.rows if r.status == "FAIL"]
        for r in failed:
            if r.result is not None and (r.result.first_bad or r.result.problem()):
                text.append(f"FAIL {r.backend} {r.output}: {r.result.summary()}")
            elif r.result is None and r.detail:
                text.append(f"FAIL {r.backend} {r.output}: {r.detail}")
        text += [f"note: {n}" for n in self.notes]
        counts = {s: sum(r.status == s for r in self.rows) for s in ("pass", "FAIL", "skipped")}
        text.append(f"\n{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} skipped")
        if not self.passed:
            text.append(f"FAIL: {self.failure()}")
        return "\n".join(text)

    def backends_ran(self) -> list[str]:
        return [b for b in self.backends if any(b in n.ran for n in self.norms)]


def _num(value: float) -> str:
    return f"{value:.3g}"
