"""The files of a model folder, as untrusted input: where they may lead, and the one JSON reader.

A Hugging Face folder as most users have it is a hub-cache snapshot,
``models--org--name/snapshots/<rev>/``, whose files are symbolic links into ``../../blobs/``.
So a file of a folder may resolve inside the folder or, for a snapshot, inside its cache
repository (the ``models--org--name`` folder, :func:`model_roots`); anything else (a link to
``/etc/passwd``, a shard index naming ``../../outside``) is refused in one line before it is
opened (:func:`resolve_inside`, :func:`side_file`).

Every JSON side file (``config.json``, ``generation_config.json``, the shard index,
``genai_config.json``) goes through :func:`read_json`: a size cap, a nesting cap, UTF-8, and a
one-line error naming the file for anything damaged. :func:`token_ids` and
:func:`check_config_fields` check the values read from them: special-token ids are int64s
(never bools, never negative), dims are positive integers that fit each other, and
:func:`estimated_parameters` sizes the model from its config before anything is built.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from rmsnorm_deploy.errors import UserError

#: Files of a Hugging Face folder that tokenizers, transformers and optimum read beside a model.
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
            "chat_template.jinja")
#: The largest JSON side file parsed: a shard index of a model with thousands of shards is a few MB.
MAX_JSON_BYTES = 64 * 2**20
#: The deepest nesting a side file may have: configs nest two or three levels (``text_config``,
#: ``rope_scaling``); anything far deeper is damage, or an attack on the parser's recursion.
MAX_JSON_DEPTH = 32
#: Token ids are int64 in every graph and runtime.
MAX_TOKEN_ID = 2**63 - 1
#: More layers than any released model by far; building even the meta-device skeleton of a
#: config with a million layers takes minutes before its size can be counted.
MAX_LAYERS = 4096
SHARD_INDEX = "model.safetensors.index.json"


class SideFileError(UserError):
    """A file beside a model (config, index, tokenizer, genai config) that is damaged, of the wrong
    type, or a link that leads out of the model's folder."""


def model_roots(folder: str | os.PathLike) -> tuple[Path, ...]:
    """Where the files of ``folder`` may resolve: the folder itself and, for a hub-cache snapshot
    (``models--org--name/snapshots/<rev>``), its cache repository ``models--org--name``."""
    path = Path(folder).resolve()
    roots = [path]
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        roots.append(path.parent.parent)
    return tuple(roots)


def resolve_inside(path: Path, folder: str | os.PathLike) -> Path:
    """``path`` with its links followed, if that lies inside :func:`model_roots` of ``folder``;
    else a one-line refusal naming where it leads."""
    roots = model_roots(folder)
    target = path.resolve()
    if any(target == root or target.is_relative_to(root) for root in roots):
        return target
    where = "the model's folder" + (" and its hub-cache repository" if len(roots) > 1 else "")
    raise SideFileError(f"{path} leads to {target}, outside {where}; refusing to read it: copy the file into the "
                        "folder if it belongs to the model")


def side_file(folder: str | os.PathLike, name: str) -> Path | None:
    """The regular file ``name`` of ``folder`` (its link followed, inside :func:`model_roots`), or
    ``None`` when there is none; a dangling link, a link out, a folder or a FIFO are refused."""
    path = Path(folder) / name
    if not path.exists():
        if path.is_symlink():
            raise SideFileError(f"{path} is a link to {os.readlink(path)}, which does not exist; fix or remove it")
        return None
    target = resolve_inside(path, folder)
    if not target.is_file():
        raise SideFileError(f"{path} is not a regular file; remove it or put the model's {name} there")
    return target


def read_json(path: Path, shown: str | os.PathLike | None = None) -> Any:
    """The JSON value in ``path``, or a one-line :class:`SideFileError` naming ``shown`` (default
    ``path``): larger than :data:`MAX_JSON_BYTES`, not UTF-8, not JSON, or nested deeper than
    :data:`MAX_JSON_DEPTH`."""
    shown = shown or path
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise SideFileError(f"{shown}: {size:,} bytes, more than the {MAX_JSON_BYTES // 2**20} MiB a side file "
                                "may hold; the file is damaged or not the model's")
        text = path.read_bytes().decode("utf-8")
        value = json.loads(text)
    except UnicodeDecodeError as exc:
        raise SideFileError(f"{shown}: not UTF-8 text (byte {exc.start}); the file is damaged") from None
    except RecursionError:
        raise SideFileError(f"{shown}: nested deeper than {MAX_JSON_DEPTH} levels; the file is damaged") from None
    except ValueError as exc:
        raise SideFileError(f"{shown}: not valid JSON ({exc}); the file is damaged") from None
    except OSError as exc:
        raise SideFileError(f"{shown}: cannot be read ({exc.strerror or exc})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise SideFileError(f"{shown}: nested deeper than {MAX_JSON_DEPTH} levels; the file is damaged")
    return value


def read_side_json(folder: str | os.PathLike, name: str, *, kind: type = dict) -> Any:
    """:func:`read_json` of the side file ``name`` of ``folder`` (``None`` when absent), which must
    hold a ``kind`` (an object by default)."""
    path = side_file(folder, name)
    if path is None:
        return None
    value = read_json(path, Path(folder) / name)
    if not isinstance(value, kind):
        raise SideFileError(f"{Path(folder) / name}: holds a JSON {_json_type(value)}, not an "
                            f"{_json_type(kind())}; the file is damaged or not the model's")
    return value


def _depth(value: Any) -> int:
    """The nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _shown(value: Any) -> str:
    """A value as JSON writes it (``true``, ``"64"``), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


# -- values ----------------------------------------------------------------------------------------
def token_ids(value: Any, where: str) -> int | list[int] | None:
    """A special-token id as a config holds it: ``None``, an id, or a list of ids, each an integer
    from 0 to 2^63-1 (``true`` is not an id); else a one-line error naming ``where``."""
    def one(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKEN_ID

    if value is None or one(value):
        return value
    if isinstance(value, list) and all(one(v) for v in value):
        return list(value)
    raise SideFileError(f"{where} is {_shown(value)}: a token id is an integer from 0 to 2^63-1, or a list of "
                        "them (null for none); fix the file")


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_fields(config: Any, where: str) -> dict[str, int | list[int] | None]:
    """The bos/eos/pad ids of a config object (its ``text_config``'s where the top has none), each
    checked by :func:`token_ids`; all ``None`` for no config."""
    if config is None:
        return dict.fromkeys(SPECIAL_TOKENS)
    if not isinstance(config, Mapping):
        raise SideFileError(f"{where}: holds a JSON {_json_type(config)}, not an object; the file is damaged")
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    return {key: token_ids(config[key] if config.get(key) is not None else text.get(key), f"{where}: {key}")
            for key in SPECIAL_TOKENS}


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


#: Config fields export reads, with what each must be when present and not null.
_INT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
               "head_dim", "max_position_embeddings")
_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
_DTYPE_FIELDS = ("torch_dtype", "dtype")


def check_config_fields(config: Mapping[str, Any], where: str) -> None:
    """The fields of a transformers config dict (and of its ``text_config``) that the export reads
    have their types and fit each other, checked before transformers sees them: one line naming
    the field and its value."""
    for scope, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(cfg, Mapping):
            continue
        for key in _INT_FIELDS:
            if cfg.get(key) is not None and not _positive_int(cfg[key]):
                raise SideFileError(f"{where}: {scope}{key} is {_shown(cfg[key])}; it must be an integer >= 1")
        size = cfg.get("intermediate_size")
        if size is not None and not (_positive_int(size) or isinstance(size, list) and all(map(_positive_int, size))):
            raise SideFileError(f"{where}: {scope}intermediate_size is {_shown(size)}; it must be an integer >= 1 "
                                "(or a list of them)")
        for key in _EPS_FIELDS:
            eps = cfg.get(key)
            if eps is not None and not (isinstance(eps, (int, float)) and not isinstance(eps, bool)
                                        and math.isfinite(eps) and eps > 0):
                raise SideFileError(f"{where}: {scope}{key} is {_shown(eps)}; it must be a finite number > 0, "
                                    "e.g. 1e-6")
        for key in _DTYPE_FIELDS:
            name = cfg.get(key)
            if name is not None and name != "auto" and not (
                    isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)):
                raise SideFileError(f"{where}: {scope}{key} is {_shown(name)}, not a torch dtype; write e.g. "
                                    "\"float32\" or \"bfloat16\"")
        hidden, heads, kv = cfg.get("hidden_size"), cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        if hidden and heads and cfg.get("head_dim") is None and hidden % heads:
            raise SideFileError(f"{where}: {scope}hidden_size {hidden} is not a multiple of {scope}num_attention_heads "
                                f"{heads}; fix the config (or give head_dim)")
        if heads and kv and heads % kv:
            raise SideFileError(f"{where}: {scope}num_attention_heads {heads} is not a multiple of "
                                f"{scope}num_key_value_heads {kv}; fix the config")
        if (cfg.get("num_hidden_layers") or 0) > MAX_LAYERS:
            raise SideFileError(f"{where}: {scope}num_hidden_layers is {cfg['num_hidden_layers']:,}, more than the "
                                f"{MAX_LAYERS} this tool builds; the config is damaged")


def estimated_parameters(config: Any) -> int | None:
    """A lower bound of the parameter count of a decoder config (a transformers config or dict;
    its ``text_config`` where the top has no dims): the embedding, each layer's query/output and
    key/value projections and a two-matrix MLP. Exact counting builds the model on the meta device,
    which a config of absurd size would stall; this bound refuses it first. ``None`` when the
    config lacks the dims."""
    def get(cfg: Any, key: str) -> Any:
        return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)

    cfg = config
    if get(cfg, "hidden_size") is None and get(cfg, "text_config") is not None:
        cfg = get(cfg, "text_config")
    hidden, layers, heads = get(cfg, "hidden_size"), get(cfg, "num_hidden_layers"), get(cfg, "num_attention_heads")
    if not all(map(_positive_int, (hidden, layers, heads))):
        return None
    head_dim = get(cfg, "head_dim") if _positive_int(get(cfg, "head_dim")) else hidden // heads
    kv = get(cfg, "num_key_value_heads") if _positive_int(get(cfg, "num_key_value_heads")) else heads
    inter = get(cfg, "intermediate_size")
    listed = isinstance(inter, list) and inter and all(map(_positive_int, inter))
    inter = inter if _positive_int(inter) else min(inter) if listed else 0
    vocab = get(cfg, "vocab_size") if _positive_int(get(cfg, "vocab_size")) else 0
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 2 * hidden * inter
    return vocab * hidden + layers * per_layer
