"""What ``validate`` reports: one row per comparison, one entry per norm, the whole report."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rmsnorm_deploy.contract.compare import CompareResult
from rmsnorm_deploy.table import format_table

#: ``validate``'s exit code of each verdict (2, bad input, is raised before any verdict)
VERDICT_EXIT_CODES = {"passed": 0, "failed": 1, "not verified": 3}


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
    #: whether the reference is independent of the graph under test (its source, its spec's own
    #: oracle, a second backend): a passing row that is not (self-consistency) verifies nothing
    independent: bool = True

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

    #: what checks against something independent of the graph would add, and how to run them ("" when
    #: the run had an independent reference for the outputs)
    unverified: str = ""

    @property
    def verdict(self) -> str:
        """``failed``: a comparison failed; ``passed``: none failed and at least one passed against
        something independent of the graph; else ``not verified`` (zero comparisons, or
        self-consistency only)."""
        if any(r.status == "FAIL" for r in self.rows):
            return "failed"
        if any(r.status == "pass" and r.independent for r in self.rows):
            return "passed"
        return "not verified"

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    @property
    def exit_code(self) -> int:
        """The command's exit code: 0 passed, 1 failed, 3 not verified (2 is bad input, raised before)."""
        return VERDICT_EXIT_CODES[self.verdict]

    def failure(self) -> str:
        """Why the report does not pass, in one line ("" when it passes)."""
        failed = [r for r in self.rows if r.status == "FAIL"]
        if failed:
            return f"{len(failed)} comparison(s) failed (first: {failed[0].backend} {failed[0].output})"
        if not any(r.status == "pass" for r in self.rows):
            return ("nothing was compared (no output or norm could be checked), so nothing is verified; see the "
                    "notes, and " + (self.unverified or "compare outputs with a second backend or a PyTorch source"))
        if not self.passed:
            return self.unverified or ("only self-consistency was checked (each norm against the oracle of the graph's "
                                       "own spec); compare with a second backend or pass --source DIR")
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "source": self.source, "reference": self.reference, "inputs": self.inputs,
            "backends": self.backends, "verdict": self.verdict, "passed": self.passed, "failure": self.failure(),
            "not_verified": self.unverified,
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
            elif r.result is None and r.detail:  # a detail naming its norm itself (the static contract's) stands alone
                text.append(f"FAIL {r.backend}: {r.detail}" if r.detail.startswith(r.output) else
                            f"FAIL {r.backend} {r.output}: {r.detail}")
        text += [f"note: {n}" for n in self.notes]
        counts = {s: sum(r.status == s for r in self.rows) for s in ("pass", "FAIL", "skipped")}
        text.append(f"\n{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} skipped")
        if self.verdict == "failed":
            text.append(f"FAIL: {self.failure()}")
        elif self.verdict == "not verified":
            text.append(f"NOT VERIFIED: {self.failure()}")
        elif self.unverified:
            text.append(f"not verified: {self.unverified}")
        return "\n".join(text)

    def backends_ran(self) -> list[str]:
        return [b for b in self.backends if any(b in n.ran for n in self.norms)]


def _num(value: float) -> str:
    return f"{value:.3g}"
