"""The ``rmsnorm-deploy`` command line.

Each subcommand lives in ``rmsnorm_deploy/commands/<name>.py`` with ``add_arguments(parser)``
and ``run(args) -> int``; building the parser imports no optional dependency, so ``--help``
works with only torch, onnx and onnxscript installed. Errors the user can fix print one line
and exit with code 2; a failed parity check exits with code 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from rmsnorm_deploy.resources import __version__
from rmsnorm_deploy.errors import UserError

#: command name -> (module under rmsnorm_deploy.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sweep": ("sweep", "build the standalone RMSNorm model of each lowering, run it in ONNX Runtime CPU against the "
              "float64 oracle, print the table"),
    "validate": ("validate", "run a model on each backend (ONNX Runtime CPU/CUDA/TensorRT, TensorRT) and compare it with "
                 "its PyTorch source or float64 oracle; exit 1 on a parity failure"),
    "audit": ("audit", "list every RMSNorm/LayerNorm reduction and the dtype it accumulates in, as written and after "
              "ONNX Runtime's optimizations; exit 1 if any is float16/bfloat16"),
    "export": ("export", "export a pre-norm model (preset or Hugging Face folder) to ONNX, every RMSNorm exact; check parity"),
    "generate": ("generate", "generate tokens with a KV-cache model (export --kv-cache) in ONNX Runtime: greedy or "
                 "sampled, past/present bound with IOBinding; prints prefill ms, decode ms/token, tokens/s"),
    "env": ("env", "print the environment: versions, GPU, ONNX Runtime providers, TensorRT, plugin"),
    "build": ("build", "build a strongly typed TensorRT engine from an ONNX model and check where its norms run"),
    "check-trt": ("check_trt", "check without TensorRT whether a TensorRT version's ONNX parser imports a model"),
    "serve": ("serve", "serve an exported model with Triton Inference Server (embedded): KServe v2 HTTP/gRPC, dynamic "
              "batching, ONNX Runtime inside"),
    "triton-repo": ("triton_repo", "write a model repository for the standalone Triton Inference Server "
                    "(onnxruntime or tensorrt backend) from an exported model or engine"),
}

#: old command name -> its name now; the old one still works, with a note on stderr
RENAMED: dict[str, str] = {"parity": "sweep"}


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rmsnorm-deploy",
        description="RMSNorm from PyTorch to ONNX, ONNX Runtime and TensorRT with its numerics guaranteed.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"rmsnorm_deploy.commands.{module_name}")
        aliases = [old for old, new in RENAMED.items() if new == name]
        cmd = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(), aliases=aliases)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    if args.command in RENAMED:
        print(f"rmsnorm-deploy: note: `{args.command}` is now `{RENAMED[args.command]}`; the old name still works "
              "but will be removed", file=sys.stderr)
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"rmsnorm-deploy {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"rmsnorm-deploy {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
