"""Build the standalone RMSNorm model of each lowering for each spec and dtype, run it in
ONNX Runtime CPU on seeded inputs, and print its parity with the float64 oracle and the torch
reference, with the op ONNX Runtime actually ran. Exit code 1 if any case fails."""

from __future__ import annotations

import argparse
import json

from rmsnorm_deploy.contract.dtypes import MODEL_DTYPES
from rmsnorm_deploy.graph.lowerings import LOWERINGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rmsnorm_deploy.contract.spec import named_specs

    parser.add_argument("--spec", action="append", choices=sorted(named_specs()), help="spec(s) to check (default: all)")
    parser.add_argument("--dtype", action="append", choices=MODEL_DTYPES, help="dtype(s) (default: all)")
    parser.add_argument("--lowering", action="append", choices=LOWERINGS, help="lowering(s) (default: all)")
    parser.add_argument("--optimization", action="append", choices=("disable", "basic", "extended", "all"),
                        help="ONNX Runtime graph optimization level(s) (default: disable and all)")
    parser.add_argument("--shape", default="199x760", help="input shape, e.g. 199x760 or 2x64x4096 (default 199x760)")
    parser.add_argument("--inputs", action="append", choices=("normal", "stress"),
                        help="input kind(s): normal activations or stress values of 300..60000 (default: both)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--force", action="store_true", help="replace --json PATH if it exists")


def run(args: argparse.Namespace) -> int:
    from rmsnorm_deploy.contract.spec import named_specs
    from rmsnorm_deploy.errors import UserError
    from rmsnorm_deploy.validate.lowering_sweep import (
        cases,
        check_case_memory,
        run_case,
        summary_table,
        sweep_table,
    )

    if args.json:
        from rmsnorm_deploy.graph.onnx_file import ensure_writable

        ensure_writable(args.json, force=args.force)  # before the sweep, not after it
    try:
        shape = tuple(int(d) for d in args.shape.lower().split("x"))
    except ValueError:
        raise UserError(f"--shape {args.shape!r} is not a shape; write it like 199x760") from None
    if not shape or min(shape) < 1:
        raise UserError(f"--shape {args.shape!r}: every dim must be an integer >= 1, e.g. 199x760")
    check_case_memory(shape, f"--shape {args.shape}")
    specs = named_specs()
    if args.spec:
        specs = {k: specs[k] for k in args.spec}
    rows = [
        run_case(c)
        for c in cases(
            specs,
            args.dtype or list(MODEL_DTYPES),
            args.lowering or list(LOWERINGS),
            args.optimization or ["disable", "all"],
            [shape],
            args.inputs or ["normal", "stress"],
        )
    ]
    print(sweep_table(rows))
    print("\nSummary per lowering and dtype (worst case over specs and inputs):\n" + summary_table(rows))
    failed = [r for r in rows if r.failed]
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "FAIL", "refused", "unsupported")}
    print(f"\n{counts['pass']} passed, {counts['FAIL']} failed, {counts['refused']} refused by the lowering, "
          f"{counts['unsupported']} not runnable by ONNX Runtime CPU")
    if args.json:
        from rmsnorm_deploy.graph.onnx_file import atomic_path

        with atomic_path(args.json, force=args.force) as tmp:
            tmp.write_text(json.dumps([r.to_dict() for r in rows], indent=1))
    return 1 if failed else 0
