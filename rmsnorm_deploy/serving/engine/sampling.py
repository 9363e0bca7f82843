"""How one stream of the engine picks its tokens when a request asks for more than ``generate``'s
``Sampling``: OpenAI's ``logit_bias``, ``presence_penalty``, ``frequency_penalty`` and
``logprobs``; vLLM's ``top_k``, ``min_p`` and ``repetition_penalty``; a grammar
(``serving.engine.constraints``).

A :class:`Chooser` is a stream's ``pick`` (``logits [1, vocab] -> [token]``, called by the engine
thread). Each step, on the model's logits ``l`` (float64):

1. logprobs (when asked): ``log_softmax(l)`` of the model's own logits, before anything below
   changes them (what OpenAI and llama-server report; vLLM's default ``raw_logprobs``);
2. ``l[t] += logit_bias[t]`` (OpenAI);
3. penalties, vLLM's formulas: ``repetition_penalty`` r on every token seen in the prompt or the
   output (``l / r`` where ``l > 0``, ``l * r`` elsewhere; CTRL's), then
   ``l[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)`` over the output's
   counts (OpenAI's formula);
4. the grammar's mask: forbidden tokens at -inf;
5. greedy (``temperature`` 0: the first ``argmax``), or ``min_p`` (vLLM: a token whose probability
   after the temperature is below ``min_p`` times the top one's is dropped, i.e.
   ``l < max(l) + temperature * ln(min_p)``), then ``decoder.loop.token_picker``'s seeded
   temperature / top-k / top-p sampling, the one ``generate`` uses: with none of 2-4 asked for, a
   stream picks exactly what ``generate --seed`` picks.

The records (token, its logprob, the ``top_logprobs`` most likely tokens and theirs) are appended
before the token is handed out, so a front reading token ``i`` finds record ``i``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from rmsnorm_deploy.decoder.loop import Sampling, greedy, token_picker
from rmsnorm_deploy.errors import InputError
from rmsnorm_deploy.serving.engine.constraints import GrammarStopped


@dataclasses.dataclass(frozen=True)
class SamplingFields:
    """A request's sampling fields (checked by the front; ``temperature`` 0 is greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1): the whole vocabulary
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclasses.dataclass(frozen=True)
class Record:
    """One picked token's logprob and the most likely tokens' (``top``: ``(token, logprob)``, most
    likely first, ties by id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Chooser:
    """A stream's picker over :class:`SamplingFields` (see the module docstring); ``prompt``: the
    prompt's ids (for ``repetition_penalty``); ``constraint``: a ``constraints.Constraint``."""

    def __init__(self, fields: SamplingFields, *, prompt: Sequence[int] = (), constraint: Any = None):
        self.fields, self.prompt, self.constraint = fields, list(prompt), constraint
        self.records: list[Record] = []
        self.output: list[int] = []
        self._counts: np.ndarray | None = None
        self._seen: np.ndarray | None = None  # tokens of the prompt or the output (repetition_penalty)
        self._sample = None
        if fields.temperature > 0:
            self._sample = token_picker(self._sampling())

    def _sampling(self) -> Sampling:
        f = self.fields
        if f.temperature <= 0:
            return Sampling()
        return Sampling(do_sample=True, seed=f.seed, temperature=f.temperature, top_k=max(0, f.top_k), top_p=f.top_p)

    def plain_sampling(self) -> Sampling | None:
        """``generate``'s ``Sampling`` when this picker is no more than it, so speculation's
        acceptance rule (``serve --speculative``) keeps the stream's distribution; ``None`` when
        ``logit_bias``, penalties, ``min_p``, a grammar or logprobs change or record each pick (the
        stream then decodes without speculation)."""
        f = self.fields
        if f.logit_bias or f.penalized or f.min_p > 0 or f.logprobs or self.constraint is not None:
            return None
        return self._sampling()

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        scores = np.array(logits[0], dtype=np.float64)  # our own copy: the engine reuses its buffer
        if not np.isfinite(scores).any():
            raise InputError("the model's logits are not finite (NaN or infinite); no token can be picked")
        log_probs = log_softmax(scores) if self.fields.logprobs else None
        self._adjust(scores)
        token = self._pick(scores)
        if log_probs is not None:
            self.records.append(Record(token, float(log_probs[token]), top_tokens(log_probs, self.fields.top_logprobs)))
        if self.constraint is not None:
            self.constraint.advance(token)
        self._count(token, scores.shape[0])
        return np.array([token], dtype=np.int64)

    def _adjust(self, scores: np.ndarray) -> None:
        f = self.fields
        for token, bias in f.logit_bias.items():
            if 0 <= token < scores.shape[0]:
                scores[token] += bias
        if f.repetition_penalty != 1.0:
            seen = self._seen_mask(scores.shape[0])
            scores[seen] = np.where(scores[seen] > 0, scores[seen] / f.repetition_penalty,
                                    scores[seen] * f.repetition_penalty)
        if self._counts is not None and (f.presence_penalty or f.frequency_penalty):
            scores -= f.frequency_penalty * self._counts + f.presence_penalty * (self._counts > 0)
        if self.constraint is not None:
            self.constraint.mask(scores)
            if not np.isfinite(scores).any():
                raise GrammarStopped("the grammar allows no token here that the model's logits do not rule out")

    def _pick(self, scores: np.ndarray) -> int:
        if self._sample is None:
            return int(greedy(scores))
        f = self.fields
        if f.min_p > 0:
            top = scores.max()
            scores[scores < top + f.temperature * math.log(f.min_p)] = -np.inf
        return int(self._sample(scores[None, :])[0])

    def _seen_mask(self, vocab: int) -> np.ndarray:
        if self._seen is None:
            self._seen = np.zeros(vocab, dtype=bool)
            ids = np.asarray([t for t in self.prompt + self.output if 0 <= t < vocab], dtype=np.int64)
            self._seen[ids] = True
        return self._seen

    def _count(self, token: int, vocab: int) -> None:
        self.output.append(token)
        if self.fields.penalized:
            if self._counts is None:
                self._counts = np.zeros(vocab, np.float64)
            if 0 <= token < vocab:
                self._counts[token] += 1
                if self._seen is not None:
                    self._seen[token] = True


def log_softmax(scores: np.ndarray) -> np.ndarray:
    """``scores - logsumexp(scores)`` in float64 (-inf stays -inf)."""
    top = scores.max()
    return scores - (top + np.log(np.exp(scores - top).sum()))


def top_tokens(log_probs: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely tokens and their logprobs, most likely first, ties by id."""
    if k <= 0:
        return ()
    k = min(k, log_probs.shape[0])
    part = np.argpartition(-log_probs, k - 1)[:k]
    order = sorted(part.tolist(), key=lambda t: (-log_probs[t], t))
    return tuple((int(t), float(log_probs[t])) for t in order)
