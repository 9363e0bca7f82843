"""The KV-cache folders ``perplexity`` reads: ours, optimum's and onnxruntime-genai's, told apart by their files.

Three writers put a causal LM with a KV cache into a folder:

* **rmsnorm-deploy** (``export --kv-cache``): ``model.onnx`` whose metadata records the KV-cache
  layout (``decoder.convention``); opened as a :class:`~rmsnorm_deploy.decoder.generate.KVCacheModel`.
  Our folder also holds a ``genai_config.json`` and a ``config.json``: the metadata decides.
* **onnxruntime-genai** (its model builder, ``python -m onnxruntime_genai.models.builder``):
  ``genai_config.json`` beside the ONNX file its ``model.decoder.filename`` names; the input and
  output names are that file's (``model.decoder.inputs`` / ``outputs``, ``%d`` for the layer), the
  cache's heads from the graph or ``num_key_value_heads`` / ``head_size``.
* **optimum** (optimum-onnx's ``ORTModelForCausalLM`` export): ``model.onnx`` beside ``config.json``,
  with ``input_ids``, ``attention_mask``, optionally ``position_ids`` and ``past_key_values.N.key`` /
  ``.value`` inputs, ``logits`` and ``present.N.key`` / ``.value`` outputs; the cache's heads from
  the graph or the config (``num_key_value_heads``, ``head_dim`` else ``hidden_size / heads``).

A foreign folder is run with plain ONNX Runtime (:class:`ForeignKVModel`, the same
:class:`~rmsnorm_deploy.runners.onnxruntime.OnnxRuntimeRunner`, providers and threads), each window
a prefill from an empty cache (past of length 0), which is how both tools start a sequence; its
:class:`~rmsnorm_deploy.decoder.perplexity.GraphFeed` carries the names. Anything else is refused in
one line that names what the folder holds and what is expected. Nothing is read from outside the
folder: side files through ``hf_files.side_file`` (links out refused), external data checked by
``graph.onnx_file``, the model file named by ``genai_config.json`` a plain name inside the folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from rmsnorm_deploy.decoder.convention import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
    PRESENT_KEY,
    PRESENT_VALUE,
    graph_io,
)
from rmsnorm_deploy.decoder.genai_config import GENAI_CONFIG, folder_tokens, read_genai_config
from rmsnorm_deploy.decoder.generate import MODEL_FILE, KVCacheModel, SessionScope, _tokenizer
from rmsnorm_deploy.decoder.ort_step import CacheLayout
from rmsnorm_deploy.decoder.perplexity import GraphFeed
from rmsnorm_deploy.errors import InputError, UserError
from rmsnorm_deploy.exporter.hf_files import read_side_json, side_file
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_file import load_onnx
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner, provider_name

__all__ = ["FOLDER_KINDS", "ForeignKVModel", "FolderKindError", "folder_kind", "open_kv_folder"]

OURS, GENAI, OPTIMUM = "rmsnorm-deploy", "onnxruntime-genai", "optimum"
FOLDER_KINDS = (OURS, GENAI, OPTIMUM)
EXPECTED = ("model.onnx with rmsnorm-deploy's KV-cache metadata (`export --kv-cache`); genai_config.json beside "
            "the ONNX file it names (onnxruntime-genai's builder); or model.onnx beside config.json with "
            "past_key_values.N.key/.value inputs (optimum's ORTModelForCausalLM export)")
_CACHE_DTYPES = ("float32", "float16")


class FolderKindError(InputError):
    """A folder none of the three writers wrote, or one whose files contradict each other."""


def _listing(folder: Path) -> str:
    names = sorted(os.listdir(folder))
    shown = ", ".join(names[:8]) + (f", +{len(names) - 8} more" if len(names) > 8 else "")
    return shown or "nothing"


def _records_kv_cache(model_path: Path) -> bool:
    meta = ModelMetadata.read(load_onnx(model_path, load_external=False))
    return bool(getattr(meta, "kv_cache", None)) if meta is not None else False


def folder_kind(path: str | os.PathLike) -> tuple[str, Path]:
    """``(kind, the ONNX file)`` of a model folder (or an ``.onnx`` file in one), from its files
    (module docstring); a one-line :class:`FolderKindError` for anything else."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file or folder")
    folder = p if p.is_dir() else p.parent
    model = side_file(folder, MODEL_FILE) if p.is_dir() else p
    if model is not None and _records_kv_cache(model):
        return OURS, model
    genai = read_genai_config(folder)
    if genai is not None:
        named = _genai_model_file(genai, folder)
        if p.is_file() and p.resolve() != named.resolve():
            raise FolderKindError(f"{path}: its folder's {GENAI_CONFIG} names {named.name}, not this file; give the "
                                  "folder")
        return GENAI, named
    if model is not None and side_file(folder, "config.json") is not None:
        return OPTIMUM, model
    raise FolderKindError(f"{path}: not a KV-cache model folder perplexity reads (it holds {_listing(folder)}); "
                          f"expected {EXPECTED}")


def _genai_model_file(genai: Mapping[str, Any], folder: Path) -> Path:
    decoder = genai["model"].get("decoder")
    name = decoder.get("filename") if isinstance(decoder, dict) else None
    where = f"{folder / GENAI_CONFIG}: model.decoder.filename"
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise FolderKindError(f"{where} is {name!r}; it must name an ONNX file inside the folder (a plain file name)")
    found = side_file(folder, name)
    if found is None:
        raise FolderKindError(f"{where} names {name}, which is not in {folder} (it holds {_listing(folder)})")
    return found


def open_kv_folder(path: str | os.PathLike, providers: Sequence[str] = ("cpu",), *,
                   intra_op_threads: int | None = None) -> KVCacheModel | ForeignKVModel:
    """The model of a folder any of the three writers wrote, ready for ``with`` (module docstring)."""
    for p in providers:
        provider_name(p)  # an unknown provider is refused before the model is read
    kind, model = folder_kind(path)
    if kind == OURS:
        return KVCacheModel(model, providers, intra_op_threads=intra_op_threads)
    return ForeignKVModel(model, kind, providers, intra_op_threads=intra_op_threads)


def _names(kind: str, genai: Mapping[str, Any] | None, where: str) -> dict[str, str]:
    """The graph's names: the convention's (optimum), or genai_config.json's with them as defaults."""
    names = {"input_ids": INPUT_IDS, "attention_mask": ATTENTION_MASK, "position_ids": POSITION_IDS,
             "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE, "logits": LOGITS,
             "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE}
    if kind == GENAI and genai is not None:
        decoder = genai["model"]["decoder"]
        for part in ("inputs", "outputs"):
            given = decoder.get(part, {})
            if not isinstance(given, dict):
                raise FolderKindError(f"{where}: model.decoder.{part} is not an object; the file is damaged")
            for key, value in given.items():
                if key in names:
                    if not isinstance(value, str) or not value:
                        raise FolderKindError(f"{where}: model.decoder.{part}.{key} is {value!r}, not a name")
                    names[key] = value
    for key in ("past_key_names", "past_value_names", "present_key_names", "present_value_names"):
        if names[key].count("%d") != 1 or "{" in names[key] or "%" in names[key].replace("%d", ""):
            raise FolderKindError(f"{where}: {key} {names[key]!r} must hold one %d (the layer)")
    return names


def _int_field(config: Mapping[str, Any], keys: Sequence[str], where: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 24:
            raise FolderKindError(f"{where}: {key} is {value!r}, not a positive integer")
        return value
    return None


class ForeignKVModel(SessionScope):
    """A KV-cache folder onnxruntime-genai's builder or optimum wrote, in an ONNX Runtime session (a
    context manager with what ``perplexity`` reads of a ``KVCacheModel``: ``session``, ``layout``
    (its :class:`GraphFeed`: ``vocab_size``, ``max_length``, ``dtype``), ``special``, ``tokenizer``,
    ``encode``, ``runner``)."""

    def __init__(self, path: Path, kind: str, providers: Sequence[str] = ("cpu",), *,
                 intra_op_threads: int | None = None):
        self.path, self.kind, self.folder = path, kind, path.parent
        shown = f"{self.folder} ({kind})"
        genai = read_genai_config(self.folder) if kind == GENAI else None
        config = (genai["model"] if genai is not None else read_side_json(self.folder, "config.json")) or {}
        decoder = genai["model"]["decoder"] if genai is not None else config
        where = str(self.folder / (GENAI_CONFIG if genai is not None else "config.json"))
        names = _names(kind, genai, where)
        inputs, outputs = graph_io(load_onnx(path, load_external=False))
        self.graph_feed = self._feed(names, inputs, outputs, config, decoder, where, shown)
        self.layout = self.graph_feed
        self.metadata = None
        self.special = folder_tokens(self.folder, self.graph_feed.vocab_size)
        self.tokenizer = _tokenizer(self.folder)
        self.runner = OnnxRuntimeRunner(path, providers, intra_op_threads=intra_op_threads)

    @staticmethod
    def _feed(names: dict[str, str], inputs: dict[str, tuple[str, list[Any]]],
              outputs: dict[str, tuple[str, list[Any]]], config: Mapping[str, Any], decoder: Mapping[str, Any],
              where: str, shown: str) -> GraphFeed:
        """The graph's :class:`GraphFeed`, every input accounted for (one line naming the first that is not)."""
        layers = 0
        while names["past_key_names"] % layers in inputs:
            layers += 1
        pasts = [names[k] % i for i in range(layers) for k in ("past_key_names", "past_value_names")]
        presents = [names[k] % i for i in range(layers) for k in ("present_key_names", "present_value_names")]
        known = {names["input_ids"], names["attention_mask"], names["position_ids"], *pasts}
        missing = [n for n in (names["input_ids"], names["attention_mask"], *pasts) if n not in inputs]
        missing += [n for n in (names["logits"], *presents) if n not in outputs]
        if not layers or missing:
            raise FolderKindError(f"{shown}: the graph lacks {(missing or [names['past_key_names'] % 0])[:3]}; its "
                                  f"inputs are {sorted(inputs)[:6]}; expected {EXPECTED}")
        unknown = [n for n in inputs if n not in known]
        if unknown:
            raise FolderKindError(f"{shown}: the graph takes inputs perplexity cannot feed: {unknown[:3]} (it feeds "
                                  "input ids, attention mask, position ids and an empty past)")
        stated = _int_field(decoder, ("num_hidden_layers",), where)
        if stated is not None and stated != layers:
            raise FolderKindError(f"{where}: num_hidden_layers is {stated}, the graph has {layers} layers of past")
        dtype, shape = inputs[pasts[0]]
        if dtype not in _CACHE_DTYPES:
            raise UserError(f"{shown}: its cache is {dtype}; perplexity reads float32 or float16 models")
        if len(shape) != 4:
            raise FolderKindError(f"{shown}: past {pasts[0]!r} has shape {shape}, not [batch, heads, past, head size]")
        heads = _int_field(decoder, ("num_attention_heads",), where)
        hidden = _int_field(decoder, ("hidden_size",), where)
        kv_heads = shape[1] if isinstance(shape[1], int) and shape[1] else \
            _int_field(decoder, ("num_key_value_heads", "num_attention_heads"), where)
        head_dim = shape[3] if isinstance(shape[3], int) and shape[3] else \
            _int_field(decoder, ("head_size", "head_dim"), where) or (hidden // heads if hidden and heads else None)
        if not kv_heads or not head_dim:
            raise FolderKindError(f"{shown}: neither the graph nor {where} gives the cache's heads and head size "
                                  "(num_key_value_heads, head_size / head_dim)")
        logits_shape = outputs[names["logits"]][1]
        stated_vocab = _int_field(config, ("vocab_size",), where)
        vocab = logits_shape[-1] if logits_shape and isinstance(logits_shape[-1], int) and logits_shape[-1] \
            else stated_vocab
        if vocab is None:
            raise FolderKindError(f"{shown}: neither the graph's logits nor {where} give the vocabulary size")
        if stated_vocab is not None and stated_vocab != vocab:
            raise FolderKindError(f"{where}: vocab_size is {stated_vocab}, the graph's logits have {vocab}")
        cache = CacheLayout(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                            past_key=names["past_key_names"].replace("%d", "{i}"),
                            past_value=names["past_value_names"].replace("%d", "{i}"),
                            present_key=names["present_key_names"].replace("%d", "{i}"),
                            present_value=names["present_value_names"].replace("%d", "{i}"))
        return GraphFeed(cache=cache, dtype=dtype, vocab_size=vocab,
                         max_length=_int_field(config, ("context_length", "max_position_embeddings"), where),
                         input_ids=names["input_ids"], attention_mask=names["attention_mask"],
                         position_ids=names["position_ids"] if names["position_ids"] in inputs else None,
                         logits=names["logits"])

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError(f"{self.folder} has no tokenizer.json to read the text with")
        ids = list(self.tokenizer.encode(text).ids)
        if not ids:
            raise InputError("the text encodes to no tokens")
        return ids
