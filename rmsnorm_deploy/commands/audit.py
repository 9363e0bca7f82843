"""List every RMSNorm and LayerNorm reduction of an ONNX graph (ours or any tool's): the dtype
its squares and its sum are computed in, its epsilon and axes, its placement (pre, post,
sublayer_output, qk, final, other: ``graph/placement.py``), as written and after ONNX
Runtime's graph optimizations (the graph ONNX Runtime actually runs).

Exit code 1 if any reduction accumulates in float16 or bfloat16 or cannot compute a correct result
(an epsilon that is NaN, infinite, zero or negative), or on a contract error: in
our exports, a norm the graph places other than the source model did (the metadata records
it) or a mean-subtracting LayerNorm where the metadata says RMSNorm. A LayerNormalization
with a zero bias in any graph is a warning (it may be a substituted RMSNorm). 2 on bad input."""

from __future__ import annotations

import argparse
import json
import sys

from rmsnorm_deploy.commands import add_result_options, check_result_output


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
    from rmsnorm_deploy.errors import UserError
    from rmsnorm_deploy.graph.onnx_file import atomic_path
    from rmsnorm_deploy.validate.audit import audit_file

    check_result_output(args, args.model, args.model + ".data")
    levels = [lvl for lvl in (args.optimization or ["all"]) if lvl != "none"]
    if args.optimization and "none" in args.optimization and levels:
        raise UserError("--optimization none audits the graph as written only; do not combine it with levels")
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    report = audit_file(args.model, levels=levels, providers=providers, onnxruntime_version=args.onnxruntime_version)
    data = report.to_dict()
    print(json.dumps(data, indent=1) if args.json else report.table())
    if args.output:
        with atomic_path(args.output, force=args.force) as tmp:
            tmp.write_text(json.dumps(data, indent=1))
    if report.exit_code == 2:
        print(f"rmsnorm-deploy audit: error: {report.errors[0]}", file=sys.stderr)
    return report.exit_code
