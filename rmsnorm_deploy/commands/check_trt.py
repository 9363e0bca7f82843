"""Check, without TensorRT, whether the ONNX parser of given TensorRT versions imports a
model exactly: ops it has no importer for (RMSNormalization before 10.15, ONNX Runtime's
SimplifiedLayerNormalization and com.microsoft ops always), opsets above what a version
supports, several overloads of one local function (the parser keys functions by name), and
float64 arithmetic (TensorRT computes it in float32), each with the fix. The graph must first
pass ``onnx.checker``'s full check (no cycle, no undefined tensor, valid attributes, its
external data present). Exit code 1 if any version would not import the model, 2 for bad
input (an invalid graph included)."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rmsnorm_deploy.tensorrt.compat import DEFAULT_VERSIONS

    parser.add_argument("model", metavar="MODEL.onnx", help="the ONNX model to check")
    parser.add_argument("--trt-version", action="append", metavar="X.Y", dest="versions",
                        help=f"TensorRT version(s) to check against (repeatable; default: {', '.join(DEFAULT_VERSIONS)})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from rmsnorm_deploy.graph.onnx_file import check_graph, load_onnx
    from rmsnorm_deploy.table import format_table
    from rmsnorm_deploy.tensorrt.compat import (
        DEFAULT_VERSIONS,
        check_model,
        parse_version,
        summarize,
    )

    versions = args.versions or list(DEFAULT_VERSIONS)
    for v in versions:
        parse_version(v)  # one-line error before reading the model
    # Ops without an ONNX schema (ONNX Runtime's) are the compatibility check's to report, with the fix.
    check_graph(args.model, unknown_ops_ok=True)
    model = load_onnx(args.model, load_external=False)
    reports = check_model(model, versions)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=1))
    else:
        rows = [row for r in reports for row in summarize(r)]
        for r in reports:
            status = "imports" if r.imports else "would NOT import"
            print(f"TensorRT {r.version}: {status}")
        if rows:
            print()
            print(format_table(["tensorrt", "op", "node(s)", "problem", "fix", "blocks"], rows))
    return 0 if all(r.imports for r in reports) else 1
