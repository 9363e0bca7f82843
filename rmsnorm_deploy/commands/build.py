"""Build a TensorRT engine from an ONNX model: strongly typed (precision is what the graph
says), one optimization profile from the model's dynamic dims, a timing cache, and a check
that every norm's reduction runs in float32 in TensorRT's network and in the built engine.
Writes ENGINE and ENGINE.json (TensorRT version, GPU, profile, plugin) atomically. Exit code 1
if a norm's reduction would run in float16/bfloat16, 2 for bad input."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL.onnx", help="the ONNX model (its external data stays beside it)")
    parser.add_argument("-o", "--output", metavar="ENGINE",
                        help="engine path (default: MODEL.engine beside the model, MODEL.plugin.engine with --plugin)")
    parser.add_argument("--profile", action="append", metavar="NAME:MIN,OPT,MAX", default=[],
                        help="range of a dynamic dim, e.g. d0:1,64,256 (repeatable; default: the model's metadata)")
    parser.add_argument("--plugin", action="store_true",
                        help="run every rmsnorm_deploy::RMSNorm node as the fused RMSNorm plugin")
    parser.add_argument("--plugin-impl", choices=("aot", "jit"), default="aot",
                        help="with --plugin: aot = the kernel compiled into the engine, which runs without Python "
                        "(default; TensorRT >= 10.9), jit = the kernel called from Python at run time")
    parser.add_argument("--timing-cache", metavar="PATH", help="tactic timing cache: read if present, updated after")
    parser.add_argument("--workspace", metavar="SIZE", help="workspace memory limit, e.g. 4G or 512M")
    parser.add_argument("--force", action="store_true", help="replace an existing engine and sidecar")
    parser.add_argument("--no-progress", action="store_true", help="do not draw the build progress bar")
    parser.add_argument("--json", metavar="PATH", help="also write the build report as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    from rmsnorm_deploy.tensorrt.build import build_engine

    report = build_engine(
        args.model,
        args.output,
        profiles=args.profile,
        plugin=args.plugin,
        plugin_impl=args.plugin_impl,
        timing_cache=args.timing_cache,
        workspace=args.workspace,
        force=args.force,
        progress=not args.no_progress,
    )
    print(report.summary())
    if args.json:
        from rmsnorm_deploy.graph.onnx_file import atomic_path

        with atomic_path(args.json, force=True) as tmp:
            tmp.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return 0
