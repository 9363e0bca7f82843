"""``KVDecoderRunner``: greedy decoding of a KV-cache graph in ONNX Runtime, with IOBinding.

One loop for every graph in the optimum / onnxruntime-genai convention (ours, either target,
or onnxruntime-genai's builder output): past and present stay ``OrtValue``s between steps,
never copied through numpy. Two cache modes:

- separate past and present (``past_present_share_buffer: false``): each step's present
  outputs are bound as the next step's past inputs;
- one shared buffer (``true``, onnxruntime-genai's mode): a [batch, kv_heads, max_length,
  head_dim] ``OrtValue`` per cache tensor, bound as both past input and present output, so
  GroupQueryAttention writes the new keys and values in place.

``position_ids`` is fed when the graph takes it (cumsum(mask) - 1, so left padding works);
onnxruntime-genai's graphs derive positions from the mask themselves.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from rmsnorm_deploy.errors import InputError
from rmsnorm_deploy.optional import require


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    layers: int
    kv_heads: int
    head_dim: int
    share_buffer: bool = False
    max_length: int = 0  # the shared buffer's length (share_buffer only)
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
                       max_length=int(kv_cache.get("max_length", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"the model's kv_cache metadata is incomplete ({exc!r}); export it again") from None

    def pairs(self) -> list[tuple[str, str]]:
        out = []
        for i in range(self.layers):
            out.append((self.past_key.format(i=i), self.present_key.format(i=i)))
            out.append((self.past_value.format(i=i), self.present_value.format(i=i)))
        return out


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # [batch, new_tokens] int64
    prefill_s: float
    decode_s: float  # all steps after the prefill
    steps: int  # decode steps (new_tokens - 1)
    step_logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # with keep_logits

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * self.decode_s / max(1, self.steps)


class KVDecoderRunner:
    """A KV-cache graph in an ONNX Runtime CPU session; :meth:`greedy` decodes with IOBinding."""

    def __init__(self, model: Any, layout: CacheLayout | None = None, *, threads: int = 2,
                 session_options: Any = None, dtype: Any = np.float32):
        ort = require("onnxruntime", "running a KV-cache model")
        so = session_options or ort.SessionOptions()
        so.intra_op_num_threads = threads
        source = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
        self.session = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
        if layout is None:
            layout = CacheLayout.from_metadata(_kv_metadata(self.session))
        self.layout = layout
        self.ort = ort
        self.dtype = np.dtype(dtype)
        self.input_names = {i.name for i in self.session.get_inputs()}
        missing = [p for p, _ in layout.pairs() if p not in self.input_names]
        if missing or "attention_mask" not in self.input_names:
            raise InputError(f"the model is not a KV-cache graph in the optimum/onnxruntime-genai convention "
                             f"(missing {', '.join((missing or ['attention_mask'])[:3])})")
        self.takes_positions = "position_ids" in self.input_names

    def greedy(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None, *, new_tokens: int = 32,
               keep_logits: bool = False) -> Generation:
        """``new_tokens`` greedy tokens after ``input_ids`` [batch, prompt] (left padding in
        ``attention_mask``); ignores end-of-sequence tokens (a benchmark and parity loop)."""
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] < 1 or new_tokens < 1:
            raise InputError(f"input_ids must be [batch, prompt >= 1] and new_tokens >= 1; got {ids.shape}, {new_tokens}")
        mask = np.ones_like(ids) if attention_mask is None else np.ascontiguousarray(attention_mask, dtype=np.int64)
        batch, prompt = ids.shape
        lay = self.layout
        if lay.share_buffer and prompt + new_tokens > lay.max_length:
            raise InputError(f"prompt {prompt} + {new_tokens} new tokens exceed the shared buffer's {lay.max_length}")
        ort = self.ort
        binding = self.session.io_binding()
        binding.bind_output("logits", "cpu")  # first: outputs come back in binding order
        caches: dict[str, Any] = {}
        for past, present in lay.pairs():
            length = lay.max_length if lay.share_buffer else 0
            caches[past] = ort.OrtValue.ortvalue_from_numpy(
                np.zeros((batch, lay.kv_heads, length, lay.head_dim), self.dtype))
            if lay.share_buffer:  # bound once: GroupQueryAttention writes each step in place
                binding.bind_ortvalue_input(past, caches[past])
                binding.bind_ortvalue_output(present, caches[past])
        # The decode steps' logits [batch, 1, vocab] land in one preallocated buffer.
        step_logits = logits_value = None
        out_tokens = np.zeros((batch, new_tokens), np.int64)
        logits_kept: list[np.ndarray] = []
        step_ids = ids
        total = np.zeros((batch, prompt + new_tokens), np.int64)
        total[:, :prompt] = mask
        total[:, prompt:] = 1
        positions_all = np.cumsum(total, axis=1) - 1
        positions_all[total == 0] = 1  # padded slots, as transformers writes them
        prefill_s = decode_s = 0.0
        for step in range(new_tokens):
            clock = time.perf_counter()
            length = prompt + step
            binding.bind_cpu_input("input_ids", step_ids)
            binding.bind_cpu_input("attention_mask", np.ascontiguousarray(total[:, :length]))
            if self.takes_positions:
                binding.bind_cpu_input("position_ids",
                                       np.ascontiguousarray(positions_all[:, length - step_ids.shape[1]:length]))
            if step == 1:
                vocab = logits_value.shape()[-1]
                step_logits = ort.OrtValue.ortvalue_from_numpy(np.empty((batch, 1, vocab), self.dtype))
                binding.bind_ortvalue_output("logits", step_logits)
            if not lay.share_buffer:
                for past, present in lay.pairs():
                    binding.bind_ortvalue_input(past, caches[past])
                    binding.bind_output(present, "cpu")
            self.session.run_with_iobinding(binding)
            values = binding.get_outputs()
            logits_value = values[0] if step == 0 else step_logits
            logits = logits_value.numpy()[:, -1, :]
            if keep_logits:
                logits_kept.append(logits.copy())
            token = logits.argmax(-1).astype(np.int64)
            out_tokens[:, step] = token
            if not lay.share_buffer:
                by_name = dict(zip(self._output_names(), values))
                for past, present in lay.pairs():
                    caches[past] = by_name[present]
            step_ids = np.ascontiguousarray(token[:, None])
            elapsed = time.perf_counter() - clock
            if step == 0:
                prefill_s = elapsed
            else:
                decode_s += elapsed
        return Generation(out_tokens, prefill_s, decode_s, new_tokens - 1, logits_kept)

    def _output_names(self) -> list[str]:
        names = ["logits"]
        for _, present in self.layout.pairs():
            names.append(present)
        return names


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
