"""List every RMSNorm and LayerNorm reduction of an ONNX graph (ours or any tool's): the dtype
its squares and its sum are computed in, its epsilon and axes, its placement (pre, post,
sublayer_output, qk, final, other: ``graph/placement.py``), as written and after ONNX
Runtime's graph optimizations (the graph ONNX Runtime actually runs). In a weight-only quantized
graph, the MatMuls too: which hold int8/int4 weights (MatMulNBits: bits, block size, accuracy
level and the dtype it computes in) and which float weights (``graph/quantized.py``).

Exit code 1 if any reduction accumulates in float16 or bfloat16 or cannot compute a correct result
(an epsilon that is NaN, infinite, zero or negative), or on a contract error: in
our exports, a norm the graph places other than the source model did (the metadata records
it) or a mean-subtracting LayerNorm where the metadata says RMSNorm. A LayerNormalization
with a zero bias in any graph is a warning (it may be a substituted RMSNorm). 2 on bad input."""

from __future__ import annotations

import argparse
import json

from rmsnorm_deploy.commands import add_result_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the .onnx file")
    parser.add_argument("--optimization", action="append", choices=("disable", "basic", "extended", "all", "none"),
                        help="ONNX Runtime optimization level(s) to audit after (repeatable; default all; none: "
                        "audit the graph as written only)")
    parser.add_argument("--providers", default="cpu",
                        help="ONNX Runtime providers whose optimizations to apply, comma-separated (default cpu; "
                        "the CUDA provider fuses differently from the CPU one)")
    parser.add_argument("--onnxruntime-version", metavar="VERSION",
                        help="judge ONNX Runtime's Skip*LayerNormalization ops (no stash_type) as this version runs "
                        "them, e.g. 1.26 for a deployment pinned to it (default: the installed onnxruntime)")
    add_result_options(parser, "results")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rmsnorm_deploy.graph.audit import (
        audit_model,
        broken_reductions,
        low_precision_reductions,
        optimized_by_onnxruntime,
    )
    from rmsnorm_deploy.graph.metadata import ModelMetadata
    from rmsnorm_deploy.graph.onnx_file import atomic_path, ensure_writable, load_onnx
    from rmsnorm_deploy.graph.placement import assign_placements, contract_findings
    from rmsnorm_deploy.graph.quantized import NBITS_OP, matmul_rows, matmul_weights
    from rmsnorm_deploy.table import format_table

    if args.output:
        ensure_writable(args.output, force=args.force)
    levels = [lvl for lvl in (args.optimization or ["all"]) if lvl != "none"]
    if args.optimization and "none" in args.optimization and levels:
        from rmsnorm_deploy.errors import UserError

        raise UserError("--optimization none audits the graph as written only; do not combine it with levels")
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    version = args.onnxruntime_version
    if version is not None and not all(part.isdigit() for part in version.split(".")[:2]):
        from rmsnorm_deploy.errors import UserError

        raise UserError(f"--onnxruntime-version {version!r} is not a version like 1.26 or 1.26.0")
    model = load_onnx(args.model, load_external=False)
    reductions = audit_model(model, onnxruntime_version=version)
    findings = contract_findings(model, reductions, ModelMetadata.read(model), base_dir=Path(args.model).parent)
    errors: list[str] = []
    if levels:
        from rmsnorm_deploy.errors import (
            MissingDependencyError,
            ProviderError,
            UserError,
        )
        from rmsnorm_deploy.runners.onnxruntime import set_onnxruntime_log_level

        set_onnxruntime_log_level()
        for level in levels:
            try:
                optimized = optimized_by_onnxruntime(args.model, optimization=level, providers=providers)
                after = audit_model(optimized, stage=f"after onnxruntime ({level})", onnxruntime_version=version)
                assign_placements(optimized, after)
                reductions += after
            except (MissingDependencyError, ProviderError):
                raise
            except UserError as exc:
                errors.append(f"after onnxruntime ({level}) on {','.join(providers)}: not audited: {exc}")
    low = low_precision_reductions(reductions)
    broken = broken_reductions(reductions)
    matmuls = matmul_weights(model)
    data = {
        "model": str(args.model),
        "providers": providers if levels else [],
        "onnxruntime_version": version,
        "reductions": [r.to_dict() for r in reductions],
        "low_precision": len(low),
        "broken": len(broken),
        "errors": errors,
        "findings": [f.to_dict() for f in findings],
        "matmuls": [m.to_dict() for m in matmuls],
    }
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        headers = ["stage", "norm", "kind", "placement", "op", "input", "accumulates", "epsilon", "axes", "note"]
        rows = [[r.stage, r.node, r.kind, r.placement or "-", r.op, r.input_dtype,
                 r.precision + (" LOW" if r.low_precision else ""),
                 "-" if r.epsilon is None else f"{r.epsilon:.3g}", r.axes,
                 "; ".join(t for t in (r.note, "BROKEN" if r.problem else "") if t)] for r in reductions]
        print(format_table(headers, rows) if rows else "no normalization reduction found")
        if any(m.op == NBITS_OP for m in matmuls):  # a quantized graph: its MatMuls beside its norms
            print(format_table(["matmuls", "op", "weights", "block size", "accuracy_level", "computes in"],
                               matmul_rows(matmuls)))
        stages = ["as written"] + [f"after onnxruntime ({lvl})" for lvl in levels]
        for error in errors:
            print(f"error: {error}")
        for r in broken:
            print(f"error: {r.stage}: norm {r.node}: {r.problem}")
        for finding in findings:
            print(f"{finding.level}: norm {finding.norm}: {finding.message}")
        print(f"\n{len(reductions)} reductions ({', '.join(stages)}); {len(low)} accumulate in float16 or bfloat16"
              + (f"; {len(broken)} cannot give a correct result" if broken else ""))
    if args.output:
        with atomic_path(args.output, force=args.force) as tmp:
            tmp.write_text(json.dumps(data, indent=1))
    if low or broken or any(f.level == "error" for f in findings):
        return 1
    if errors:
        import sys

        print(f"rmsnorm-deploy audit: error: {errors[0]}", file=sys.stderr)
        return 2
    return 0
