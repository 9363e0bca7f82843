"""Print the environment: Python and package versions, the GPU, driver and CUDA (torch's build
and the runtime library the loader finds), ONNX Runtime's providers and whether its CUDA and
TensorRT providers really load, TensorRT, Triton and whether our TensorRT plugin loads. Never
fails on a missing optional piece: it says it is missing. With --require-gpu, a machine without
a usable CUDA GPU is an error (exit 2), after the table is printed."""

from __future__ import annotations

import argparse
import json

from rmsnorm_deploy.commands import add_result_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_result_options(parser, "environment")
    parser.add_argument("--require-gpu", action="store_true",
                        help="exit with code 2 unless a CUDA GPU is visible (for the Docker image's suite)")


def run(args: argparse.Namespace) -> int:
    from rmsnorm_deploy.environment import collect, require_gpu
    from rmsnorm_deploy.graph.onnx_file import atomic_path, ensure_writable
    from rmsnorm_deploy.table import format_table

    if args.output:
        ensure_writable(args.output, force=args.force)
    info = collect()
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(format_table(["what", "value"], list(info.items())))
    if args.output:
        with atomic_path(args.output, force=args.force) as tmp:
            tmp.write_text(json.dumps(info, indent=1) + "\n")
    if args.require_gpu:
        require_gpu(info)
    return 0
