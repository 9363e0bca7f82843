"""Print the environment: Python and package versions, GPU and driver, ONNX Runtime's
providers, TensorRT and whether our plugin loads. Never fails on a missing optional piece:
it says it is missing."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--require-gpu", action="store_true",
                        help="exit with code 2 unless a CUDA GPU is visible (for the Docker image's suite)")


def run(args: argparse.Namespace) -> int:
    from rmsnorm_deploy.environment import collect, require_gpu
    from rmsnorm_deploy.table import format_table

    info = collect()
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(format_table(["what", "value"], sorted(info.items())))
    if args.require_gpu:
        require_gpu(info)
    return 0
