"""Hugging Face causal language models: from a local folder or GGUF file, or from a config with random weights.

A folder must hold ``config.json`` and safetensors weights (``*.safetensors``, or a sharded set
with its index). A GGUF file (or a folder holding one and no config.json) is read as the folder
transformers' GGUF loader converts it into (``gguf``), and the metadata records the file. Nothing
is fetched from the Hub (``local_files_only``), no pickled ``.bin`` weights are read and no
remote code runs. The exported signature is ``input_ids`` ->
``logits`` of ``model(input_ids=..., use_cache=False)``: the full causal-LM logits, no cache.

``from_config`` builds a model with random weights for tests: transformers' own
initialization under ``torch.manual_seed(seed)``, then every norm gain moved off its
initial value by seeded noise (N(0, 0.1^2)), because gains of exactly 1 (or 0 for Gemma's
``1 + w``) would hide the difference between rounding orders. The metadata keeps the
config and the seed, so the same model can be rebuilt for validation.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.exporter.detect import KNOWN_CLASSES, class_path
from rmsnorm_deploy.exporter.gguf import convert_gguf, named_gguf
from rmsnorm_deploy.exporter.hf_files import (
    HF_FILES,
    SHARD_INDEX,
    check_config_fields,
    estimated_parameters,
    read_side_json,
    resolve_inside,
    side_file,
    special_token_fields,
)
from rmsnorm_deploy.exporter.loaded_model import LoadedModel, TokenLogits
from rmsnorm_deploy.exporter.probing import NOT_NORMS
from rmsnorm_deploy.exporter.rebuild import source_builder
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.resources import check_memory

#: The gain noise of random-weight models (see the module docstring).
NORM_GAIN_NOISE = 0.1

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
#: Tiny random configs of the families the exporter supports (tests and benchmarks build them with
#: :func:`from_config`): 2 layers, hidden 64, 4 heads over 2 KV heads, vocabulary 256.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_TINY, "model_type": "llama"},
    "mistral": {**_TINY, "model_type": "mistral", "sliding_window": None},
    "qwen2": {**_TINY, "model_type": "qwen2"},
    "qwen3": {**_TINY, "model_type": "qwen3", "head_dim": 16},
    "gemma3": {**_TINY, "model_type": "gemma3_text", "head_dim": 16},
    "phi3": {**_TINY, "model_type": "phi3", "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1},
    "olmo2": {**_TINY, "model_type": "olmo2", "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1},
}


class HFModelError(UserError):
    """A Hugging Face folder or config that cannot be loaded as a causal LM."""


class HFTokenLogits(TokenLogits):
    """A transformers causal LM as ``input_ids -> {"logits": ...}`` without a KV cache."""

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def check_folder(folder: str | os.PathLike) -> Path:
    """A folder with config.json and safetensors weights, or a one-line error saying what is missing.

    Every file is followed only inside the folder or its hub-cache repository
    (``hf_files.model_roots``); a shard index is checked before any shard is opened."""
    path = Path(folder)
    if not path.is_dir():
        raise HFModelError(f"{path}: not a folder; give a Hugging Face model folder (config.json + *.safetensors)")
    if side_file(path, "config.json") is None:
        raise HFModelError(f"{path}: no config.json; give a Hugging Face model folder with config.json and "
                           "*.safetensors weights, or a .gguf file")
    for name in HF_FILES:  # the files an export copies beside a KV-cache model: refused now, not after the export
        side_file(path, name)
    if not weight_files(path):
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {', '.join(bins[:3])}: pickled weights are not loaded; convert them to safetensors)" if bins else ""
        raise HFModelError(f"{path}: no *.safetensors weights{hint}")
    return path


def weight_files(path: Path) -> list[Path]:
    """The safetensors files transformers reads from ``path`` (those of its shard index, else every
    ``*.safetensors``), each resolved inside ``hf_files.model_roots``; a one-line refusal otherwise."""
    index = read_side_json(path, SHARD_INDEX)
    if index is None:
        return [resolve_inside(f, path) for f in sorted(path.glob("*.safetensors"))]
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFModelError(f"{path / SHARD_INDEX}: its weight_map is not an object of shard file names; the file is "
                           "damaged")
    shards = []
    for name in sorted(set(weight_map.values())):
        if not name or "\x00" in name or os.path.isabs(name) or Path(name).drive or ".." in Path(name).parts:
            raise HFModelError(f"{path / SHARD_INDEX}: its weight_map names {name!r}, not a file name inside the "
                               "folder; refusing to read it: the index must name the shards beside it")
        shard = side_file(path, name)
        if shard is None:
            raise HFModelError(f"{path / SHARD_INDEX}: names the shard {name!r}, which is missing from {path}")
        shards.append(shard)
    return shards


def read_folder(folder: str | os.PathLike) -> tuple[Path, Any, Any]:
    """A folder's checked config and its causal-LM class, every safetensors header read (no weights):
    ``(path, config, model class)``, or a one-line error saying what is wrong."""
    path = check_folder(folder)
    transformers = require("transformers", "exporting a Hugging Face model")
    require("safetensors", "exporting a Hugging Face model")
    config = _load_config(path, transformers)
    model_cls = _causal_lm_class(config, transformers, str(path))
    _check_safetensors(path)
    return path, config, model_cls


def folder_source(path: Path, config: Any) -> dict[str, Any]:
    """The metadata ``source`` of a model read from a folder."""
    return {"kind": "hf", "path": str(path.resolve()), "model_type": config.model_type}


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """MODEL read as a Hugging Face folder (config, class, weight headers) and what the metadata records of it."""

    path: Path  # the folder the weights and tokenizer files are read from (a GGUF's converted folder)
    config: Any
    model_cls: Any
    name: str  # the default model name: the folder's name, or the GGUF file's stem
    source: dict[str, Any]  # metadata ``source``: the folder, or the GGUF file it was converted from


def read_checkpoint(ref: str | os.PathLike) -> Checkpoint:
    """MODEL as a Hugging Face folder: a folder, or a GGUF file converted once (``gguf.convert_gguf``)."""
    gguf_file = named_gguf(ref)
    converted = convert_gguf(gguf_file) if gguf_file is not None else None
    path, config, model_cls = read_folder(converted.folder if converted is not None else ref)
    if converted is not None:
        return Checkpoint(path, config, model_cls, converted.name, converted.source(config.model_type))
    return Checkpoint(path, config, model_cls, path.resolve().name, folder_source(path, config))


def load_folder(folder: str | os.PathLike, dtype: str, *, peak_factor: float = 1.0,
                fix: str = "choose a smaller model or a machine with more memory") -> LoadedModel:
    """The causal LM saved in ``folder`` (or the GGUF file it names: :func:`read_checkpoint`), in
    ``dtype``, in eval mode. ``peak_factor``: how many times its weights the caller's run needs at its
    peak; checked against the memory budget before any weight is read, refused with ``fix``."""
    checkpoint = read_checkpoint(folder)
    path, config, model_cls = checkpoint.path, checkpoint.config, checkpoint.model_cls
    _check_size(model_cls, config, dtype, str(path), factor=peak_factor, fix=fix)
    try:
        model = model_cls.from_pretrained(
            str(path), config=config, local_files_only=True, use_safetensors=True, dtype=torch_dtype(dtype),
            trust_remote_code=False,
        )
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise HFModelError(f"{path}: transformers cannot load the weights ({one_line(exc)})") from None
    return loaded_model(model, config, dtype, name=checkpoint.name, source=checkpoint.source, folder=path)


def from_config(config: Any, dtype: str, *, seed: int = 0, name: str | None = None) -> LoadedModel:
    """A causal LM of ``config`` (a transformers config or its dict) with seeded random weights."""
    transformers = require("transformers", "building a Hugging Face model from a config")
    config = _config_from(config, transformers)
    model_cls = _causal_lm_class(config, transformers, f"config {config.model_type!r}")
    # built in float32, then converted: both copies exist for a moment
    _check_size(model_cls, config, dtype, f"config {config.model_type!r}",
                per_param=4 + (torch_dtype(dtype).itemsize if dtype != "float32" else 0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        _perturb_norm_gains(model, seed)
    model = model.to(torch_dtype(dtype))
    source = {"kind": "hf", "config": json.loads(config.to_json_string(use_diff=False)), "seed": int(seed)}
    return loaded_model(model, config, dtype, name=name or f"hf-{config.model_type}", source=source)


def _check_size(model_cls: Any, config: Any, dtype: str, where: str, *, per_param: int | None = None,
                factor: float = 1.0, fix: str = "choose a smaller model or a machine with more memory") -> None:
    """The model's weights (times ``factor``, the caller's peak in weights) against the memory budget:
    first a lower bound from the config's dims (``hf_files.estimated_parameters``), then counted on
    the meta device (nothing allocated)."""
    per_param = (per_param or torch_dtype(dtype).itemsize) * factor
    peak = f" ({factor:g}x the weights at the run's peak)" if factor != 1.0 else ""
    bound = estimated_parameters(config)
    if bound is not None:
        check_memory(bound * per_param, f"{where}: at least {bound:,} parameters in {dtype}{peak}", fix)
    try:
        with torch.device("meta"):
            model = model_cls(config)
    except Exception as exc:  # transformers raises many kinds on a config it cannot build
        raise HFModelError(f"{where}: transformers cannot build this config ({type(exc).__name__}: "
                           f"{one_line(exc)})") from None
    count = sum(p.numel() for p in model.parameters())
    check_memory(count * per_param, f"{where}: {count:,} parameters in {dtype}{peak}", fix)


def _check_safetensors(path: Path) -> None:
    """Every weight file's header parses (only headers are read), or a one-line error naming the file."""
    from safetensors import safe_open

    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
            raise HFModelError(f"{file}: not a readable safetensors file ({one_line(exc)}); re-save the weights "
                               "with safetensors") from None


def loaded_model(model: torch.nn.Module, config: Any, dtype: str, *, name: str, source: dict[str, Any],
                 folder: Path | None = None) -> LoadedModel:
    """``model`` (a transformers causal LM) in eval mode, wrapped to the export's signature;
    ``folder``: the Hugging Face folder it was read from, if any."""
    model.eval()
    max_pos = getattr(config, "max_position_embeddings", None) or 2048
    return LoadedModel(
        name=name, module=HFTokenLogits(model).eval(), dtype=dtype, source=source,
        vocab_size=int(config.vocab_size), max_seq_len=int(max_pos),
        description=f"{type(model).__name__} ({config.model_type})", folder=folder,
    )


def _load_config(path: Path, transformers: Any) -> Any:
    """config.json (and generation_config.json, which transformers reads with the weights) through
    ``hf_files``: JSON objects of sound fields and token ids, before transformers parses them."""
    raw = read_side_json(path, "config.json")
    if "model_type" not in raw:
        raise HFModelError(f"{path}/config.json: has no model_type; is this a transformers model folder?")
    check_config_fields(raw, f"{path}/config.json")
    special_token_fields(raw, f"{path}/config.json")
    special_token_fields(read_side_json(path, "generation_config.json"), f"{path}/generation_config.json")
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError, KeyError, TypeError and its own errors
        raise HFModelError(f"{path}: unsupported architecture {raw.get('model_type')!r}: transformers cannot read its "
                           f"config.json ({type(exc).__name__}: {one_line(exc)})") from None


def _config_from(config: Any, transformers: Any) -> Any:
    if isinstance(config, dict):
        data = dict(config)
        check_config_fields(data, "the config")
        model_type = data.pop("model_type", None)
        if not model_type or not isinstance(model_type, str):
            raise HFModelError("a config dict needs a model_type (e.g. 'llama')")
        try:
            return transformers.AutoConfig.for_model(model_type, **data)
        except Exception as exc:  # transformers raises ValueError, KeyError, TypeError and its own errors
            raise HFModelError(f"unsupported architecture or config {model_type!r} ({type(exc).__name__}: "
                               f"{one_line(exc)})") from None
    return config


def _causal_lm_class(config: Any, transformers: Any, where: str) -> Any:
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        return mapping[type(config)]
    except KeyError:
        raise HFModelError(
            f"{where}: unsupported architecture {config.model_type!r}: transformers has no causal-LM class for it"
        ) from None


@torch.no_grad()
def _perturb_norm_gains(model: torch.nn.Module, seed: int) -> None:
    """Every norm's gain moved off its initial value: the known classes', and those of any other
    module whose class name says it is a norm and that has a floating-point ``weight`` (the
    modules detection probes), embeddings and linear layers excepted."""
    import re


    gen = torch.Generator().manual_seed(seed + 7919)
    for _, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            continue
        known = class_path(type(module)) in KNOWN_CLASSES
        norm_like = re.search("norm", type(module).__name__, re.IGNORECASE) and not isinstance(module, NOT_NORMS)
        if known or norm_like:
            weight.add_(torch.randn(weight.shape, generator=gen, dtype=torch.float32).to(weight.dtype) * NORM_GAIN_NOISE)


@source_builder("hf")
def _rebuild(meta: ModelMetadata) -> torch.nn.Module:
    source = meta.source
    if source.get("path"):  # checked by rebuild_source: inside the model's folder, or given by the user
        return load_folder(source["path"], meta.dtype).module
    if isinstance(source.get("config"), dict):
        return from_config(source["config"], meta.dtype, seed=int(source.get("seed", 0))).module
    raise UserError("the model's Hugging Face source has neither a folder path nor a config; export it again")


@source_builder("gguf")
def _rebuild_gguf(meta: ModelMetadata) -> torch.nn.Module:
    """The model of the GGUF file the metadata names (checked by rebuild_source, or given with --source),
    converted again, and refused unless it is the file the model was exported from (its SHA-256)."""
    source = meta.source
    if not source.get("path"):
        raise UserError("the model's GGUF source has no file path; export it again")
    converted = convert_gguf(named_gguf(source["path"]) or source["path"])  # --source may be its folder
    recorded = source.get("sha256")
    if recorded != converted.sha256:
        raise UserError(f"{converted.file}: its SHA-256 ({converted.sha256[:16]}...) is not that of the GGUF file "
                        f"the model was exported from ({str(recorded)[:16]}...); give that file with --source")
    return load_folder(converted.folder, meta.dtype).module
