"""The decode loop of a KV-cache graph, written once; each backend supplies only "run one step".

:func:`decode_loop` is the loop every client of the optimum / onnxruntime-genai convention
runs: one prefill over the (left-padded) prompts with an empty cache, then one step per new
token with ``sequence = 1``. It owns everything but the run itself:

- the attention mask, grown by one slot per step (left padding kept: zeros stay at the front);
- the positions, ``cumsum(mask) - 1`` with padded slots 1
  (``decoder.convention.position_ids_for``, computed once for the whole run);
- picking the next token (:func:`token_picker`: greedy ``argmax``, the first index on ties as
  torch, or seeded sampling with a temperature and top-k);
- stopping: a row that emits an end-of-sequence token gets the pad token afterwards, and the
  loop ends when every row has ended or ``max_new_tokens`` are out (transformers' ``generate``);
- the timings (a step's time includes picking its token) and, on request, each step's logits.

A backend is a :class:`Step`: ``empty_cache(batch)`` and ``run(input_ids, attention_mask,
position_ids, cache) -> (last-position logits, next cache)``; the cache is the backend's own
object (``OrtValue``\\ s, torch CUDA tensors), never copied through numpy by the loop.

- :class:`OrtStep`: ONNX Runtime with one IOBinding per generation. Two cache modes: separate
  past and present (``past_present_share_buffer: false``: each step's presents are bound as the
  next step's pasts) or one shared buffer (``true``, onnxruntime-genai's mode: a [batch,
  kv_heads, max_length, head_dim] ``OrtValue`` per cache tensor bound as both past input and
  present output, written in place by GroupQueryAttention). ``position_ids`` is fed when the
  graph takes it (onnxruntime-genai's graphs derive positions from the mask themselves).
- TensorRT's step is ``tensorrt.runner.TensorRTStep`` (prefill and decode profiles).
- transformers' own forward and cache, the reference the graphs are compared with, is
  ``decoder.transformers_step.TransformersStep``; :func:`forced` feeds it the tokens a graph chose.

:class:`KVDecoderRunner` is a KV-cache graph in an ONNX Runtime CPU session with greedy
decoding that ignores end-of-sequence tokens (the benchmarks' and the export-time parity's
loop); ``decoder.generate`` is the user-facing API over the same loop.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np

from rmsnorm_deploy.decoder.convention import ATTENTION_MASK, INPUT_IDS, LOGITS, POSITION_IDS, position_ids_for
from rmsnorm_deploy.errors import InputError, UserError, one_line
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.runners.onnxruntime import ortvalue_to_numpy


# -- picking the next token --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy when ``do_sample`` is false; otherwise softmax(logits / temperature) over the top-k,
    then over the smallest set of most likely tokens whose probability reaches ``top_p``."""

    do_sample: bool = False
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary
    top_p: float = 1.0  # 1: no nucleus cut

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UserError(f"--seed must be an integer >= 0, got {self.seed!r}")
        if not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(f"--temperature must be a finite number > 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"--top-k must be an integer >= 0 (0: no limit), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise UserError(f"--top-p must be a number > 0 and <= 1 (1: no cut), got {self.top_p!r}")


def greedy(logits: np.ndarray) -> np.ndarray:
    """The most likely token of each row (the first index on ties, as torch's ``argmax``)."""
    return np.argmax(logits, axis=-1)


def token_picker(sampling: Sampling | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """``pick(logits [batch, vocab]) -> tokens [batch]`` for ``sampling`` (its own seeded generator)."""
    sampling = sampling or Sampling()
    if not sampling.do_sample:
        return greedy
    rng = np.random.default_rng(sampling.seed)

    def sample(logits: np.ndarray) -> np.ndarray:
        probs = sampling_probabilities(logits, sampling)
        return np.array([rng.choice(probs.shape[-1], p=p) for p in probs], dtype=np.int64)

    return sample


def sampling_probabilities(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """The distribution ``sampling`` draws from, float64 [..., vocab]: softmax(logits / temperature)
    cut to the top-k, then to the nucleus (the sampler and speculation's acceptance rule read it)."""
    # The largest logit is subtracted before dividing: a tiny temperature then sends the others to
    # -inf (probability 0) instead of every logit to +-inf (inf - inf: NaN probabilities).
    shifted = np.asarray(logits).astype(np.float64)
    shifted -= shifted.max(axis=-1, keepdims=True)
    if not np.isfinite(shifted).any(axis=-1).all():
        raise InputError("the model's logits are not finite (NaN or infinite); no token can be sampled")
    with np.errstate(over="ignore"):  # -inf for every token far below the best: probability 0
        scaled = shifted / sampling.temperature
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -sampling.top_k, axis=-1)[..., -sampling.top_k][..., None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if sampling.top_p < 1:
        probs = nucleus(probs, sampling.top_p)
    return probs


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """``probs`` [batch, vocab] kept on each row's smallest set of most likely tokens whose sum
    reaches ``top_p`` (the most likely always kept; ties in the order of their ids), renormalized."""
    order = np.argsort(-probs, axis=-1, kind="stable")
    ranked = np.take_along_axis(probs, order, axis=-1)
    keep = np.zeros(probs.shape, dtype=bool)
    np.put_along_axis(keep, order, np.cumsum(ranked, axis=-1) - ranked < top_p, axis=-1)
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)


def forced(tokens: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """``pick`` that hands out ``tokens`` [batch, steps] one column per step, whatever the logits:
    a reference fed the tokens another model chose (teacher forcing)."""
    columns = iter(np.asarray(tokens, dtype=np.int64).T)
    return lambda logits: next(columns)


# -- the loop ------------------------------------------------------------------------------------
class Step(Protocol):
    """What a backend supplies to :func:`decode_loop`."""

    def empty_cache(self, batch: int) -> Any:
        """The cache before the prefill (past length 0, or an empty shared buffer)."""

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: Any) -> tuple[np.ndarray, Any]:
        """One run: the last position's logits [batch, vocab] as numpy (valid until the next run:
        a backend may hand out its own output buffer), and the next step's cache."""


class VerifyingStep(Step, Protocol):
    """A step speculation can use (``decoder.speculative``): every position's logits of one run,
    and the cache cut back to its first ``length`` slots after rejected proposals."""

    def run_all(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                cache: Any) -> tuple[np.ndarray, Any]:
        """Like ``run``, with the logits of every fed position [batch, sequence, vocab] (the caller's copy)."""

    def rollback(self, cache: Any, length: int) -> Any:
        """The cache keeping only the slots of the first ``length`` mask columns."""


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # [batch, new tokens] int64 (pad after a row's end-of-sequence token)
    prefill_s: float
    decode_s: float  # all steps after the prefill
    steps: int  # decode steps run after the prefill (new tokens - 1)
    step_logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # with keep_logits
    step_s: list[float] = dataclasses.field(default_factory=list)  # each decode step's time

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * self.decode_s / self.steps if self.steps else 0.0


@dataclasses.dataclass
class DecodeClock:
    """Where :func:`decode_steps` spent its time (filled in as it runs)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0  # all steps after the prefill
    steps: int = 0  # decode steps run after the prefill
    step_s: list[float] = dataclasses.field(default_factory=list)  # each decode step's time


def decode_steps(step: Step, input_ids: np.ndarray, attention_mask: np.ndarray | None = None, *,
                 max_new_tokens: int, pick: Callable[[np.ndarray], np.ndarray] = greedy,
                 eos_token_ids: Iterable[int] = (), pad_token_id: int = 0,
                 clock: DecodeClock | None = None, speculation: Any = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The decode loop, lazily: each step's new tokens [batch] (pad after a row's end of sequence)
    and the last-position logits they were picked from. The model runs the next step only when
    the next token is asked for, so a stream can hand each token out before the next is made.
    ``input_ids`` [batch, prompt], left padding marked by zeros in ``attention_mask``;
    ``eos_token_ids`` empty: never stop early. Times go to ``clock``. The arguments are checked
    before the first step runs. A step with a ``recompute_past`` (Phi-3's LongRoPE switch) runs the
    whole sequence from an empty cache at the step that grows its cache past it, as transformers'
    ``generate`` does. ``speculation`` (a ``decoder.speculative.Speculator``) proposes tokens and
    verifies several in one run: the same loop, several tokens per run."""
    ids = np.ascontiguousarray(input_ids, dtype=np.int64)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise InputError(f"input_ids must be [batch >= 1, prompt >= 1], got shape {list(ids.shape)}")
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    if mask.shape != ids.shape:
        raise InputError(f"attention_mask has shape {list(mask.shape)}, input_ids {list(ids.shape)}")
    if speculation is not None:
        return speculation.steps(step, ids, mask, max_new_tokens, pick, eos_token_ids, pad_token_id,
                                 clock or DecodeClock())
    return _steps(step, ids, mask, max_new_tokens, pick, eos_token_ids, pad_token_id, clock or DecodeClock())


def _steps(step: Step, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int,
           pick: Callable[[np.ndarray], np.ndarray], eos_token_ids: Iterable[int], pad_token_id: int,
           clock: DecodeClock) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    batch, prompt = ids.shape
    # The whole run's mask and positions at once: each step reads a prefix (cumsum is causal).
    total = np.ones((batch, prompt + max_new_tokens), dtype=np.int64)
    total[:, :prompt] = mask
    recompute = getattr(step, "recompute_past", None)
    history = np.zeros_like(total)  # every token so far, for a step that runs the whole sequence again
    history[:, :prompt] = ids
    positions = position_ids_for(total, total.shape[1])
    eos = np.array(sorted({int(t) for t in eos_token_ids}), dtype=np.int64)
    finished = np.zeros(batch, dtype=bool)
    cache = step.empty_cache(batch)
    step_ids, made = ids, 0
    while True:
        length = prompt + made
        started = time.perf_counter()
        if made and recompute is not None and length - 1 <= recompute < length:
            # transformers' generate (Phi-3): the cache is dropped once and the whole sequence runs again
            cache, step_ids = step.empty_cache(batch), np.ascontiguousarray(history[:, :length])
        logits, cache = step.run(step_ids, np.ascontiguousarray(total[:, :length]),
                                 np.ascontiguousarray(positions[:, length - step_ids.shape[1]:length]), cache)
        token = np.array(pick(logits), dtype=np.int64)  # our own copy: a picker may hand out a view
        if eos.size:
            token[finished] = pad_token_id
        elapsed = time.perf_counter() - started
        if made:
            clock.decode_s += elapsed
            clock.steps += 1
            clock.step_s.append(elapsed)
        else:
            clock.prefill_s = elapsed
        made += 1
        history[:, prompt + made - 1] = token
        if eos.size:
            finished |= np.isin(token, eos)
        yield token, logits
        if made == max_new_tokens or (eos.size and finished.all()):
            return
        step_ids = token[:, None]  # a view of a contiguous row: contiguous


def decode_loop(step: Step, input_ids: np.ndarray, attention_mask: np.ndarray | None = None, *,
                max_new_tokens: int, pick: Callable[[np.ndarray], np.ndarray] = greedy,
                eos_token_ids: Iterable[int] = (), pad_token_id: int = 0, keep_logits: bool = False,
                on_token: Callable[[np.ndarray], None] | None = None, speculation: Any = None) -> Generation:
    """:func:`decode_steps` run to the end: up to ``max_new_tokens`` new tokens, their timings and
    (``keep_logits``) each step's logits. ``on_token(tokens [batch])`` is called with each step's
    new tokens. ``speculation``: see :func:`decode_steps` (``steps`` then counts tokens, not runs)."""
    clock = DecodeClock()
    tokens: list[np.ndarray] = []
    kept: list[np.ndarray] = []
    for token, logits in decode_steps(step, input_ids, attention_mask, max_new_tokens=max_new_tokens, pick=pick,
                                      eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, clock=clock,
                                      speculation=speculation):
        tokens.append(token)
        if keep_logits:
            kept.append(np.array(logits, copy=True))
        if on_token is not None:
            on_token(token)
    return Generation(np.stack(tokens, axis=1), clock.prefill_s, clock.decode_s, clock.steps, kept, clock.step_s)


# -- ONNX Runtime's step -------------------------------------------------------------------------
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
        binding = self.session.io_binding()
        binding.bind_output(LOGITS, "cpu")  # first: outputs come back in binding order
        length = lay.max_length if lay.share_buffer else 0
        values = [self._value(np.zeros((batch, lay.kv_heads, length, lay.head_dim), self.dtype))
                  for _ in lay.pairs()]
        if lay.share_buffer:  # bound once: GroupQueryAttention writes each step in place
            for (past, present), value in zip(lay.pairs(), values):
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
        so = session_options or ort.SessionOptions()
        so.intra_op_num_threads = threads
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
