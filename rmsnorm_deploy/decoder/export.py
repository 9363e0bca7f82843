"""``export --kv-cache``: which decoder graph is written, its options checked once, and the run.

The norm export (``exporter``) knows nothing of a KV cache: a decoder export is planned here
(:func:`plan_decoder_export`: the export's own checks, then the decoder's, and the serving files
that will be published beside the model), then written by the target's writer:

- ``portable``: the norm export pipeline tracing :class:`~rmsnorm_deploy.decoder.kv_model.KVCacheLM`
  (``portable.KVExport`` is the graph it hands the pipeline);
- ``onnxruntime``: the graph written from the module tree (``ort_graph``: GroupQueryAttention,
  fused projections, exact norm nodes), optionally with weight-only int8/int4 MatMuls
  (``quantize``); a Hugging Face folder is not loaded but streamed tensor by tensor
  (:func:`open_model`, ``streaming``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rmsnorm_deploy.decoder.convention import ORT_DTYPES, TARGETS
from rmsnorm_deploy.decoder.genai_config import GENAI_CONFIG
from rmsnorm_deploy.decoder.ort_export import export_ort_decoder
from rmsnorm_deploy.decoder.portable import KVExport
from rmsnorm_deploy.decoder.quantize import Quantization
from rmsnorm_deploy.decoder.streaming import open_folder
from rmsnorm_deploy.decoder.weights import TensorSource
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.hf_files import HF_FILES
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.exporter.pipeline import run_export
from rmsnorm_deploy.exporter.plan import (
    ExportOptions,
    ExportPlan,
    check_options,
    is_checkpoint_ref,
    load_torch_model,
    plan_export,
)
from rmsnorm_deploy.progress import Progress


@dataclasses.dataclass(frozen=True)
class DecoderOptions:
    """What a KV-cache export adds to :class:`~rmsnorm_deploy.exporter.plan.ExportOptions`."""

    #: ``portable`` (plain ops, for TensorRT and every runtime) or ``onnxruntime``
    #: (``ort_graph``: GroupQueryAttention, fused projections; ONNX Runtime only).
    target: str = "portable"
    #: ``onnxruntime`` target: past and present as one [batch, kv_heads, max_length, head_dim]
    #: buffer (onnxruntime-genai's ``past_present_share_buffer: true``).
    share_buffer: bool = False
    #: ``onnxruntime`` target: weight-only int8/int4 projections (``export --quantize``).
    quantization: Quantization | None = None


@dataclasses.dataclass(frozen=True)
class DecoderPlan:
    """A checked decoder export: the norm export's plan and the decoder's options."""

    export: ExportPlan
    decoder: DecoderOptions


def check_decoder_options(options: ExportOptions, decoder: DecoderOptions) -> None:
    """Every decoder option problem, before any work: one line each."""
    check_options(options)
    if decoder.target not in TARGETS:
        raise UserError(f"unknown --target {decoder.target!r}; choose one of {', '.join(TARGETS)}")
    if decoder.target == "onnxruntime":
        if options.fuse_attention:
            raise UserError("--fuse-attention is for the portable graph; --target onnxruntime already uses ONNX "
                            "Runtime's fused attention (GroupQueryAttention)")
        if options.opset is not None:
            raise UserError("--opset is for the portable graph; the --target onnxruntime graph is written at one opset")
        if options.dtype not in ORT_DTYPES:
            raise UserError(f"--target onnxruntime writes {', '.join(ORT_DTYPES)} graphs (GroupQueryAttention has no "
                            f"{options.dtype} CPU kernel); use --target portable for {options.dtype}")
    if decoder.share_buffer and decoder.target != "onnxruntime":
        raise UserError("--share-buffer is a mode of the --target onnxruntime graph")
    if decoder.quantization is not None and decoder.target != "onnxruntime":
        raise UserError("--quantize writes ONNX Runtime's MatMulNBits, which the portable graph is written without "
                        "(TensorRT has no such kernel); add --target onnxruntime")


def plan_decoder_export(options: ExportOptions, decoder: DecoderOptions = DecoderOptions(), *,
                        model_path: str | os.PathLike | None = None, model_ref: str | None = None,
                        output: str | os.PathLike | None = None) -> DecoderPlan:
    """Check the options and every output path (the model, its report, the serving files) once."""
    check_decoder_options(options, decoder)
    plan = plan_export(options, model_path=model_path, model_ref=model_ref, output=output,
                       extra_files=(GENAI_CONFIG, *HF_FILES))
    return DecoderPlan(plan, decoder)


def open_model(ref: str, plan: DecoderPlan) -> tuple[LoadedModel, TensorSource | None]:
    """MODEL of the CLI for ``plan``: for the onnxruntime target a Hugging Face folder (or a GGUF
    file's converted folder) is opened without its weights, which are streamed from its checkpoint
    (``streaming``); anything else is loaded, and a folder too large for the traced export is refused before its weights are read."""
    dtype = plan.export.options.dtype
    if plan.decoder.target == "onnxruntime" and is_checkpoint_ref(ref):
        return open_folder(ref, dtype)
    return load_torch_model(ref, dtype), None


def run_decoder_export(loaded: LoadedModel, plan: DecoderPlan, *, progress: Progress | None = None,
                       tensors: TensorSource | None = None) -> Any:
    """Write the planned decoder graph: an ``exporter.pipeline.ExportResult`` (portable) or an
    ``ort_export.OrtDecoderExport`` (onnxruntime; ``tensors``: where a streamed model's weights are)."""
    if plan.decoder.target == "onnxruntime":
        return export_ort_decoder(loaded, plan.export, progress=progress, share_buffer=plan.decoder.share_buffer,
                                  quantization=plan.decoder.quantization, tensors=tensors)
    return run_export(loaded, plan.export, progress=progress, graph=KVExport.of)


def export_decoder(loaded: LoadedModel, path: str | os.PathLike, options: ExportOptions,
                   decoder: DecoderOptions = DecoderOptions(), *, progress: Progress | None = None) -> Any:
    """The Python API of ``export --kv-cache``: plan, then write (:func:`run_decoder_export`)."""
    return run_decoder_export(loaded, plan_decoder_export(options, decoder, model_path=path), progress=progress)
