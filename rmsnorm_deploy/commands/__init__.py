"""One module per ``rmsnorm-deploy`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``.

===========  ==================================================================================
export       a preset or Hugging Face folder to ONNX, with parity (``exporter.plan`` checks first)
validate     a model on each backend against its source or float64 oracle
audit        every norm reduction, its dtype and placement, as written and after ONNX Runtime
sweep        the standalone model of each lowering in ONNX Runtime CPU against the float64 oracle
             (formerly ``parity``)
build        a strongly typed TensorRT engine
check_trt    what a TensorRT version's parser imports, without TensorRT
generate     tokens from a KV-cache model (``decoder.generate``), with its timings
serve        Triton Inference Server (embedded through PyTriton) in front of ONNX Runtime
triton_repo  a model repository for the standalone Triton Inference Server
env          versions, GPU, providers, TensorRT and the plugin
===========  ==================================================================================
"""

from __future__ import annotations

import argparse


def add_result_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json``, ``--output PATH`` and ``--force``: how a command that prints a table of ``what``
    also gives it as JSON, on stdout or to a file it does not clobber unasked."""
    parser.add_argument("--json", action="store_true", help=f"print the {what} as JSON instead of the table")
    parser.add_argument("--output", metavar="PATH", help=f"also write the {what} as JSON to PATH")
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")
