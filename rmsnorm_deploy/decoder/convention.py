"""The KV-cache I/O convention: names, shapes and dtypes of a graph that prefills and decodes.

One graph serves the prompt (prefill, ``past = 0``) and every new token (decode,
``sequence = 1``), in the convention optimum-onnx and onnxruntime-genai both read:

=============================  ========  ============================================  ===========
name                           dtype     shape                                         direction
=============================  ========  ============================================  ===========
``input_ids``                  int64     ``[batch, sequence]``                         input
``attention_mask``             int64     ``[batch, past + sequence]`` (``total``)      input
``position_ids``               int64     ``[batch, sequence]``                         input
``past_key_values.{i}.key``    model     ``[batch, kv_heads, past, head_dim]``         input
``past_key_values.{i}.value``  model     ``[batch, kv_heads, past, head_dim]``         input
``logits``                     model     ``[batch, sequence, vocab]``                  output
``present.{i}.key``            model     ``[batch, kv_heads, past + sequence, head_dim]``  output
``present.{i}.value``          model     ``[batch, kv_heads, past + sequence, head_dim]``  output
=============================  ========  ============================================  ===========

``position_ids`` is always an input (Gemma's too), so left padding works: a row's positions
are ``cumsum(attention_mask) - 1`` (:func:`position_ids_for`), padded slots get 1, as
transformers' ``generate`` writes them. ``head_dim`` comes from the model's config, never from
``hidden / heads``.

:class:`KVCacheLayout` is the convention of one model; it is written into the model's metadata
(``rmsnorm_deploy.kv_cache``), read back with every field checked (metadata is untrusted), and
:func:`check_io` checks a graph's real inputs and outputs against it. The exporters of both
graph targets (``portable``: plain ops or opset-23 ``Attention``; ``onnxruntime``: ONNX
Runtime's fused attention) write it; ``genai_config``, ``decoder.generate`` and TensorRT's
profiles read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from rmsnorm_deploy.contract.dtypes import numpy_dtype
from rmsnorm_deploy.errors import UserError

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
#: Dynamic dim names; ``total`` is ``past + sequence`` (the attention mask's length).
BATCH, SEQUENCE, PAST, TOTAL = "batch", "sequence", "past", "total"
#: The version of this convention, recorded in the metadata.
CONVENTION = "past_key_values/1"
#: Graph targets: the portable graph (plain ops, or opset-23 Attention) and ONNX Runtime's.
TARGETS = ("portable", "onnxruntime")
#: The dtypes the ``onnxruntime`` target writes (GroupQueryAttention's CPU kernels).
ORT_DTYPES = ("float32", "float16")
_MODEL_DTYPES = ("float32", "float16", "bfloat16")
#: Largest dims read from untrusted metadata (a sanity bound, far above any real model).
_LIMITS = {"num_layers": 1024, "kv_heads": 4096, "num_heads": 4096, "head_dim": 65536, "vocab_size": 1 << 24,
           "max_length": 1 << 22, "hidden_size": 1 << 20}
#: The ``kind`` of each input in the metadata, which ``validate`` reads to generate a feed.
INPUT_KINDS = {INPUT_IDS: "token_ids", ATTENTION_MASK: "mask", POSITION_IDS: "positions"}
CACHE_KIND = "kv_cache"


class KVCacheError(UserError):
    """A model that does not follow the KV-cache convention, or damaged KV-cache metadata."""


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    """The KV-cache convention of one model (see the module docstring)."""

    num_layers: int
    num_heads: int  # query heads
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_length: int  # past + sequence can never exceed it (the model's positions)
    dtype: str  # of past/present and logits
    target: str = "portable"
    past_present_share_buffer: bool = False
    convention: str = CONVENTION
    #: LongRoPE: a run whose longest row is longer than this rotates every token with the long table
    #: (transformers decides per forward, for the whole batch), else with the short one.
    rotary_switch: int | None = None
    #: A decode loop whose cache grows past this length in one run drops its cache and runs the whole
    #: sequence instead, once (transformers' ``generate`` for Phi-3: then no cached key keeps the short table).
    recompute_past: int | None = None

    def __post_init__(self) -> None:
        for name, limit in _LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise KVCacheError(f"KV-cache layout: {name} must be an integer in [1, {limit}], got {value!r}")
        if self.num_heads % self.kv_heads:
            raise KVCacheError(f"KV-cache layout: {self.num_heads} query heads do not share {self.kv_heads} "
                               "key/value heads evenly")
        if self.dtype not in _MODEL_DTYPES:
            raise KVCacheError(f"KV-cache layout: dtype {self.dtype!r} is not one of {', '.join(_MODEL_DTYPES)}")
        if self.target not in TARGETS:
            raise KVCacheError(f"KV-cache layout: target {self.target!r} is not one of {', '.join(TARGETS)}")
        if not isinstance(self.past_present_share_buffer, bool):
            raise KVCacheError("KV-cache layout: past_present_share_buffer must be true or false")
        for name in ("rotary_switch", "recompute_past"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise KVCacheError(f"KV-cache layout: {name} must be null or an integer >= 1, got {value!r}")
        if self.convention != CONVENTION:
            raise KVCacheError(f"KV-cache convention {self.convention!r} is not {CONVENTION!r}; export the model "
                               "again with this version")

    # -- names ------------------------------------------------------------------------------
    def past_names(self) -> list[str]:
        return [n % i for i in range(self.num_layers) for n in (PAST_KEY, PAST_VALUE)]

    def present_names(self) -> list[str]:
        return [n % i for i in range(self.num_layers) for n in (PRESENT_KEY, PRESENT_VALUE)]

    def input_names(self) -> list[str]:
        return [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *self.past_names()]

    def output_names(self) -> list[str]:
        return [LOGITS, *self.present_names()]

    def cache_shape(self, *, length: str | int = PAST, batch: str | int = BATCH) -> list[str | int]:
        return [batch, self.kv_heads, length, self.head_dim]

    def inputs(self) -> dict[str, tuple[str, list[str | int]]]:
        """``{name: (dtype, shape)}`` of every input; strings are dynamic dims."""
        io = {INPUT_IDS: ("int64", [BATCH, SEQUENCE]), ATTENTION_MASK: ("int64", [BATCH, TOTAL]),
              POSITION_IDS: ("int64", [BATCH, SEQUENCE])}
        io.update({n: (self.dtype, self.cache_shape()) for n in self.past_names()})
        return io

    def outputs(self) -> dict[str, tuple[str, list[str | int]]]:
        io = {LOGITS: (self.dtype, [BATCH, SEQUENCE, self.vocab_size])}
        io.update({n: (self.dtype, self.cache_shape(length=TOTAL)) for n in self.present_names()})
        return io

    def metadata_inputs(self) -> dict[str, dict[str, Any]]:
        """The ``inputs`` entry of :class:`~rmsnorm_deploy.graph.metadata.ModelMetadata`."""
        out: dict[str, dict[str, Any]] = {}
        for name, (dtype, shape) in self.inputs().items():
            out[name] = {"dtype": dtype, "shape": shape, "kind": INPUT_KINDS.get(name, CACHE_KIND)}
        out[INPUT_IDS]["high"] = self.vocab_size
        return out

    def dims(self, *, batch: int, sequence: int, max_batch: int) -> dict[str, list[int]]:
        """``{dim: [min, opt, max]}`` for the metadata; ``past`` may be 0, ``total`` at least 1."""
        top = self.max_length
        sequence = min(sequence, top)
        return {BATCH: [1, batch, max(batch, max_batch)], SEQUENCE: [1, sequence, top],
                PAST: [0, max(0, min(sequence, top - 1)), top - 1], TOTAL: [1, min(2 * sequence, top), top]}

    # -- metadata ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in ("rotary_switch", "recompute_past"):  # written where a model has them
            if d[name] is None:
                del d[name]
        d["inputs"] = {"input_ids": INPUT_IDS, "attention_mask": ATTENTION_MASK, "position_ids": POSITION_IDS,
                       "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE}
        d["outputs"] = {"logits": LOGITS, "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE}
        return d

    @classmethod
    def from_dict(cls, data: Any) -> KVCacheLayout:
        """A layout from untrusted metadata: every field checked, one-line error otherwise."""
        if not isinstance(data, Mapping):
            raise KVCacheError(f"the model's kv_cache metadata is {type(data).__name__}, not an object; export it again")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data and n not in ("target", "past_present_share_buffer", "convention", "rotary_switch", "recompute_past")]
        if missing:
            raise KVCacheError(f"the model's kv_cache metadata lacks {', '.join(missing)}; export it again")
        for key, expected in (("inputs", cls.to_dict_names()[0]), ("outputs", cls.to_dict_names()[1])):
            if key in data and data[key] != expected:
                raise KVCacheError(f"the model's kv_cache metadata names its {key} {data[key]!r}, not the "
                                   f"convention's {expected!r}")
        return cls(**{n: data[n] for n in names if n in data})

    @staticmethod
    def to_dict_names() -> tuple[dict[str, str], dict[str, str]]:
        return ({"input_ids": INPUT_IDS, "attention_mask": ATTENTION_MASK, "position_ids": POSITION_IDS,
                 "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE},
                {"logits": LOGITS, "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE})

    @classmethod
    def from_hf_config(cls, config: Any, dtype: str, *, target: str = "portable") -> KVCacheLayout:
        """The layout of a transformers causal-LM config (``head_dim`` from the config when it has one)."""
        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(num_layers=int(text.num_hidden_layers), num_heads=heads,
                   kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   hidden_size=int(text.hidden_size), vocab_size=int(text.vocab_size),
                   max_length=int(getattr(text, "max_position_embeddings", None) or 2048), dtype=dtype, target=target)


def layout_of(meta: Any, *, what: str = "the model") -> KVCacheLayout:
    """The KV-cache layout recorded in ``meta`` (a ``ModelMetadata`` or ``None``), or a one-line refusal."""
    raw = getattr(meta, "kv_cache", None) if meta is not None else None
    if not raw:
        raise KVCacheError(f"{what} is not a KV-cache model (its metadata records no kv_cache); export it with "
                           "`rmsnorm-deploy export MODEL --kv-cache` (a graph optimum or onnxruntime-genai wrote "
                           "records none: its layout is not read from guesses)")
    return KVCacheLayout.from_dict(raw)


def check_io(layout: KVCacheLayout, inputs: Mapping[str, tuple[str, Sequence[Any]]],
             outputs: Mapping[str, tuple[str, Sequence[Any]]], *, what: str = "the model") -> None:
    """The graph's real inputs and outputs (``{name: (dtype, shape)}``, shapes with ints for static
    dims and anything else for dynamic ones) against ``layout``; one line naming the first mismatch."""
    for kind, real, want in (("input", inputs, layout.inputs()), ("output", outputs, layout.outputs())):
        missing = [n for n in want if n not in real]
        extra = [n for n in real if n not in want]
        if missing or extra:
            raise KVCacheError(f"{what} does not follow the KV-cache convention: {kind}s missing "
                               f"{missing[:3]}, unexpected {extra[:3]}")
        for name, (dtype, shape) in want.items():
            got_dtype, got_shape = real[name]
            if got_dtype != dtype:
                raise KVCacheError(f"{what}: {kind} {name!r} is {got_dtype}, the KV-cache convention says {dtype}")
            if len(got_shape) != len(shape) or any(
                    isinstance(w, int) and isinstance(g, int) and w != g for w, g in zip(shape, got_shape)):
                raise KVCacheError(f"{what}: {kind} {name!r} has shape {list(got_shape)}, the KV-cache convention "
                                   f"says {shape}")
            if any(isinstance(w, str) and isinstance(g, int) and g != 0 for w, g in zip(shape, got_shape)
                   if w in (SEQUENCE, PAST, TOTAL)):
                raise KVCacheError(f"{what}: {kind} {name!r} has a fixed length {list(got_shape)}; the KV-cache "
                                   "convention needs dynamic sequence and past lengths")


def graph_io(model: Any) -> tuple[dict[str, tuple[str, list[Any]]], dict[str, tuple[str, list[Any]]]]:
    """``{name: (dtype, shape)}`` of an ``onnx.ModelProto``'s inputs and outputs (dims as int or str)."""
    import onnx

    def one(values: Any) -> dict[str, tuple[str, list[Any]]]:
        out = {}
        for v in values:
            t = v.type.tensor_type
            try:
                dtype = onnx.TensorProto.DataType.Name(t.elem_type).lower()
                dtype = {"float": "float32", "double": "float64"}.get(dtype, dtype)
            except ValueError:  # an unknown element type: reported as its number
                dtype = f"type {t.elem_type}"
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
            out[v.name] = (dtype, shape)
        return out

    initializers = {i.name for i in model.graph.initializer}
    return one(v for v in model.graph.input if v.name not in initializers), one(model.graph.output)


# -- feeds --------------------------------------------------------------------------------
def position_ids_for(attention_mask: np.ndarray, sequence: int) -> np.ndarray:
    """Positions of the last ``sequence`` slots: ``cumsum(mask) - 1``, padded slots 1 (as transformers)."""
    mask = np.asarray(attention_mask, dtype=np.int64)
    pos = np.cumsum(mask, axis=-1) - 1
    pos = np.where(mask == 0, 1, pos)
    return np.ascontiguousarray(pos[:, mask.shape[1] - sequence:])


def left_padded(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)`` of prompts of different lengths, padded on the left."""
    if not rows or any(len(r) == 0 for r in rows):
        raise KVCacheError("every prompt needs at least one token")
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), int(pad_token_id), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = np.asarray(row, dtype=np.int64)
        mask[i, width - len(row):] = 1
    return ids, mask


def empty_past(layout: KVCacheLayout, batch: int) -> dict[str, np.ndarray]:
    """Zero-length past tensors for a prefill (``past = 0``)."""

    dtype = numpy_dtype(layout.dtype)
    return {n: np.zeros((batch, layout.kv_heads, 0, layout.head_dim), dtype=dtype) for n in layout.past_names()}
