"""``audit_file``: every norm reduction of a model file, as written and as ONNX Runtime runs it.

The graph as written is read by ``graph.audit``; the graph ONNX Runtime runs after its
optimizations comes from ``runners.onnxruntime.optimized_graph`` and is audited the same way,
each reduction placed (``graph.placement``). The contract findings of our own exports (a
placement that differs from the source model's, a LayerNorm where the metadata says RMSNorm)
join them, and in a weight-only quantized graph the MatMuls with their bits, block size and
accuracy level (``graph.quantized``). ``AuditReport`` holds the result, its table, its JSON and the
command's exit code.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import onnx

from rmsnorm_deploy.errors import MissingDependencyError, ProviderError, UserError
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_file import load_onnx
from rmsnorm_deploy.graph.placement import Finding, assign_placements, contract_findings
from rmsnorm_deploy.graph.quantized import INTEGER_OP, NBITS_OP, QuantizedMatMul, matmul_rows, matmul_weights
from rmsnorm_deploy.graph.reductions import Reduction, broken_reductions, low_precision_reductions
from rmsnorm_deploy.runners.onnxruntime import optimized_graph, set_onnxruntime_log_level
from rmsnorm_deploy.table import format_table

#: ONNX Runtime's graph optimization levels an audit can be run after.
LEVELS = ("disable", "basic", "extended", "all")


def audit_after_onnxruntime(model: onnx.ModelProto | str | os.PathLike, *, optimization: str = "all",
                            providers: Iterable[str] = ("cpu",),
                            onnxruntime_version: str | None = None) -> list[Reduction]:
    """Audit the graph ONNX Runtime runs: the model after its graph optimizations."""
    optimized = optimized_graph(model, optimization=optimization, providers=providers)
    return audit_model(optimized, stage=f"after onnxruntime ({optimization})", onnxruntime_version=onnxruntime_version)


@dataclasses.dataclass
class AuditReport:
    model: str
    providers: list[str]
    onnxruntime_version: str | None
    levels: list[str]
    reductions: list[Reduction]
    findings: list[Finding]
    #: levels that could not be audited (ONNX Runtime refused the graph), one line each
    errors: list[str]
    #: every MatMul with constant weights and how they are held (``graph.quantized``)
    matmuls: list[QuantizedMatMul] = dataclasses.field(default_factory=list)

    @property
    def low_precision(self) -> list[Reduction]:
        return low_precision_reductions(self.reductions)

    @property
    def broken(self) -> list[Reduction]:
        return broken_reductions(self.reductions)

    @property
    def exit_code(self) -> int:
        """1: a half-precision or broken reduction, or a contract error; 2: a level not audited; else 0."""
        if self.low_precision or self.broken or any(f.level == "error" for f in self.findings):
            return 1
        return 2 if self.errors else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "providers": self.providers, "onnxruntime_version": self.onnxruntime_version,
            "reductions": [r.to_dict() for r in self.reductions], "low_precision": len(self.low_precision),
            "broken": len(self.broken), "errors": self.errors, "findings": [f.to_dict() for f in self.findings],
            "matmuls": [m.to_dict() for m in self.matmuls],
        }

    def table(self) -> str:
        headers = ["stage", "norm", "kind", "placement", "op", "input", "accumulates", "epsilon", "axes", "note"]
        rows = [[r.stage, r.node, r.kind, r.placement or "-", r.op, r.input_dtype,
                 r.precision + (" LOW" if r.low_precision else ""),
                 "-" if r.epsilon is None else f"{r.epsilon:.3g}", r.axes,
                 "; ".join(t for t in (r.note, "BROKEN" if r.problem else "") if t)] for r in self.reductions]
        lines = [format_table(headers, rows) if rows else "no normalization reduction found"]
        if any(m.op in (NBITS_OP, INTEGER_OP) for m in self.matmuls):  # a quantized graph: its MatMuls beside its norms
            lines.append(format_table(["matmuls", "op", "weights", "block size", "accuracy_level", "computes in"],
                                      matmul_rows(self.matmuls)))
        lines += [f"error: {error}" for error in self.errors]
        lines += [f"error: {r.stage}: norm {r.node}: {r.problem}" for r in self.broken]
        lines += [f"{f.level}: norm {f.norm}: {f.message}" for f in self.findings]
        stages = ["as written"] + [f"after onnxruntime ({lvl})" for lvl in self.levels]
        lines.append(f"\n{len(self.reductions)} reductions ({', '.join(stages)}); {len(self.low_precision)} accumulate "
                     "in float16 or bfloat16" + (f"; {len(self.broken)} cannot give a correct result"
                                                 if self.broken else ""))
        return "\n".join(lines)


def check_version_text(version: str | None) -> None:
    if version is not None and not all(part.isdigit() for part in version.split(".")[:2]):
        raise UserError(f"--onnxruntime-version {version!r} is not a version like 1.26 or 1.26.0")


def audit_file(path: str | os.PathLike, *, levels: Sequence[str] = ("all",), providers: Sequence[str] = ("cpu",),
               onnxruntime_version: str | None = None) -> AuditReport:
    """Audit the model at ``path`` as written, then after each ONNX Runtime optimization level of
    ``levels`` on ``providers`` (an empty ``levels``: as written only)."""
    unknown = [lvl for lvl in levels if lvl not in LEVELS]
    if unknown:
        raise UserError(f"unknown optimization level {unknown[0]!r}; choose from {', '.join(LEVELS)}")
    check_version_text(onnxruntime_version)
    model = load_onnx(path, load_external=False)
    reductions = audit_model(model, onnxruntime_version=onnxruntime_version)
    findings = contract_findings(model, reductions, ModelMetadata.read(model), base_dir=Path(path).parent)
    errors: list[str] = []
    if levels:
        set_onnxruntime_log_level()
    for level in levels:
        try:
            optimized = optimized_graph(path, optimization=level, providers=providers)
            after = audit_model(optimized, stage=f"after onnxruntime ({level})", onnxruntime_version=onnxruntime_version)
            assign_placements(optimized, after)
            reductions += after
        except (MissingDependencyError, ProviderError):
            raise
        except UserError as exc:
            errors.append(f"after onnxruntime ({level}) on {','.join(providers)}: not audited: {exc}")
    return AuditReport(str(path), list(providers) if levels else [], onnxruntime_version, list(levels), reductions,
                       findings, errors, matmul_weights(model))
