"""The files beside a KV-cache model: ``genai_config.json`` and the Hugging Face config and tokenizer.

onnxruntime-genai reads a folder holding the model and ``genai_config.json``
(``og.Model(folder)``); optimum-onnx's ``ORTModelForCausalLM`` reads the model, ``config.json``
and the tokenizer files. :func:`write_serving_files` writes the first and copies the others
from the Hugging Face folder the model came from, so the exported folder runs unmodified in
both. Everything is written atomically and nothing is replaced without ``force``.

A model with no Hugging Face config of its own (a preset) gets a ``config.json`` written from
its KV-cache layout (:func:`layout_config`: the dims a client sizes the cache and the feeds with,
``model_type`` ``llama`` as in the genai config), so optimum's loader finds one too.

The genai config names every input and output of the KV-cache convention
(``decoder.convention``), and says ``past_present_share_buffer: false``: the portable graph
returns a new ``present`` one step longer than its ``past`` (no shared buffer). Its
``model.type`` is the transformers ``model_type`` where onnxruntime-genai knows it, else
``llama`` (a plain decoder: the graph itself carries everything family-specific).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from rmsnorm_deploy.decoder.convention import KVCacheLayout
from rmsnorm_deploy.exporter.hf_files import HF_FILES, SideFileError, read_side_json, side_file, special_token_fields
from rmsnorm_deploy.graph.onnx_file import atomic_path

GENAI_CONFIG = "genai_config.json"
#: Decoder-only model types onnxruntime-genai 0.18 knows (its ``model.type``).
GENAI_TYPES = frozenset({"chatglm", "ernie4_5", "gemma", "gemma2", "gemma3_text", "gpt2", "granite", "llama",
                         "mistral", "nemotron", "olmo", "phi", "phi3", "qwen2", "qwen3", "smollm3"})


def genai_type(model_type: str | None) -> str:
    return model_type if model_type in GENAI_TYPES else "llama"


def special_tokens(hf_config: Mapping[str, Any] | None, *, where: str = "config.json",
                   generation: Mapping[str, Any] | None = None,
                   generation_where: str = "generation_config.json") -> dict[str, Any]:
    """``bos``/``eos``/``pad`` token ids of a transformers config dict, ``generation``'s (the
    ``generation_config.json`` that transformers' own ``generate`` uses) where it sets them;
    ``None`` where absent. Ids of the wrong type are a one-line error (``hf_files.token_ids``)."""
    tokens = special_token_fields(hf_config, where)
    for key, value in special_token_fields(generation, generation_where).items():
        if value is not None:
            tokens[key] = value
    return tokens


def check_in_vocabulary(tokens: Mapping[str, Any], vocab_size: int, where: str) -> None:
    """Every special-token id lies in ``[0, vocab_size)``: a pad id past the embedding table would be
    gathered from outside it, an end-of-sequence id past it would never match."""
    for key, value in tokens.items():
        for token in [value] if isinstance(value, int) else value or []:
            if token >= vocab_size:
                raise SideFileError(f"{where}: {key} {token} is outside the model's vocabulary [0, {vocab_size}); "
                                    "fix the file")


def genai_config(layout: KVCacheLayout, *, model_file: str = "model.onnx", model_type: str | None = None,
                 hf_config: Mapping[str, Any] | None = None, generation: Mapping[str, Any] | None = None,
                 provider: str = "cpu") -> dict[str, Any]:
    """The ``genai_config.json`` of a KV-cache model (see the module docstring); its special tokens
    come from ``hf_config`` and ``generation`` (:func:`special_tokens`)."""
    tokens = special_tokens(hf_config, generation=generation)
    check_in_vocabulary(tokens, layout.vocab_size, "the model's config")
    eos = tokens["eos_token_id"]
    # No end-of-sequence token: an empty list, which onnxruntime-genai accepts and never matches
    # (generation runs to max_length, as transformers does with eos_token_id None); -1 is refused.
    eos = eos if eos is not None else []
    pad = tokens["pad_token_id"]
    if pad is None:
        pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
    provider_options = [] if provider == "cpu" else [{provider: {}}]
    return {
        "model": {
            "bos_token_id": tokens["bos_token_id"] if tokens["bos_token_id"] is not None else 0,
            "context_length": layout.max_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider_options},
                "filename": model_file,
                "head_size": layout.head_dim,
                "hidden_size": layout.hidden_size,
                "inputs": dict(KVCacheLayout.to_dict_names()[0]),
                "outputs": dict(KVCacheLayout.to_dict_names()[1]),
                "num_attention_heads": layout.num_heads,
                "num_hidden_layers": layout.num_layers,
                "num_key_value_heads": layout.kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": genai_type(model_type),
            "vocab_size": layout.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": layout.max_length, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": layout.past_present_share_buffer,
            "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def layout_config(layout: KVCacheLayout) -> dict[str, Any]:
    """A transformers-style ``config.json`` of a model that has none (a preset): its dims and a
    plain decoder's ``model_type``; the graph itself carries everything family-specific."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": genai_type(None),
        "hidden_size": layout.hidden_size,
        "num_hidden_layers": layout.num_layers,
        "num_attention_heads": layout.num_heads,
        "num_key_value_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "vocab_size": layout.vocab_size,
        "max_position_embeddings": layout.max_length,
        "torch_dtype": layout.dtype,
        "use_cache": True,
    }


def write_json(path: Path, data: Any, *, force: bool) -> None:
    with atomic_path(path, force=force) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def copy_hf_files(source: str | os.PathLike, folder: Path, *, force: bool) -> list[str]:
    """Copy the config and tokenizer files of a Hugging Face folder into ``folder`` (what a link
    points to, when it stays inside the folder or its hub-cache repository: ``hf_files.side_file``);
    returns the names copied."""
    copied = []
    for name in HF_FILES:
        path = side_file(source, name)
        if path is None:
            continue
        with atomic_path(folder / name, force=force) as tmp:
            shutil.copyfile(path, tmp)
        copied.append(name)
    return copied


def write_serving_files(model_path: Path, layout: KVCacheLayout, source: Mapping[str, Any], *,
                        hf_folder: str | os.PathLike | None = None, force: bool) -> list[str]:
    """``genai_config.json`` beside ``model_path`` and the HF files of its source; returns the names written.

    The files of ``hf_folder`` (the Hugging Face folder the model was read from, a GGUF file's
    converted folder included) are copied; a model built from a config gets that config as
    ``config.json`` (no tokenizer: it has none); any other model (a preset) gets :func:`layout_config`.
    """
    folder = model_path.parent
    folder.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    generation: dict[str, Any] | None = None
    if hf_folder is not None:
        written += copy_hf_files(hf_folder, folder, force=force)
        hf_config = read_side_json(folder, "config.json")
        generation = read_side_json(folder, "generation_config.json")
    elif source.get("kind") == "hf" and isinstance(source.get("config"), Mapping):
        hf_config = dict(source["config"])
        write_json(folder / "config.json", hf_config, force=force)
        written.append("config.json")
    else:
        hf_config = layout_config(layout)
        write_json(folder / "config.json", hf_config, force=force)
        written.append("config.json")
    model_type = (hf_config or {}).get("model_type")
    model_type = model_type if isinstance(model_type, str) else None
    data = genai_config(layout, model_file=model_path.name, model_type=model_type, hf_config=hf_config,
                        generation=generation)
    write_json(folder / GENAI_CONFIG, data, force=force)
    written.append(GENAI_CONFIG)
    return written


def read_genai_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The folder's ``genai_config.json``, or ``None``; damaged files are a one-line error."""
    data = read_side_json(folder, GENAI_CONFIG, kind=object)
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise SideFileError(f"{Path(folder) / GENAI_CONFIG}: has no 'model' object; export the model again")
    return data


def folder_tokens(folder: str | os.PathLike, vocab_size: int) -> dict[str, Any]:
    """The special tokens of an exported folder, every side file that holds them checked when the
    folder is opened (``KVCacheModel``: ``generate``, and ``serve`` before any port opens):
    ``genai_config.json``'s when there is one, else ``config.json``'s with
    ``generation_config.json``'s first; each id of each file inside the vocabulary."""
    base = Path(folder)
    config = read_side_json(base, "config.json")
    generation = read_side_json(base, "generation_config.json")
    found = {
        "config.json": special_tokens(config, where=str(base / "config.json")),
        "generation_config.json": special_tokens(None, generation=generation,
                                                 generation_where=str(base / "generation_config.json")),
    }
    genai = read_genai_config(base)
    if genai is not None:
        found[GENAI_CONFIG] = special_token_fields(genai["model"], f"{base / GENAI_CONFIG}: model")
    for name, tokens in found.items():
        check_in_vocabulary(tokens, vocab_size, str(base / name))
    if genai is not None:
        return found[GENAI_CONFIG]
    return special_tokens(config, generation=generation)
