"""ONNX Runtime's step of the decode loop (``decoder.loop.Step``): one run of a KV-cache graph through IOBinding.

:class:`OrtStep` runs one step and owns how the cache is bound; the loop (``decoder.loop``) owns
everything else. Two cache modes:

- separate past and present (``past_present_share_buffer: false``): each step's presents are
  bound as the next step's pasts;
- one shared buffer (``true``, onnxruntime-genai's mode): a [batch, kv_heads, max_length,
  head_dim] ``OrtValue`` per cache tensor bound as both past input and present output, written in
  place by GroupQueryAttention. :meth:`OrtStep.cache_over` binds memory the caller owns the same
  way: the serving engine's slots (``serving.engine.slots``) run their prefills, checks and
  batched decode steps through this one step.

``position_ids`` is fed when the graph takes it (onnxruntime-genai's graphs derive positions from
the mask themselves). A one-token step after the first keeps its inputs and logits bound, written
in place. :class:`KVDecoderRunner` is a KV-cache graph in an ONNX Runtime CPU session with greedy
decoding that ignores end-of-sequence tokens (the benchmarks' and the export-time parity's loop).
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Sequence

import numpy as np

from rmsnorm_deploy.decoder.convention import ATTENTION_MASK, INPUT_IDS, LOGITS, POSITION_IDS
from rmsnorm_deploy.decoder.loop import Generation, decode_loop
from rmsnorm_deploy.errors import InputError, UserError, one_line
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.runners.int8_gemm import exact_integer_matmuls
from rmsnorm_deploy.runners.onnxruntime import optimization_level, ortvalue_to_numpy

#: ONNX Runtime's graph optimization level for decoding on CPU (GPU sessions keep ``all``: not
#: measured there). ``extended`` writes the same
#: graph as ``all`` (level 3 adds layout transforms for convolutions) and the logits are
#: bit-identical (checked on real SmolLM2 and Gemma 3 float32 and int4, and by the tests), yet a
#: decode step took 7-10 % less time (real SmolLM2 float32, 2 threads, 16 interleaved rounds,
#: weights prepacked in both: 20.7 and 22.6 ms against 23.2 and 25.8 ms).
DECODE_OPTIMIZATION = "extended"


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The past/present tensors of a graph as one step binds them (from our metadata, or given for
    a foreign graph such as onnxruntime-genai's or optimum's)."""

    layers: int
    kv_heads: int
    head_dim: int
    share_buffer: bool = False
    max_length: int = 0  # the shared buffer's length (share_buffer only)
    #: GroupQueryAttention's graph (``--target onnxruntime``): its CPU kernel takes several new
    #: tokens after a past only for a batch of one (speculation checks one row at a time).
    grouped_query_attention: bool = False
    recompute_past: int | None = None  # see decoder.convention.KVCacheLayout and decode_steps
    past_key: str = "past_key_values.{i}.key"
    past_value: str = "past_key_values.{i}.value"
    present_key: str = "present.{i}.key"
    present_value: str = "present.{i}.value"

    @classmethod
    def from_metadata(cls, kv_cache: dict[str, Any]) -> CacheLayout:
        try:
            return cls(layers=int(kv_cache["num_layers"]), kv_heads=int(kv_cache["kv_heads"]),
                       head_dim=int(kv_cache["head_dim"]),
                       share_buffer=bool(kv_cache.get("past_present_share_buffer", False)),
                       max_length=int(kv_cache.get("max_length", 0)),
                       grouped_query_attention=kv_cache.get("target") == "onnxruntime",
                       recompute_past=(None if kv_cache.get("recompute_past") is None
                                       else int(kv_cache["recompute_past"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"the model's kv_cache metadata is incomplete ({exc!r}); export it again") from None

    @classmethod
    def of(cls, layout: Any) -> CacheLayout:
        """From an ``decoder.convention.KVCacheLayout`` (already checked)."""
        return cls(layers=layout.num_layers, kv_heads=layout.kv_heads, head_dim=layout.head_dim,
                   share_buffer=layout.past_present_share_buffer, max_length=layout.max_length,
                   grouped_query_attention=layout.target == "onnxruntime",
                   recompute_past=layout.recompute_past)

    def pairs(self) -> list[tuple[str, str]]:
        out = []
        for i in range(self.layers):
            out.append((self.past_key.format(i=i), self.present_key.format(i=i)))
            out.append((self.past_value.format(i=i), self.present_value.format(i=i)))
        return out


@dataclasses.dataclass
class _OrtCache:
    binding: Any  # one IOBinding for the whole generation
    values: list[Any]  # the past OrtValues, in ``CacheLayout.pairs()`` order
    batch: int
    vocab: int = 0  # known after the prefill
    #: The decode steps' [batch, 1, vocab] logits: a numpy array bound as the output, so a step
    #: reads it in place instead of asking the binding for its outputs.
    logits: np.ndarray | None = None
    #: The decode steps' [batch, 1] input_ids and position_ids, bound once and written in place.
    step_inputs: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    step_bound: bool = False  # whether step_inputs and logits are what the binding holds now


class OrtStep:
    """One run of a KV-cache graph in an ONNX Runtime session, past/present bound through IOBinding."""

    def __init__(self, session: Any, layout: CacheLayout, *, dtype: Any = np.float32, device: str = "cpu"):
        self.ort = require("onnxruntime", "running a KV-cache model")
        self.session, self.layout, self.device = session, layout, device
        self.dtype = np.dtype(dtype)
        self.input_names = {i.name for i in session.get_inputs()}
        missing = [p for p, _ in layout.pairs() if p not in self.input_names]
        if missing or ATTENTION_MASK not in self.input_names:
            raise InputError(f"the model is not a KV-cache graph in the optimum/onnxruntime-genai convention "
                             f"(missing {', '.join((missing or [ATTENTION_MASK])[:3])})")
        self.takes_positions = POSITION_IDS in self.input_names
        self.recompute_past = layout.recompute_past
        self._bf16 = self.dtype.name == "bfloat16"

    def _value(self, array: np.ndarray) -> Any:
        if self._bf16:
            from onnx import TensorProto

            return self.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(array).view(np.uint16), TensorProto.BFLOAT16)
        return self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, 0)

    def empty_cache(self, batch: int) -> _OrtCache:
        lay = self.layout
        length = lay.max_length if lay.share_buffer else 0
        values = [self._value(np.zeros((batch, lay.kv_heads, length, lay.head_dim), self.dtype))
                  for _ in lay.pairs()]
        return self._bound(values, batch)

    def cache_over(self, arrays: Sequence[np.ndarray], logits: np.ndarray | None = None) -> _OrtCache:
        """A shared-buffer cache over host memory the caller owns and keeps alive: one C-contiguous
        [batch, kv_heads, length, head_dim] array per past/present pair (``CacheLayout.pairs()``
        order), bound without a copy; ``logits`` [batch, 1, vocab]: where one-token runs write
        their logits (else allocated at the first). The length a run may reach is the layout's
        ``max_length`` (give the step a layout with the arrays' length)."""
        if not self.layout.share_buffer or self.device != "cpu" or self._bf16:
            raise InputError("cache_over binds float host arrays as one shared buffer; this step's layout is not that")
        values = [self.ort.OrtValue.ortvalue_from_numpy(array) for array in arrays]
        cache = self._bound(values, int(arrays[0].shape[0]))
        if logits is not None:
            cache.logits, cache.vocab = logits, int(logits.shape[-1])
        return cache

    def _bound(self, values: list[Any], batch: int) -> _OrtCache:
        binding = self.session.io_binding()
        binding.bind_output(LOGITS, "cpu")  # first: outputs come back in binding order
        if self.layout.share_buffer:  # bound once: GroupQueryAttention writes each step in place
            for (past, present), value in zip(self.layout.pairs(), values):
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
        return _OrtCache(binding, values, batch)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: _OrtCache) -> tuple[np.ndarray, _OrtCache]:
        logits, cache = self._run(input_ids, attention_mask, position_ids, cache)
        if logits is cache.logits:
            return logits[:, -1, :], cache
        if self._bf16:  # numpy has no bfloat16 of its own: read the memory, compare in float32
            return ortvalue_to_numpy(logits)[:, -1, :].astype(np.float32), cache
        return np.array(logits.numpy()[:, -1, :]), cache  # a copy: the prefill's output is freed next step

    def run_all(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                cache: _OrtCache) -> tuple[np.ndarray, _OrtCache]:
        """Every fed position's logits [batch, sequence, vocab] (speculation's verification)."""
        logits, cache = self._run(input_ids, attention_mask, position_ids, cache)
        if logits is cache.logits:
            return np.array(logits), cache
        return ortvalue_to_numpy(logits).astype(np.float32, copy=False), cache

    def rollback(self, cache: _OrtCache, length: int) -> _OrtCache:
        """The cache cut to its first ``length`` slots. A shared buffer is left as it is:
        GroupQueryAttention reads and writes each row at ``sum(attention_mask)`` (seqlens_k), so
        the next run's shorter mask forgets the rejected slots and overwrites them. Separate past
        and present: each present is sliced (valid keys first on the onnxruntime target, one slot
        per mask column on the portable one: the first ``length`` slots hold every kept key)."""
        if self.layout.share_buffer or not cache.values or cache.values[0].shape()[2] == length:
            return cache
        # A copy: the view reads the old present's memory, freed when it is replaced.
        cache.values = [self._value(np.array(_host_view(v)[:, :, :length], copy=True)) for v in cache.values]
        return cache

    def _run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             cache: _OrtCache) -> tuple[Any, _OrtCache]:
        """One run; the logits as ``cache.logits`` (a one-token step's bound numpy buffer) or an OrtValue."""
        lay, binding = self.layout, cache.binding
        if lay.share_buffer and attention_mask.shape[1] > lay.max_length:
            raise InputError(f"{attention_mask.shape[1]} tokens exceed the shared buffer's {lay.max_length}")
        decoding = input_ids.shape[1] == 1 and attention_mask.shape[1] > 1 and cache.vocab > 0 and not self._bf16
        binding.bind_cpu_input(ATTENTION_MASK, attention_mask)
        fixed = {INPUT_IDS: input_ids, **({POSITION_IDS: position_ids} if self.takes_positions else {})}
        if decoding:
            if not cache.step_inputs:  # the first decode step: [batch, 1] buffers, bound for good
                cache.step_inputs = {name: np.empty((cache.batch, 1), np.int64) for name in fixed}
                if cache.logits is None:  # (cache_over may have been given the caller's)
                    cache.logits = np.empty((cache.batch, 1, cache.vocab), self.dtype)
            if not cache.step_bound:  # again after a run of several tokens (speculation) rebound them
                for name, array in cache.step_inputs.items():
                    binding.bind_ortvalue_input(name, self.ort.OrtValue.ortvalue_from_numpy(array))
                binding.bind_ortvalue_output(LOGITS, self.ort.OrtValue.ortvalue_from_numpy(cache.logits))
                cache.step_bound = True
            for name, array in fixed.items():
                np.copyto(cache.step_inputs[name], array)
        else:
            for name, array in fixed.items():
                binding.bind_cpu_input(name, array)
            if cache.vocab:  # a bound output keeps its first shape: a new one for this run's
                binding.bind_output(LOGITS, "cpu")
            cache.step_bound = False
        if not lay.share_buffer:
            for (past, present), value in zip(lay.pairs(), cache.values):
                binding.bind_ortvalue_input(past, value)
                binding.bind_output(present, self.device)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:
            raise UserError(f"ONNX Runtime failed to run a generation step: {one_line(exc)}") from None
        if decoding and lay.share_buffer:
            # Nothing to collect: the cache was written in place, the logits into cache.logits.
            return cache.logits, cache
        outputs = binding.get_outputs()
        if not lay.share_buffer:
            cache.values = list(outputs[1:])
        if decoding:
            return cache.logits, cache
        cache.vocab = int(outputs[0].shape()[-1])
        return outputs[0], cache


def _host_view(value: Any) -> np.ndarray:
    """A CPU float ``OrtValue``'s memory as numpy without a copy (anything else: copied to the host)."""
    ctype = {"tensor(float)": (ctypes.c_float, np.float32), "tensor(float16)": (ctypes.c_uint16, np.float16)}
    kind, shape = ctype.get(value.data_type()), tuple(value.shape())
    count = int(np.prod(shape)) if shape else 1
    if kind is None or not count or value.device_name().lower() != "cpu":
        return ortvalue_to_numpy(value)
    buffer = (kind[0] * count).from_address(value.data_ptr())
    return np.ctypeslib.as_array(buffer).view(kind[1]).reshape(shape)


class KVDecoderRunner:
    """A KV-cache graph in an ONNX Runtime CPU session; :meth:`greedy` decodes with IOBinding."""

    def __init__(self, model: Any, layout: CacheLayout | None = None, *, threads: int = 2,
                 session_options: Any = None, dtype: Any = np.float32):
        ort = require("onnxruntime", "running a KV-cache model")
        so = session_options
        if so is None:
            so = ort.SessionOptions()
            so.graph_optimization_level = optimization_level(DECODE_OPTIMIZATION)
        so.intra_op_num_threads = threads
        exact_integer_matmuls(so)
        source = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
        self.session = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
        if layout is None:
            layout = CacheLayout.from_metadata(_kv_metadata(self.session))
        self.layout = layout
        self.step = OrtStep(self.session, layout, dtype=dtype)

    @property
    def takes_positions(self) -> bool:
        return self.step.takes_positions

    def greedy(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None, *, new_tokens: int = 32,
               keep_logits: bool = False) -> Generation:
        """``new_tokens`` greedy tokens after ``input_ids`` [batch, prompt] (left padding in
        ``attention_mask``); ignores end-of-sequence tokens (a benchmark and parity loop)."""
        prompt = np.shape(input_ids)[-1] if np.ndim(input_ids) == 2 else 0
        lay = self.layout
        if lay.share_buffer and isinstance(new_tokens, int) and prompt + new_tokens > lay.max_length:
            raise InputError(f"prompt {prompt} + {new_tokens} new tokens exceed the shared buffer's {lay.max_length}")
        return decode_loop(self.step, input_ids, attention_mask, max_new_tokens=new_tokens, keep_logits=keep_logits)


def _kv_metadata(session: Any) -> dict[str, Any]:
    import json

    props = session.get_modelmeta().custom_metadata_map
    raw = props.get("rmsnorm_deploy.kv_cache")
    if raw is None:
        raise InputError("the model has no rmsnorm_deploy KV-cache metadata; give its CacheLayout")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InputError(f"the model's kv_cache metadata is damaged ({exc}); export it again") from None
    if not isinstance(data, dict):
        raise InputError("the model's kv_cache metadata is not an object; export it again")
    return data
