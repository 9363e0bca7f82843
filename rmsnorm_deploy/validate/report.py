"""What ``validate`` reports: one row per comparison, one entry per norm, the whole report."""

from __future__ import annotations

import dataclasses
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
        return dataclasses.asdict(self)


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
    placement: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not any(r.status == "FAIL" for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "source": self.source, "reference": self.reference, "inputs": self.inputs,
            "backends": self.backends, "passed": self.passed, "rows": [r.to_dict() for r in self.rows],
            "norms": [n.to_dict() for n in self.norms], "notes": self.notes, "nodes_per_provider": self.placement,
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
            body.append([r.backend, r.output, r.against, res.dtype, _num(res.max_abs), _num(res.max_rel),
                         _num(res.max_ulp), res.tolerance.describe(), status])
        text = [f"model: {self.model}", f"source: {self.source}", f"reference: {self.reference}",
                "inputs: " + ", ".join(f"{k} {v['dtype']}{v['shape']} ({v['kind']})" for k, v in self.inputs.items()),
                *[f"nodes per provider, {b}: " + ", ".join(f"{n} on {p}" for p, n in c.items())
                  for b, c in self.placement.items()],
                "", format_table(headers, body)]
        if self.norms:
            norm_headers = ["norm", "kind", "as written", "accumulates", "epsilon", "axes", *self.backends_ran(), "spec"]
            norm_body = [[n.name, n.kind, n.op, n.precision, "-" if n.epsilon is None else f"{n.epsilon:.3g}",
                          n.axes, *[n.ran.get(b, "-") for b in self.backends_ran()], n.spec] for n in self.norms]
            text += ["", format_table(norm_headers, norm_body)]
        failed = [r for r in self.rows if r.status == "FAIL"]
        for r in failed:
            if r.result is not None and r.result.first_bad:
                text.append(f"FAIL {r.backend} {r.output}: {r.result.summary()}")
        text += [f"note: {n}" for n in self.notes]
        counts = {s: sum(r.status == s for r in self.rows) for s in ("pass", "FAIL", "skipped")}
        text.append(f"\n{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} skipped")
        return "\n".join(text)

    def backends_ran(self) -> list[str]:
        return [b for b in self.backends if any(b in n.ran for n in self.norms)]


def _num(value: float) -> str:
    return f"{value:.3g}"
