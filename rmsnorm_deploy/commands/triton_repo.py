"""Write a model repository for the standalone Triton Inference Server (NGC tritonserver image):
REPO/<name>/config.pbtxt and REPO/<name>/1/ with the model, served by Triton's native onnxruntime
backend (an .onnx model or export folder) or tensorrt backend (an engine from `rmsnorm-deploy build`,
with its sidecar). Stateless graphs get dynamic batching; KV-cache graphs get sequence batching with
the cache as implicit state. The config is checked by parsing it into Triton's ModelConfig. Serve it
with docker/triton/serve_and_check.sh."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_OR_ENGINE",
                        help="an exported model folder, its model.onnx, or a TensorRT .engine with its sidecar")
    parser.add_argument("-o", "--output", required=True, metavar="REPO", help="the model repository folder")
    parser.add_argument("--force", action="store_true", help="replace REPO/<name> if it exists")
    parser.add_argument("--model-name", default="model", help="the model's name and folder (default model)")
    parser.add_argument("--max-batch", type=int, metavar="N",
                        help="max_batch_size for stateless graphs (default: the model's batch range, else 8; 0: no "
                        "batching)")
    parser.add_argument("--instances", type=int, default=1, metavar="N", help="instances of the model (default 1)")
    parser.add_argument("--kind", choices=("cpu", "gpu"), default=None,
                        help="where instances run (default: gpu for an engine, cpu for ONNX)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rmsnorm_deploy.serving.triton.repository import RepoOptions, write_repository

    kind = args.kind or ("gpu" if Path(args.model).suffix in (".engine", ".plan") else "cpu")
    options = RepoOptions(model_name=args.model_name, max_batch=args.max_batch, instances=args.instances, kind=kind)
    target = write_repository(args.model, args.output, options, force=args.force)
    print(f"wrote {target}/config.pbtxt and {target}/1/")
    print((target / "config.pbtxt").read_text(), end="")
    print(f"serve it: docker/triton/serve_and_check.sh {Path(args.output).resolve()} {args.model_name}")
    return 0
