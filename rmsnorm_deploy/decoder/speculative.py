"""Speculative decoding in the one decode loop: propose tokens, check them in one run of the model.

Decode is memory-bound: one run over ``k + 1`` new tokens costs about what one run over one
token costs, so checking ``k`` proposed tokens at once can make several tokens per run.
:class:`Speculator` is what ``decoder.loop.decode_steps(..., speculation=)`` runs instead of one
run per token:

1. a proposer proposes up to ``k`` tokens after the text so far: :class:`PromptLookup` (an n-gram
   of the last tokens found earlier in the prompt or the output, its continuation proposed; no
   second model) or :class:`DraftModel` (a smaller KV-cache model of the same vocabulary);
2. the model runs once over the last token and the proposals (``run_all``: every position's logits);
3. greedy: the proposals equal to the model's own argmax are kept, then the model's token after
   them, so the tokens are the ones decoding without speculation picks. Sampling: the standard
   rejection rule (proposal ``d`` kept with probability ``min(1, p(d) / q(d))``; at the first
   rejection a token from ``norm(max(0, p - q))``; all kept: one more from ``p``), so each token
   follows the model's own distribution ``p`` (``q``: the proposer's; a point mass for lookup);
4. the cache drops the rejected slots (``rollback``: a shared buffer just gets a shorter mask);
5. :class:`AdaptiveK` picks k from the running acceptance rate and what a longer run costs, and
   proposes nothing for a while (doubling) when no k pays, so text the proposer cannot guess
   runs at nearly the speed of plain decoding.

Rows of a batch advance together: a run keeps the fewest tokens any unfinished row accepted (each
row's next token is still the model's own: its accepted proposal or its correction).
:class:`SpeculationStats` counts proposals, acceptance and tokens per run (``generate --json``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from rmsnorm_deploy.decoder.convention import position_ids_for
from rmsnorm_deploy.decoder.loop import DecodeClock, Sampling, Step, sampling_probabilities
from rmsnorm_deploy.errors import InputError, UserError

__all__ = ["AdaptiveK", "Context", "DraftModel", "PromptLookup", "SpeculationStats", "Speculator", "check_draft",
           "verify_greedy", "verify_sampled"]

#: Why speculation refuses a batch on a GroupQueryAttention graph.
SPECULATION_ONE_ROW = ("speculation checks one prompt at a time on a --target onnxruntime graph (ONNX Runtime's "
                       "GroupQueryAttention takes several new tokens after a past only for one row); give one prompt")
#: Why speculation refuses a model that recomputes its cache (``{past}``: the length it switches at).
SPECULATION_LONGROPE = ("speculation cannot run this model: it recomputes its cache once past {past} tokens "
                        "(Phi-3's LongRoPE switch); run without --speculative")
#: Longest pause (in runs without proposals) after proposals that keep failing.
MAX_PAUSE = 16
#: The extra share of a run each more fed token costs (measured on 2 CPU threads, SmolLM2-135M:
#: 0.04-0.13 float32 and int4; decode is memory-bound).
RUN_COST = 0.08
#: How fast old runs fade from the acceptance rate, and the rate a generation starts from (0.6).
DECAY = 0.8
PRIOR_KEPT, PRIOR_TRIALS = 1.5, 2.5


@dataclasses.dataclass
class SpeculationStats:
    """What speculation did in one generation (all rows advance together: tokens count once)."""

    proposer: str
    max_k: int
    passes: int = 0  # runs of the model after the prefill
    verifications: int = 0  # of those, runs that checked proposals
    proposed: int = 0  # proposed tokens checked
    accepted: int = 0  # proposed tokens kept
    tokens: int = 0  # tokens made after the prefill's

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0

    def add(self, other: SpeculationStats) -> None:
        """Count ``other``'s runs and tokens in these (the serving engine's totals over its streams)."""
        for name in ("passes", "verifications", "proposed", "accepted", "tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, Any]:
        return {"proposer": self.proposer, "max_k": self.max_k, "target_passes": self.passes,
                "verifications": self.verifications, "proposed": self.proposed, "accepted": self.accepted,
                "tokens": self.tokens, "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_pass": round(self.tokens_per_pass, 3)}


class AdaptiveK:
    """How many tokens to propose, from the running rate ``a`` at which proposed tokens are kept
    (accepted tokens over accepted tokens plus rejections, old runs decaying by ``DECAY``): the k
    with the most expected tokens per unit of run time, ``sum(a^i, i <= k) / (1 + RUN_COST * k)``
    (a run over ``k + 1`` tokens costs about ``1 + RUN_COST * k`` runs over one). When no k >= 1
    beats one token per run, proposals pause for 1, 3, 7, ... runs (at most :data:`MAX_PAUSE`),
    then one probe with k = 1 updates ``a``. ``fixed_cost``: what any run over several tokens costs
    beyond that, as a share of a one-token run (the serving engine's one-slot check against its
    pre-bound decode step)."""

    def __init__(self, max_k: int, fixed_cost: float = 0.0):
        self.max_k, self.pause, self.misses, self.fixed_cost = max_k, 0, 0, fixed_cost
        self.kept, self.trials = PRIOR_KEPT, PRIOR_TRIALS

    @property
    def rate(self) -> float:
        return self.kept / self.trials

    def best_k(self) -> int:
        """0 when proposing does not pay at the current rate."""
        a, best, value = self.rate, 0, 1.0
        for k in range(1, self.max_k + 1):
            gain = sum(a ** i for i in range(k + 1)) / (1 + self.fixed_cost + RUN_COST * k)
            if gain > value:
                best, value = k, gain
        return best

    def next_k(self) -> int:
        if self.pause:
            self.pause -= 1
            return 0
        k = self.best_k()
        if k:
            self.misses = 0
            return k
        self.misses += 1
        self.pause = min(MAX_PAUSE, 2 ** self.misses - 1)
        return 1  # a probe: the rate stays current

    def update(self, proposed: int, accepted: int) -> None:
        self.kept = DECAY * self.kept + accepted
        self.trials = DECAY * self.trials + accepted + (accepted < proposed)


@dataclasses.dataclass
class Context:
    """The generation so far, as proposers read it: ``tokens`` [batch, capacity] (prompt, then the
    new tokens; columns from ``length`` on not made yet), the mask and positions of the whole run,
    each row's first real column (left padding) and the rows still running."""

    tokens: np.ndarray
    mask: np.ndarray
    positions: np.ndarray
    starts: np.ndarray
    live: np.ndarray
    length: int = 0


# -- proposers ---------------------------------------------------------------------------------
class PromptLookup:
    """Prompt lookup: the last ``n`` tokens (``max_ngram`` down to ``min_ngram``) found earlier in
    the row (prompt and output; the latest match), the tokens that followed it proposed. Down to
    one token: right after a token the answer changes (a renamed word), only the last token is
    found again (measured on real SmolLM2, 160 tokens: 2.95 -> 3.73 tokens a run on a repeated
    passage, 2.48 -> 2.88 on an edited one; open-ended text unchanged, the adaptive k pausing)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, batch: int, sampling: Sampling) -> None:
        pass

    def propose(self, ctx: Context, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        rows = []
        for r in range(ctx.tokens.shape[0]):
            if not ctx.live[r]:
                continue
            found = self.lookup(ctx.tokens[r, ctx.starts[r]:ctx.length], k)
            if not found.size:
                return np.zeros((ctx.tokens.shape[0], 0), np.int64), None
            rows.append((r, found))
        kp = min(len(found) for _, found in rows)
        proposal = np.repeat(ctx.tokens[:, ctx.length - 1:ctx.length], kp, axis=1)  # finished rows: any token
        for r, found in rows:
            proposal[r] = found[:kp]
        return proposal, None

    def lookup(self, seq: np.ndarray, k: int) -> np.ndarray:
        """Up to ``k`` tokens that followed the latest earlier occurrence of ``seq``'s last n-gram."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(seq) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                begin = int(hits[-1]) + n
                return seq[begin:begin + k]
        return seq[:0]

    def keep(self, length: int) -> None:
        pass


class DraftModel:
    """A smaller KV-cache model of the same vocabulary proposing greedily (or sampling from its own
    distribution ``q`` when the generation samples). It keeps its own cache, one slot behind the
    model's at most, and drops its rejected slots as the model does."""

    def __init__(self, step: Step, name: str = "draft"):
        if not (hasattr(step, "run_all") and hasattr(step, "rollback")):
            raise InputError("the draft model's backend cannot roll its cache back; give an ONNX Runtime draft")
        self.step, self.name = step, name

    def start(self, batch: int, sampling: Sampling) -> None:
        self.cache, self.fed, self.sampling = self.step.empty_cache(batch), 0, sampling
        self.rng = np.random.default_rng(sampling.seed + 1)

    def propose(self, ctx: Context, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        batch, length = ctx.tokens.shape[0], ctx.length
        feed = ctx.tokens[:, self.fed:length]  # what the draft has not read yet (all of the prompt at first)
        proposal = np.empty((batch, k), np.int64)
        q = [] if self.sampling.do_sample else None
        for i in range(k):
            width = length + i
            logits, self.cache = self.step.run(np.ascontiguousarray(feed), np.ascontiguousarray(ctx.mask[:, :width]),
                                               np.ascontiguousarray(ctx.positions[:, width - feed.shape[1]:width]),
                                               self.cache)
            self.fed = width
            if q is None:
                proposal[:, i] = np.argmax(logits, axis=-1)
            else:
                probs = sampling_probabilities(logits, self.sampling)
                q.append(probs)
                proposal[:, i] = [self.rng.choice(probs.shape[-1], p=p) for p in probs]
            feed = proposal[:, i:i + 1]
        return proposal, (None if q is None else np.stack(q, axis=1))

    def keep(self, length: int) -> None:
        if self.fed > length:
            self.cache, self.fed = self.step.rollback(self.cache, length), length


def check_draft(model: Any, draft: Any, longest: int) -> None:
    """Refuse (``InputError``) a draft (a ``decoder.generate.KVCacheModel``) whose vocabulary is not
    the model's, or shorter than ``longest`` tokens (prompt + new tokens)."""
    if draft.layout.vocab_size != model.layout.vocab_size:
        raise InputError(f"the draft model {draft.folder} has a vocabulary of {draft.layout.vocab_size} tokens, the "
                         f"model {model.layout.vocab_size}; give a draft with the model's tokenizer")
    if (draft.tokenizer is None) != (model.tokenizer is None) or (
            model.tokenizer is not None and draft.tokenizer.get_vocab() != model.tokenizer.get_vocab()):
        raise InputError(f"the draft model {draft.folder} has another tokenizer than the model (tokenizer.json "
                         "differs); give a draft with the model's tokenizer")
    if longest > draft.layout.max_length:
        raise InputError(f"{longest} tokens exceed the draft model's maximum of {draft.layout.max_length}; "
                         "lower --max-new-tokens or give a draft exported with a longer --max-length")


# -- the acceptance rule ---------------------------------------------------------------------------
def verify_greedy(proposal: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(accepted [batch], tokens [batch, k + 1])``: the proposals [batch, k] equal to the argmax of
    the logits [batch, k + 1, vocab] before them are accepted; ``tokens[:, :accepted + 1]`` are the
    model's own picks (the accepted proposals, then its token after them)."""
    target = np.argmax(logits, axis=-1)
    accepted = np.cumprod(proposal == target[:, :-1], axis=1).sum(axis=1)
    return accepted, target


def verify_sampled(proposal: np.ndarray, q: np.ndarray | None, p: np.ndarray,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The rejection rule: ``(accepted [batch], tokens [batch, k + 1])`` for proposals [batch, k]
    drawn from ``q`` [batch, k, vocab] (``None``: fixed proposals, a point mass) checked against
    the model's ``p`` [batch, k + 1, vocab]; ``tokens[:, :accepted + 1]`` are distributed as ``p``."""
    batch, k = proposal.shape
    vocab = p.shape[-1]
    accepted = np.full(batch, k, np.int64)
    tokens = np.zeros((batch, k + 1), np.int64)
    for r in range(batch):
        for j in range(k):
            d = int(proposal[r, j])
            qd = 1.0 if q is None else float(q[r, j, d])
            if rng.random() * qd < p[r, j, d]:  # kept with probability min(1, p(d) / q(d))
                tokens[r, j] = d
                continue
            residual = p[r, j].copy()
            if q is None:
                residual[d] = 0.0
            else:
                residual = np.maximum(residual - q[r, j], 0.0)
            total = residual.sum()
            tokens[r, j] = rng.choice(vocab, p=residual / total if total > 0 else p[r, j])
            accepted[r] = j
            break
        else:
            tokens[r, k] = rng.choice(vocab, p=p[r, k])
    return accepted, tokens


# -- the loop ------------------------------------------------------------------------------------
class Speculator:
    """Speculation for ``decode_steps(..., speculation=)``: ``proposer`` (:class:`PromptLookup` or
    :class:`DraftModel`), at most ``k`` proposed tokens a run, ``sampling`` the generation's (its
    picker is the ``pick`` the loop is given). ``stats`` describes the last generation; ``pending``
    is how many tokens of the last run are made but not yet handed out (a caller taking turns
    hands them all out at once)."""

    def __init__(self, proposer: Any, k: int, sampling: Sampling | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UserError(f"--speculative-k must be an integer >= 1, got {k!r}")
        self.proposer, self.k, self.sampling = proposer, k, sampling or Sampling()
        self.stats = SpeculationStats(proposer.name, k)
        self.pending = 0

    def steps(self, step: Step, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int,
              pick: Callable[[np.ndarray], np.ndarray], eos_token_ids: Iterable[int], pad_token_id: int,
              clock: DecodeClock) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if not (hasattr(step, "run_all") and hasattr(step, "rollback")):
            raise InputError(f"{type(step).__name__} cannot check proposed tokens (no run_all/rollback); "
                             "run without speculation")
        for each in (step, getattr(self.proposer, "step", None)):
            if getattr(each, "recompute_past", None) is not None:
                raise InputError(SPECULATION_LONGROPE.format(past=each.recompute_past))
            layout = getattr(each, "layout", None)
            if ids.shape[0] > 1 and getattr(layout, "grouped_query_attention", False):
                raise InputError(f"{SPECULATION_ONE_ROW} ({ids.shape[0]} prompts)")
        if (mask[:, -1] == 0).any():
            raise InputError("speculation needs prompts padded on the left (a row's last slot is padding)")
        return self._steps(step, ids, mask, max_new_tokens, pick, eos_token_ids, pad_token_id, clock)

    def _steps(self, step: Step, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int,
               pick: Callable[[np.ndarray], np.ndarray], eos_token_ids: Iterable[int], pad: int,
               clock: DecodeClock) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        batch, prompt = ids.shape
        capacity = prompt + max_new_tokens
        tokens = np.full((batch, capacity), pad, np.int64)
        tokens[:, :prompt] = ids
        total = np.ones((batch, capacity), np.int64)
        total[:, :prompt] = mask
        ctx = Context(tokens, total, position_ids_for(total, capacity), prompt - mask.sum(axis=1),
                      np.ones(batch, bool), prompt)
        eos = np.array(sorted({int(t) for t in eos_token_ids}), dtype=np.int64)
        self.stats = SpeculationStats(self.proposer.name, self.k)
        self.proposer.start(batch, self.sampling)
        adapt, rng = AdaptiveK(self.k), np.random.default_rng(self.sampling.seed + 2)
        cache = step.empty_cache(batch)
        started = time.perf_counter()
        logits, cache = step.run(ids, mask, np.ascontiguousarray(ctx.positions[:, :prompt]), cache)
        out, all_logits = np.array(pick(logits), dtype=np.int64)[:, None], logits[:, None]
        clock.prefill_s = time.perf_counter() - started
        made, share = 0, None  # share: each token's part of its run's time (None: the prefill's token)
        while True:
            for j in range(out.shape[1]):  # the run's tokens, end-of-sequence handled one by one
                token = out[:, j].copy()
                if eos.size:
                    token[~ctx.live] = pad
                    ctx.live &= ~np.isin(token, eos)
                tokens[:, prompt + made] = token
                made += 1
                if share is not None:
                    clock.steps += 1
                    clock.step_s.append(share)
                    self.stats.tokens += 1
                self.pending = out.shape[1] - j - 1
                yield token, all_logits[:, j]
                if made == max_new_tokens or not ctx.live.any():
                    return
            ctx.length = prompt + made
            started = time.perf_counter()
            out, all_logits, cache = self._run(step, ctx, adapt, min(adapt.next_k(), max_new_tokens - made - 1),
                                               pick, rng, cache)
            elapsed = time.perf_counter() - started
            self.stats.passes += 1
            clock.decode_s += elapsed
            share = elapsed / out.shape[1]

    def _run(self, step: Step, ctx: Context, adapt: AdaptiveK, k: int, pick: Callable[[np.ndarray], np.ndarray],
             rng: np.random.Generator, cache: Any) -> tuple[np.ndarray, np.ndarray, Any]:
        """One run of the model after ``ctx.length`` tokens: ``(tokens [batch, n], their logits
        [batch, n, vocab], cache)``, n = 1 + the proposals every running row accepted."""
        length = ctx.length
        proposal, q = self.proposer.propose(ctx, k) if k > 0 else (np.zeros((ctx.tokens.shape[0], 0), np.int64), None)
        kept = proposal.shape[1]
        if not kept:
            logits, cache = step.run(np.ascontiguousarray(ctx.tokens[:, length - 1:length]),
                                     np.ascontiguousarray(ctx.mask[:, :length]),
                                     np.ascontiguousarray(ctx.positions[:, length - 1:length]), cache)
            return np.array(pick(logits), dtype=np.int64)[:, None], logits[:, None], cache
        width = length + kept
        feed = np.concatenate([ctx.tokens[:, length - 1:length], proposal], axis=1)
        logits, cache = step.run_all(feed, np.ascontiguousarray(ctx.mask[:, :width]),
                                     np.ascontiguousarray(ctx.positions[:, length - 1:width]), cache)
        if self.sampling.do_sample:
            accepted, out = verify_sampled(proposal, q, sampling_probabilities(logits, self.sampling), rng)
        else:
            accepted, out = verify_greedy(proposal, logits)
        m = int(accepted[ctx.live].min())
        cache = step.rollback(cache, length + m)  # the last token and the m kept proposals stay
        self.proposer.keep(length + m)
        adapt.update(kept, m)
        self.stats.verifications += 1
        self.stats.proposed += kept
        self.stats.accepted += m
        return out[:, :m + 1], logits[:, :m + 1], cache
