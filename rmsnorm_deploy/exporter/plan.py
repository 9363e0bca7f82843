"""What an export will do, decided and checked once before any work.

``plan_export`` checks the options, finds the model's name and the output paths, and checks
that they can be written; the CLI and the Python API both go through it, and the pipeline
(``pipeline.run_export``) trusts the plan it is given. Every default lives here.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rmsnorm_deploy.contract.dtypes import MODEL_DTYPES
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter import hf, presets
from rmsnorm_deploy.exporter.detect import NormSpecOverride, parse_norm_spec
from rmsnorm_deploy.exporter.fusions import FUSED_OPSET, check_fusion_opset
from rmsnorm_deploy.exporter.gguf import named_gguf
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.exporter.presets import find_preset
from rmsnorm_deploy.graph.function import check_opset
from rmsnorm_deploy.graph.lowerings import LOWERINGS
from rmsnorm_deploy.graph.onnx_file import check_folder_writable, ensure_writable
from rmsnorm_deploy.graph.standalone import default_opset

#: Largest batch the metadata declares by default (TensorRT profiles are built from it).
MAX_BATCH = 8
#: Longest sequence the metadata declares by default; a model's own limit can be lower.
MAX_SEQ = 4096
DEFAULT_BATCH, DEFAULT_SEQ = 2, 16
REPORT_NAME = "report.json"
#: The traced export's peak memory in weights: torch.onnx holds the model, the parity check runs it
#: in float64 a weight at a time, and ONNX Runtime holds its own copy (measured: 2.8x for a 1.24B
#: float16 model, 3.1-3.2x for real Gemma 3 270M in float32, 4.1x for SmolLM2-135M, of which ~0.45 GB
#: is the libraries themselves: benchmarks/results/export_scale.md). A model that would pass it is
#: refused first.
TRACED_PEAK_FACTOR = 3.5
#: What a model too large for the traced export can use instead.
STREAMING_FIX = ("export --kv-cache --target onnxruntime (optionally --quantize int4) reads the weights tensor by "
                 "tensor, whatever the model's size")


class ExportError(UserError):
    """A model the pipeline cannot export, with the reason in one line."""


@dataclasses.dataclass
class ExportOptions:
    dtype: str = "float32"
    lowering: str = "function"
    opset: int | None = None  # None: 18, or 23 for the native lowering or fuse_attention
    #: Attention and rotary embeddings as ONNX opset-23 ``Attention`` and ``RotaryEmbedding``
    #: (``fusions.py``): faster in ONNX Runtime; TensorRT imports them from 10.15 only.
    fuse_attention: bool = False
    batch: int = DEFAULT_BATCH  # example shape: traced, and the parity check's input
    seq: int = DEFAULT_SEQ
    seed: int = 0  # parity inputs
    force: bool = False
    parity: bool = True
    #: Free the PyTorch module (``loaded.module`` and the detected norms' references) once its
    #: outputs are computed, so ONNX Runtime's copy of the weights does not sit beside it.
    release_model: bool = False
    #: ``CLASS_OR_PATH=SPEC`` declarations (``--norm-spec``), confirmed like every other spec.
    norm_specs: tuple[str, ...] = ()

    def resolved_opset(self) -> int:
        if self.opset is not None:
            return self.opset
        return FUSED_OPSET if self.fuse_attention else default_opset(self.lowering)


def is_checkpoint_ref(ref: str) -> bool:
    """Whether MODEL names a checkpoint (a Hugging Face folder, a GGUF file or a folder holding one)
    rather than a preset; a folder of several GGUF files is refused (``gguf.named_gguf``).

    A bare name (``tiny``) that is both a preset and a path in the current directory is
    refused: which one was meant cannot be known, and reading the wrong one silently would
    export another model. ``./tiny`` (any path) is the checkpoint.
    """

    if named_gguf(ref) is None and not Path(ref).is_dir():
        return False
    if not presets.looks_like_path(ref):
        shadowed = next((d / f"{ref}.toml" for d in presets.preset_dirs() if (d / f"{ref}.toml").is_file()), None)
        if shadowed is not None:
            what = "folder" if Path(ref).is_dir() else "file"
            raise UserError(f"MODEL {ref!r} is both a {what} here and a preset: write ./{ref} for the {what}, or "
                            f"{shadowed} for the preset")
    return True


def load_torch_model(ref: str, dtype: str) -> LoadedModel:
    """MODEL of the CLI's traced export: a preset name, a preset TOML path, a Hugging Face folder, or a
    GGUF file (converted once into the folder transformers' loader makes of it: ``hf.read_checkpoint``).
    A folder is refused before its weights are read when the traced export's peak
    (:data:`TRACED_PEAK_FACTOR` times its weights) exceeds the memory budget, naming the streaming export."""

    if is_checkpoint_ref(ref):
        fix = f"choose a smaller model or a machine with more memory, or {STREAMING_FIX}"
        return hf.load_folder(ref, dtype, peak_factor=TRACED_PEAK_FACTOR, fix=fix)
    return presets.build_preset(presets.load_preset(ref), dtype)


def default_output(name: str, dtype: str, lowering: str) -> Path:
    return Path("export") / name / f"{dtype}-{lowering}" / "model.onnx"


def output_path(out: str | os.PathLike | None, name: str, dtype: str, lowering: str) -> Path:
    """OUT of the CLI: a ``.onnx`` file, or a folder that gets ``model.onnx``; default under ``export/``."""
    if out is None:
        return default_output(name, dtype, lowering)
    p = Path(out)
    if p.suffix == ".onnx":
        return p
    if p.exists() and not p.is_dir():
        raise UserError(f"output {p} exists and is not a folder; give a folder or a path ending in .onnx")
    return p / "model.onnx"


def check_options(options: ExportOptions) -> None:
    """Every option problem, before any work: one line each."""
    if options.dtype not in MODEL_DTYPES:
        raise UserError(f"dtype {options.dtype!r} is not exportable; choose one of {', '.join(MODEL_DTYPES)}")
    if options.lowering not in LOWERINGS:
        raise UserError(f"unknown lowering {options.lowering!r}; choose one of {', '.join(LOWERINGS)}")
    check_opset(options.resolved_opset())
    if options.fuse_attention:
        check_fusion_opset(options.resolved_opset())
    for name in ("batch", "seq"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"--{name} must be an integer >= 1, got {value!r}")
    norm_overrides(options)


def norm_overrides(options: ExportOptions) -> tuple[NormSpecOverride, ...]:
    """The parsed ``--norm-spec`` declarations; one line for a bad one or a class or path declared twice."""
    if isinstance(options.norm_specs, str):
        raise UserError("norm_specs must be a sequence of CLASS_OR_PATH=SPEC strings, not one string")
    parsed = tuple(parse_norm_spec(text) for text in options.norm_specs)
    selectors = [o.selector for o in parsed]
    twice = sorted({t for t in selectors if selectors.count(t) > 1})
    if twice:
        raise UserError(f"--norm-spec declares {twice[0]!r} more than once; give one spec per class or path")
    return parsed


def model_name(ref: str) -> str:
    """The name of MODEL in the default output path, found without loading the model."""

    path = Path(ref)
    if is_checkpoint_ref(ref):
        gguf_file = named_gguf(ref)
        return gguf_file.stem if gguf_file is not None else path.resolve().name
    return find_preset(ref).stem


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """A checked export: the options, the model file to write and the report beside it."""

    options: ExportOptions
    model_path: Path
    name: str = ""

    @property
    def report_path(self) -> Path:
        return self.model_path.parent / REPORT_NAME


def plan_export(options: ExportOptions, *, model_path: str | os.PathLike | None = None, model_ref: str | None = None,
                output: str | os.PathLike | None = None, extra_files: tuple[str, ...] = ()) -> ExportPlan:
    """Check ``options`` and the output paths once. Give ``model_path`` (a model file path), or
    ``model_ref`` and the CLI's ``output`` (a file, a folder or None for the default).
    ``extra_files``: other files published beside the model (a decoder's serving files)."""
    check_options(options)
    name = model_name(model_ref) if model_ref is not None else ""
    path = Path(model_path) if model_path is not None else output_path(output, name, options.dtype, options.lowering)
    ensure_writable(path, force=options.force)
    check_folder_writable(path.parent)  # now, not after the whole export has run
    if options.parity:
        ensure_writable(path.parent / REPORT_NAME, force=options.force)
    for extra in extra_files:
        ensure_writable(path.parent / extra, force=options.force)
    return ExportPlan(options, path, name)
