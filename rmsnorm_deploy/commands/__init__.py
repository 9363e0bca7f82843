"""One module per ``rmsnorm-deploy`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``.

A command imports what it runs inside ``run``, not at the top: the parser imports every command
module, and ``rmsnorm-deploy --help`` must not load torch, onnxruntime or transformers (start-up time).

===========  ==================================================================================
export       a preset or Hugging Face folder to ONNX, with parity (``exporter.plan`` checks first)
validate     a model on each backend against its source or float64 oracle
audit        every norm reduction, its dtype and placement, as written and after ONNX Runtime
sweep        the standalone model of each lowering in ONNX Runtime CPU against the float64 oracle
             (formerly ``parity``)
build        a strongly typed TensorRT engine
check_trt    what a TensorRT version's parser imports, without TensorRT
generate     tokens from a KV-cache model (``decoder.generate``), with its timings
perplexity   a KV-cache model's perplexity over a text, and its KL divergence from a reference export
serve        Triton Inference Server (embedded through PyTriton) in front of ONNX Runtime
triton_repo  a model repository for the standalone Triton Inference Server
env          versions, GPU, providers, TensorRT and the plugin
===========  ==================================================================================
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_result_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json``, ``--output PATH`` and ``--force``: how a command that prints a table of ``what``
    also gives it as JSON, on stdout or to a file it does not clobber unasked."""
    parser.add_argument("--json", action="store_true", help=f"print the {what} as JSON instead of the table")
    parser.add_argument("--output", metavar="PATH", help=f"also write the {what} as JSON to PATH")
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")


def check_result_output(args: argparse.Namespace, *inputs: str | os.PathLike | None) -> None:
    """``--output`` may be written (an existing file only with ``--force``) and is none of the
    command's ``inputs`` (the model, its ``.data`` file, a feed): ``--force`` replaces a result,
    never what the command read."""
    from rmsnorm_deploy.errors import OutputExistsError
    from rmsnorm_deploy.graph.onnx_file import ensure_writable

    if not args.output:
        return
    out = Path(args.output)
    for given in filter(None, inputs):
        path = Path(given)
        same = os.path.samefile(out, path) if out.exists() and path.exists() else out.resolve() == path.resolve()
        if same:
            raise OutputExistsError(f"--output {out} is the command's input {path}; write the results to another file")
    ensure_writable(out, force=args.force)
