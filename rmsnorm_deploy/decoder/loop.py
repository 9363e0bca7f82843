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

- ``decoder.ort_step.OrtStep``: ONNX Runtime with one IOBinding per generation, the cache in
  separate past and present tensors or one shared buffer (also the serving engine's slots).
- TensorRT's step is ``tensorrt.runner.TensorRTStep`` (prefill and decode profiles).
- transformers' own forward and cache, the reference the graphs are compared with, is
  ``decoder.transformers_step.TransformersStep``; :func:`forced` feeds it the tokens a graph chose.

``decoder.generate`` is the user-facing API over this loop.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np

from rmsnorm_deploy.decoder.convention import position_ids_for
from rmsnorm_deploy.errors import InputError, UserError


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
