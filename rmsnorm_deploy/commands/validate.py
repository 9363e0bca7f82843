"""Run an ONNX model on each backend and compare it with its reference: the PyTorch source
rebuilt from the model's metadata (a model this project exported) or, for any other graph,
the other backends; every RMSNorm and LayerNorm in the graph is also checked on its own
against the float64 oracle of the spec it implies. Prints a table of backend x output with
max abs/rel and ULP error, the tolerance used and pass/fail. Exit code 1 on a parity
failure, 2 on bad input (file, inputs, a backend that is not available)."""

from __future__ import annotations

import argparse
import json

from rmsnorm_deploy.commands import add_result_options, check_result_output

_BACKEND_HELP = (
    "comma-separated backends: cpu, cuda, tensorrt (ONNX Runtime's CPU, CUDA and TensorRT execution providers), "
    "trt (a TensorRT engine built from the model), trt-plugin (the same with our RMSNorm plugin); default cpu"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the .onnx file")
    parser.add_argument("--providers", default="cpu", help=_BACKEND_HELP)
    parser.add_argument("--reference", choices=("auto", "torch", "float64"), default="auto",
                        help="what outputs are compared with: a whole exported model is always held to the float64 run "
                        "of its rebuilt PyTorch source (no farther from it than the source in its own dtype is, "
                        "times the table's bound); for a standalone norm, torch = its source in the model's dtype, "
                        "float64 = its oracle; auto = the source when the model has our metadata, else the first "
                        "backend (default)")
    parser.add_argument("--inputs", choices=("normal", "stress"), default="normal",
                        help="generated activations: normal N(0, 2^2), or stress values of 300..60000 whose squares "
                        "overflow float16, with all-zero rows (default normal)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0)")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                        help="size of a dynamic dim for the generated inputs, e.g. --dim batch=2 (repeatable)")
    parser.add_argument("--feed", metavar="INPUTS.npz", help="use these inputs (one array per model input) instead "
                        "of generated ones")
    parser.add_argument("--optimization", choices=("disable", "basic", "extended", "all"), default="all",
                        help="ONNX Runtime graph optimization level (default all, what a deployment runs)")
    parser.add_argument("--provider-option", action="append", default=[], metavar="PROVIDER:KEY=VALUE",
                        help="an ONNX Runtime provider option, e.g. cuda:device_id=1 or "
                        "tensorrt:trt_engine_cache_enable=1 (repeatable)")
    parser.add_argument("--require-all-nodes-on-provider", action="store_true",
                        help="fail (exit 2, naming the nodes) when ONNX Runtime runs any compute node on a provider "
                        "other than the requested one, e.g. a node CUDA has no kernel for falling back to the CPU; "
                        "nodes per provider are reported either way")
    parser.add_argument("--source", metavar="HF_FOLDER",
                        help="the Hugging Face folder the model was exported from (the metadata's own folder is "
                        "used only when it lies inside the model's folder: metadata is not trusted to open others)")
    parser.add_argument("--no-norms", action="store_true", help="compare outputs only, not each norm on its own")
    add_result_options(parser, "results")


def parse_provider_options(items: list[str]) -> dict[str, dict[str, str]]:
    from rmsnorm_deploy.errors import UserError

    options: dict[str, dict[str, str]] = {}
    for item in items:
        provider, sep, rest = item.partition(":")
        key, eq, value = rest.partition("=")
        if not sep or not eq or not provider.strip() or not key.strip():
            raise UserError(f"--provider-option {item!r} is not PROVIDER:KEY=VALUE, e.g. cuda:device_id=1")
        options.setdefault(provider.strip(), {})[key.strip()] = value.strip()
    return options


def run(args: argparse.Namespace) -> int:
    from rmsnorm_deploy.graph.onnx_file import atomic_path
    from rmsnorm_deploy.validate.backends import parse_backends
    from rmsnorm_deploy.validate.feeds import parse_dims
    from rmsnorm_deploy.validate.run import validate_model

    backends = parse_backends(args.providers)
    check_result_output(args, args.model, args.model + ".data", args.feed)
    if any(b in ("cpu", "cuda", "tensorrt") for b in backends):
        from rmsnorm_deploy.runners.onnxruntime import set_onnxruntime_log_level

        set_onnxruntime_log_level()
    report = validate_model(
        args.model,
        providers=backends,
        reference=args.reference,
        inputs=args.inputs,
        seed=args.seed,
        dims=parse_dims(args.dim),
        feed_path=args.feed,
        optimization=args.optimization,
        provider_options=parse_provider_options(args.provider_option),
        check_norms=not args.no_norms,
        require_all_nodes_on_provider=args.require_all_nodes_on_provider,
        source=args.source,
    )
    data = report.to_dict()
    print(json.dumps(data, indent=1) if args.json else report.table())
    if args.output:
        with atomic_path(args.output, force=args.force) as tmp:
            tmp.write_text(json.dumps(data, indent=1))
    return 0 if report.passed else 1
