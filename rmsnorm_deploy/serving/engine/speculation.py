"""Speculative decoding in the generation engine (``serve --speculative ngram|DRAFT_DIR``).

The proposers, the acceptance rule and the adaptive k are ``decoder.speculative``'s, the ones
``generate --speculative`` runs; this module only decides which streams speculate and when:

- A stream speculates when its picker is no more than ``generate``'s ``Sampling`` (greedy, or
  temperature / top-k / top-p): a KServe request, or an OpenAI request without ``logit_bias``,
  penalties, ``min_p``, a grammar or logprobs (``Chooser.plain_sampling``). Greedy streams keep
  exactly the tokens they get without speculation; sampled ones are checked with the rejection rule
  against the stream's own ``Sampling``, so each token follows the model's distribution. Any other
  stream decodes without speculation (``streams_without_speculation`` in the stats): its picker
  changes or records every pick, which the rule cannot reproduce from the model's probabilities.
- ``TurnBatch`` (batch-1 turns): each speculating stream runs ``generate``'s ``Speculator`` in its
  own decode loop, and a turn hands out every token its run made.
- ``SlotBatch`` (continuous batching): ONNX Runtime's GroupQueryAttention takes several new tokens
  after a past only for a batch of one, so a proposal cannot ride in the batched run. A stream is
  checked in a one-slot run of its own instead (as a prefill chunk runs: the slot's rows of the
  shared cache, ``[last token, proposals]`` at the stream's positions); a rejected proposal's key is
  simply forgotten (the slot's length is what the mask says) and overwritten later. A one-slot run
  costs about what the batched run of every stream costs (decode is memory-bound), so streams
  speculate only while at most :data:`SPECULATE_UP_TO` streams decode; beyond that every stream
  rides in the batched run, as without speculation (benchmarks/results/speculative.md).

:class:`EngineSpeculation` holds the per-stream state and the engine's totals
(``decoder.speculative.SpeculationStats``: proposed and accepted tokens, runs of the model after
the prefill per stream, tokens per run), read by ``Engine.speculation_stats`` and ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterator

import numpy as np

from rmsnorm_deploy.decoder.loop import Sampling, sampling_probabilities
from rmsnorm_deploy.decoder.speculative import (AdaptiveK, Context, SpeculationStats, Speculator, verify_greedy,
                                                verify_sampled)

__all__ = ["EngineSpeculation", "SPECULATE_UP_TO", "plain_sampling"]

#: Streams decoding at most for ``SlotBatch``'s streams to speculate (each in a one-slot run); with
#: more, the batched run makes one token for each at about the cost of one one-slot run.
SPECULATE_UP_TO = 1
#: What a one-slot check run costs beyond ``decoder.speculative``'s per-token share, against the
#: stream's one-token step in the batched run (measured on SmolLM2-135M float32, 2 threads: 1.2-1.3x
#: that step for 2 to 6 tokens; the batched step's inputs and logits are bound once, the check's not).
CHECK_RUN_COST = 0.2


def plain_sampling(sampling: Sampling | None, pick: Callable | None) -> Sampling | None:
    """The ``Sampling`` a stream speculates with, or ``None`` when it must not: ``pick`` (a
    stream's own picker) is a ``Chooser`` that is more than ``Sampling``, or an unknown picker."""
    if pick is None:
        return sampling or Sampling()
    plain = getattr(pick, "plain_sampling", None)
    return plain() if plain is not None else None


@dataclasses.dataclass
class _Stream:
    """One speculating stream in ``SlotBatch``: its proposer, k, generator and text so far."""

    proposer: Any  # None until the stream first proposes
    adapt: AdaptiveK
    rng: np.random.Generator
    sampling: Sampling
    ctx: Context
    prompt: int


class EngineSpeculation:
    """The engine's speculation (see the module docstring): ``options`` is a
    ``decoder.generate.SpeculationOptions`` already checked against the model."""

    def __init__(self, options: Any):
        self.options = options
        #: the finished streams' and ``SlotBatch``'s counts (live ``TurnBatch`` loops: :meth:`totals`)
        self.stats = SpeculationStats(options.name, options.k)
        self.streams_without = 0  # streams whose picker forbade speculation
        self._slots: dict[Any, _Stream | None] = {}
        self._turns: dict[Any, Speculator] = {}
        self._lock = threading.Lock()  # the engine thread changes _turns while a scrape reads it

    # -- the engine's side ----------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        stats = SpeculationStats(self.stats.proposer, self.stats.max_k)
        with self._lock:
            stats.add(self.stats)
            for speculator in self._turns.values():
                stats.add(speculator.stats)
        return {**stats.to_dict(), "streams_without_speculation": self.streams_without}

    def reset(self) -> None:
        """Forget the counts (the engine's warm-up is not a request)."""
        self.stats = SpeculationStats(self.stats.proposer, self.stats.max_k)
        self.streams_without = 0

    def release(self, stream: Any) -> None:
        self._slots.pop(stream, None)
        with self._lock:
            speculator = self._turns.pop(stream, None)
            if speculator is not None:
                self.stats.add(speculator.stats)

    # -- TurnBatch --------------------------------------------------------------------------------
    def speculator(self, stream: Any) -> Speculator | None:
        """The ``Speculator`` of ``stream``'s own decode loop, or ``None`` (its picker forbids it)."""
        if stream.sampling is None:
            self.streams_without += 1
            return None
        speculator = Speculator(self.options.proposer_for(), self.options.k, stream.sampling)
        with self._lock:
            self._turns[stream] = speculator
        return speculator

    def pending(self, stream: Any) -> int:
        """Tokens ``stream``'s last run made that its loop has not handed out yet."""
        speculator = self._turns.get(stream)
        return speculator.pending if speculator is not None else 0

    # -- SlotBatch ----------------------------------------------------------------------------------
    def verify(self, batch: Any, decoding: dict[int, tuple[Any, Any]]
               ) -> Iterator[tuple[list[Any], int | None, str | None]]:
        """Check the proposals of the streams in ``decoding`` (``slot -> (stream, row)``, a
        ``SlotBatch``'s) that speculate now, each in a one-slot run, yielding their tokens as
        ``SlotBatch.iteration`` does; returns the streams left for the batched run."""
        rest = {}
        for slot, (stream, row) in sorted(decoding.items()):
            state, proposal, q = self._state(stream), np.zeros(0, np.int64), None
            if state is not None:
                self.stats.passes += 1
                if len(decoding) <= SPECULATE_UP_TO:
                    proposal, q = self._propose(state, stream)
            if not proposal.size:  # the batched run makes its one token
                self.stats.tokens += state is not None
                rest[slot] = (stream, row)
                continue
            yield from self._check(batch, stream, row, state, proposal, q)
        return rest

    def _state(self, stream: Any) -> _Stream | None:
        """``stream``'s state, made on its first decode step (``None``: its picker forbids speculation)."""
        if stream in self._slots:
            return self._slots[stream]
        state = None
        if stream.sampling is not None:
            capacity = len(stream.prompt) + stream.max_new_tokens
            tokens = np.zeros((1, capacity), np.int64)
            tokens[0, :len(stream.prompt)] = stream.prompt
            ones = np.ones((1, capacity), np.int64)
            ctx = Context(tokens, ones, np.arange(capacity, dtype=np.int64)[None], np.zeros(1, np.int64),
                          np.ones(1, bool))
            state = self._slots[stream] = _Stream(None, AdaptiveK(self.options.k, CHECK_RUN_COST),
                                                  np.random.default_rng(stream.sampling.seed + 2), stream.sampling, ctx,
                                                  len(stream.prompt))
        else:
            self.streams_without += 1
            self._slots[stream] = None  # counted once
        return state

    def _propose(self, state: _Stream, stream: Any) -> tuple[np.ndarray, np.ndarray | None]:
        made = len(stream.tokens)
        k = min(state.adapt.next_k(), stream.max_new_tokens - made - 1)
        if k <= 0:
            return np.zeros(0, np.int64), None
        if state.proposer is None:  # made when first asked: a draft's cache is allocated per stream
            state.proposer = self.options.proposer_for()
            state.proposer.start(1, stream.sampling)
        ctx = state.ctx
        ctx.tokens[0, state.prompt:state.prompt + made] = stream.tokens
        ctx.length = state.prompt + made
        proposal, q = state.proposer.propose(ctx, k)
        return proposal[0], q

    def _check(self, batch: Any, stream: Any, row: Any, state: _Stream, proposal: np.ndarray,
               q: np.ndarray | None) -> Iterator[tuple[list[Any], int | None, str | None]]:
        kept = proposal.shape[0]
        try:
            logits = batch.run_row(row, [row.last, *proposal.tolist()], every=True)[:, :kept + 1]
        except RuntimeError as exc:
            row.failed = True
            yield [stream], None, str(exc)
            return
        if state.sampling.do_sample:
            accepted, out = verify_sampled(proposal[None], q, sampling_probabilities(logits, state.sampling),
                                           state.rng)
        else:
            accepted, out = verify_greedy(proposal[None], logits)
        m = int(accepted[0])
        state.proposer.keep(state.ctx.length + m)
        state.adapt.update(kept, m)
        self.stats.verifications += 1
        self.stats.proposed += kept
        self.stats.accepted += m
        self.stats.tokens += m + 1
        row.fed.extend([row.last, *proposal[:m].tolist()])
        row.filled += m + 1
        row.last = int(out[0, m])
        for token in out[0, :m + 1].tolist():
            yield [stream], int(token), None
            if stream.done or stream.cancel_requested:
                return
