"""``export --kv-cache --target onnxruntime``: write the graph streaming, audit it, publish it, check it.

The weights go straight from their source (the modules, or the checkpoint's safetensors files
for a folder: ``streaming``) into a staged external-data file in the output folder, block by
block; the graph itself is then small and saved atomically with that file moved in beside it
(``graph.onnx_file.save_onnx(staged_data=...)``). Then the serving files, and the parity check
(``ort_parity``) against the PyTorch model: the model in memory, or, for a streamed folder, the
model loaded after the graph is written when it fits beside ONNX Runtime's session; when it does
not, one layer at a time (``layer_parity``), and the report says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.decoder import quant_sensitivity, quant_smoothing
from rmsnorm_deploy.decoder.convention import KVCacheLayout
from rmsnorm_deploy.decoder.divergence import QUANTIZATION_TEXT_CHUNKS, quantization_text_cost, text_cost_line
from rmsnorm_deploy.decoder.genai_config import write_serving_files
from rmsnorm_deploy.decoder.layer_parity import LayerParity, layer_parity
from rmsnorm_deploy.decoder.ort_graph import OrtDecoder, build_decoder
from rmsnorm_deploy.decoder.ort_model import causal_lm
from rmsnorm_deploy.decoder.ort_parity import DecodeParity, audit_norms, decode_parity
from rmsnorm_deploy.decoder.ort_writer import ExternalData
from rmsnorm_deploy.decoder.quantize import Quantization, widths_summary
from rmsnorm_deploy.decoder.streaming import reference_fits
from rmsnorm_deploy.decoder.weights import TensorSource
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter import hf
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.graph.metadata import ModelMetadata, tool_versions
from rmsnorm_deploy.graph.onnx_file import atomic_path, save_onnx
from rmsnorm_deploy.progress import Progress


@dataclasses.dataclass
class OrtDecoderExport:
    path: Any
    decoder: OrtDecoder
    parity: DecodeParity | LayerParity | None
    report_path: Any = None
    #: written beside the model: genai_config.json and the source's Hugging Face config/tokenizer files
    serving_files: list[str] = dataclasses.field(default_factory=list)
    #: why the parity check ran layer by layer (a streamed model too large to load beside ONNX Runtime)
    layer_by_layer: str = ""
    #: a quantized graph's perplexity and KL divergence against the unquantized model on the shipped text
    #: (``divergence.quantization_text_cost``), or why they were not measured
    text_cost: dict[str, Any] | None = None

    @property
    def parity_failed(self) -> bool:
        return self.parity is not None and self.parity.failed


def write_ort_decoder(loaded: LoadedModel, path: Path, *, force: bool, tensors: TensorSource | None = None,
                      **build: Any) -> OrtDecoder:
    """The graph of ``loaded`` written to ``path``, its weights streamed into ``<name>.data`` beside it
    as they are made, its norms audited; nothing is published unless all of it succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".data.tmp", dir=path.parent)
    os.close(fd)
    staged_path = Path(staged)
    sink = ExternalData(staged_path)
    try:
        decoder = build_decoder(loaded, tensors=tensors, sink=sink, **build)
        sink.close()
        audit_norms(decoder.model, decoder.norm_nodes)
        save_onnx(decoder.model, path, force=force, staged_data=staged_path)
    finally:
        sink.close()
        staged_path.unlink(missing_ok=True)
    return decoder


def _is_streamed(loaded: LoadedModel) -> bool:
    return any(p.is_meta for p in loaded.module.parameters())


def export_ort_decoder(loaded: LoadedModel, plan: Any, *, progress: Progress | None = None, share_buffer: bool = False,
                       max_length: int | None = None, quantization: Quantization | None = None,
                       tensors: TensorSource | None = None) -> OrtDecoderExport:
    """``export --kv-cache --target onnxruntime``: write, audit, save atomically, check parity.

    ``plan``: an ``exporter.plan.ExportPlan`` (options and paths checked once). ``tensors``: where
    the weights are read (a streamed folder's checkpoint; default: the modules). The parity failure
    is not an exception: see ``OrtDecoderExport.parity_failed``.
    """
    options = plan.options
    progress = progress or Progress(enabled=False)
    if dtype_name(loaded.dtype) != options.dtype:
        raise UserError(f"the model was loaded in {loaded.dtype} but the export asks for {options.dtype}")
    measured_reference = None
    if quantization is not None and quantization.recipe.measured and quantization.measurement is None:
        quantization, measured_reference = _measure(loaded, quantization, options.dtype, progress)
    what = quantization.describe() if quantization is not None else f"{options.dtype} weights"
    source = "streamed from the checkpoint" if tensors is not None else "from the model"
    with progress.stage(f"writing the ONNX Runtime decoder graph ({what}, {source})") as st:
        decoder = write_ort_decoder(loaded, plan.model_path, force=options.force, tensors=tensors,
                                    lowering=options.lowering, share_buffer=share_buffer, max_length=max_length,
                                    quantization=quantization)
        st.note(f"{len(decoder.model.graph.node)} nodes, {decoder.norm_nodes} norm nodes audited in float32"
                + (f", {len(decoder.quantized)} MatMulNBits: {widths_summary(decoder.quantized)}"
                   if decoder.quantized else ""))
    kv_cache = ModelMetadata.read(decoder.model).kv_cache
    with progress.stage("writing genai_config.json and the Hugging Face files beside it") as st:
        serving_files = write_serving_files(plan.model_path, KVCacheLayout.from_dict(kv_cache), loaded.source,
                                            hf_folder=loaded.folder, force=options.force)
        st.note(", ".join(serving_files))
    result = OrtDecoderExport(plan.model_path, decoder, None, serving_files=serving_files)
    if not options.parity:
        return result
    reference = loaded
    if _is_streamed(loaded):
        result.layer_by_layer = reference_fits(loaded) or ""
        if not result.layer_by_layer and measured_reference is not None:
            reference = measured_reference
        elif not result.layer_by_layer:
            with progress.stage("loading the PyTorch model for the parity check"):
                reference = hf.load_folder(loaded.folder, options.dtype)
    if result.layer_by_layer:
        assert tensors is not None
        with progress.stage(f"parity layer by layer: ONNX Runtime CPU vs transformers on {options.seq} tokens") as st:
            result.parity = layer_parity(loaded, tensors, plan.model_path, prompt=options.seq, seed=options.seed)
            st.note(result.parity.status)
    else:
        with progress.stage("parity: ONNX Runtime CPU vs transformers with its cache (prefill + 4 steps)") as st:
            result.parity = decode_parity(reference, str(plan.model_path), batch=options.batch, prompt=options.seq,
                                          seed=options.seed)
            st.note(result.parity.status)
    if quantization is not None:
        result.text_cost = _text_cost(result, reference, progress)
    parity = {**result.parity.to_dict(), **({"why": result.layer_by_layer} if result.layer_by_layer else {})}
    report = {
        "model": str(plan.model_path), "name": loaded.name, "dtype": options.dtype, "lowering": options.lowering,
        "source": loaded.source, "kv_cache": kv_cache, "serving_files": serving_files,
        "quantization": quantization.describe() if quantization is not None else None,
        "nodes": len(decoder.model.graph.node), "norms": [n.to_dict() for n in decoder.detection.norms],
        "parity": parity, "vs_unquantized_on_text": result.text_cost, "versions": tool_versions(),
    }
    with atomic_path(plan.report_path, force=options.force) as tmp:
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    result.report_path = plan.report_path
    return result


def _measure(loaded: LoadedModel, quantization: Quantization, dtype: str,
             progress: Progress) -> tuple[Quantization, LoadedModel]:
    """A measured recipe's widths (``quant_sensitivity``): the model run whole on the calibration set
    (loaded from its folder when streamed, if it fits); returns the quantization and the model run."""
    # no tokenizer: refused before any model is loaded
    quant_sensitivity.calibration_windows(loaded.folder, quantization.scheme)
    reference = loaded
    if _is_streamed(loaded):
        why = reference_fits(loaded)
        if why or loaded.folder is None:
            raise UserError(f"--quantize {quantization.scheme} runs the whole model on a calibration text to choose "
                            f"its {'smoothing' if quantization.recipe.smoothed else 'widths'}, and "
                            f"{why or 'this model has no folder to load it from'}; "
                            f"choose --quantize {quantization.recipe.unmeasured}")
        with progress.stage(f"loading the PyTorch model to measure its weights (--quantize {quantization.scheme})"):
            reference = hf.load_folder(loaded.folder, dtype)
    lm = causal_lm(reference)
    with progress.stage(f"sampling {quant_sensitivity.GENERATED_WINDOWS} x {quant_sensitivity.CALIBRATION_CONTEXT} "
                        "calibration tokens from the model"):
        windows, source = quant_sensitivity.calibration_set(lm, loaded.folder, quantization.scheme)
    if quantization.recipe.smoothed:
        with progress.stage(f"choosing each projection input's smoothing on {quant_sensitivity.CALIBRATION_TEXT.name} "
                            f"and the model's samples ({len(windows)} x {quant_sensitivity.CALIBRATION_CONTEXT} "
                            "tokens)") as st:
            result = quant_smoothing.smoothed(quantization, lm, windows, source=source)
            assert result.measurement is not None
            st.note(f"{result.measurement['smoothed']} of {len(result.measurement['units'])} inputs smoothed")
        return result, reference
    with progress.stage(f"measuring each projection's 4-bit error on {quant_sensitivity.CALIBRATION_TEXT.name} "
                        f"and the model's samples ({len(windows)} x {quant_sensitivity.CALIBRATION_CONTEXT} "
                        "tokens)") as st:
        result = quant_sensitivity.measured(quantization, lm, windows, source=source)
        st.note(f"{len(result.upgrades)} units in 8 bits: "
                + ", ".join(f"{unit}.{layer}" for unit, layer in result.upgrades))
        if isinstance(result.importance, quant_sensitivity.LayerHessians):
            st.note(f"GPTQ's input Hessians: {result.importance.groups} group(s) of layers, each measured by a "
                    "calibration pass as the graph is written")
    return result, reference


def _text_cost(result: OrtDecoderExport, reference: LoadedModel, progress: Progress) -> dict[str, Any]:
    """What quantization cost on text (``divergence.quantization_text_cost``): the graph against
    ``reference``, the unquantized transformers model, unless that model is too large to run whole."""
    if result.layer_by_layer:
        return {"measured": False, "why": "the unquantized model is too large to run whole beside ONNX Runtime's "
                f"session ({result.layer_by_layer})"}
    with progress.stage(f"what quantization cost on text: the graph vs the unquantized model in transformers, "
                        f"the first {QUANTIZATION_TEXT_CHUNKS} chunks of the shipped GNU GPL v3") as st:
        cost = quantization_text_cost(causal_lm(reference), result.path)
        st.note(text_cost_line(cost))
    return cost
