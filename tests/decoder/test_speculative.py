"""Speculative decoding (``decoder.speculative``) over a scripted numpy model: greedy tokens equal
to decoding without speculation (one row and a left-padded batch, end of sequence, both
proposers), the rejection rule's distribution (and that a wrong rule fails the same check), the
adaptive k, prompt lookup. No ONNX model: each test runs in well under a second."""

from __future__ import annotations

import numpy as np
import pytest

from rmsnorm_deploy.decoder import speculative
from rmsnorm_deploy.decoder.convention import left_padded
from rmsnorm_deploy.decoder.loop import Sampling, decode_loop, token_picker
from rmsnorm_deploy.decoder.speculative import (AdaptiveK, DraftModel, PromptLookup, Speculator, verify_greedy,
                                                verify_sampled)
from rmsnorm_deploy.errors import InputError, UserError

VOCAB = 12


class TableStep:
    """A fake model whose logits follow the row's last two tokens through a seeded table (mostly
    the last one: greedy text falls into loops that prompt lookup can guess, the token before
    breaks some); the cache is each row's token history, so a wrong rollback changes what follows."""

    def __init__(self, seed: int = 0, scale: float = 3.0, noise_of: "TableStep | None" = None, noise: float = 0.0):
        rng = np.random.default_rng(seed)
        self.table = (rng.normal(size=(1, VOCAB, VOCAB)) + 0.4 * rng.normal(size=(VOCAB, VOCAB, VOCAB))) * scale
        if noise_of is not None:  # a draft that mostly agrees with ``noise_of``
            self.table = noise_of.table + noise * rng.normal(size=self.table.shape)
        self.runs = 0

    def empty_cache(self, batch):
        return [[] for _ in range(batch)]

    def run_all(self, input_ids, attention_mask, position_ids, cache):
        assert attention_mask.shape[1] == len(cache[0]) + input_ids.shape[1]
        assert position_ids.shape == input_ids.shape
        self.runs += 1
        cache = [row + list(ids) for row, ids in zip(cache, input_ids.tolist())]
        logits = np.empty(input_ids.shape + (VOCAB,), np.float32)
        for r, row in enumerate(cache):
            for j in range(input_ids.shape[1]):
                at = len(row) - input_ids.shape[1] + j
                logits[r, j] = self.table[row[at - 1] if at else 0, row[at]]
        return logits, cache

    def run(self, input_ids, attention_mask, position_ids, cache):
        logits, cache = self.run_all(input_ids, attention_mask, position_ids, cache)
        return logits[:, -1], cache

    def rollback(self, cache, length):
        return [row[:length] for row in cache]


PROMPTS = [[[4, 5, 6, 7, 4, 5, 6, 7, 4, 5]], [[3, 1, 3, 1, 3, 1], [9, 8], [5, 6, 7, 5, 6, 7, 5]]]


def _proposers(target: TableStep):
    return [PromptLookup(min_ngram=1), DraftModel(TableStep(seed=1, noise_of=target, noise=0.6))]


@pytest.mark.parametrize("rows", PROMPTS, ids=["one-row", "left-padded-batch"])
@pytest.mark.parametrize("eos", [(), (11,)], ids=["no-eos", "eos"])
@pytest.mark.parametrize("proposer", [0, 1], ids=["ngram", "draft"])
def test_greedy_tokens_equal_decoding_without_speculation(rows, eos, proposer):
    target = TableStep(scale=3.0)
    ids, mask = left_padded(rows, pad_token_id=0)
    want = decode_loop(target, ids, mask, max_new_tokens=30, eos_token_ids=eos)
    plain_runs = target.runs
    spec = Speculator(_proposers(target)[proposer], k=4)
    target.runs = 0
    got = decode_loop(target, ids, mask, max_new_tokens=30, eos_token_ids=eos, speculation=spec, keep_logits=True)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    stats = spec.stats
    assert stats.passes == target.runs - 1 and stats.tokens == got.steps == want.steps
    if not eos:  # (a row that ends early leaves little to speculate on)
        assert 0 < stats.accepted < stats.proposed, stats  # proposals kept and proposals rolled back
        assert target.runs < plain_runs
    picked = np.argmax(np.stack(got.step_logits, axis=1), axis=-1)  # each token's logits are the ones it came from
    live = got.tokens != 0
    np.testing.assert_array_equal(picked[live], got.tokens[live])


def _fourth_token_counts(make_proposer, runs: int = 600) -> np.ndarray:
    target = TableStep(seed=3, scale=1.0)
    counts = np.zeros(VOCAB)
    for seed in range(runs):
        sampling = Sampling(do_sample=True, seed=seed)
        spec = Speculator(make_proposer(target), k=3, sampling=sampling)
        run = decode_loop(target, np.array([[1, 2]]), max_new_tokens=4, pick=token_picker(sampling),
                          speculation=spec)
        counts[run.tokens[0, 3]] += 1
    return counts


def _exact_fourth_token(target: TableStep) -> np.ndarray:
    """The 4th new token's distribution after [1, 2], summed over every path (VOCAB^3 of them)."""
    def probs(a, b):
        z = np.exp(target.table[a, b] - target.table[a, b].max())
        return z / z.sum()
    dist = {(1, 2): 1.0}
    for _ in range(3):
        nxt: dict = {}
        for (a, b), w in dist.items():
            for c, pc in enumerate(probs(a, b)):
                nxt[(b, c)] = nxt.get((b, c), 0.0) + w * pc
        dist = nxt
    out = np.zeros(VOCAB)
    for (a, b), w in dist.items():
        out += w * probs(a, b)
    return out


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


#: chi-square with 11 degrees of freedom: 31.3 is its 0.1 % tail.
CHI2_LIMIT = 31.3


def _draft(target):
    return DraftModel(TableStep(seed=4, noise_of=target, noise=1.5))


@pytest.mark.parametrize("make_proposer", [lambda t: PromptLookup(min_ngram=1), _draft], ids=["ngram", "draft"])
def test_sampled_tokens_follow_the_models_distribution(make_proposer):
    exact = _exact_fourth_token(TableStep(seed=3, scale=1.0))
    assert _chi2(_fourth_token_counts(make_proposer), exact) < CHI2_LIMIT


def test_a_rule_that_keeps_every_proposal_fails_the_same_check(monkeypatch):
    """The check has the power to see a wrong rule: proposals kept whatever p says."""
    def keep_all(proposal, q, p, rng):
        accepted, tokens = verify_sampled(proposal, q, p, rng)
        tokens[:, :-1] = proposal
        return np.full(len(proposal), proposal.shape[1]), tokens
    monkeypatch.setattr(speculative, "verify_sampled", keep_all)
    exact = _exact_fourth_token(TableStep(seed=3, scale=1.0))
    assert _chi2(_fourth_token_counts(_draft), exact) > 3 * CHI2_LIMIT


@pytest.mark.parametrize("fixed", [True, False], ids=["point-mass", "draft-q"])
def test_the_rejection_rule_alone_gives_p(fixed):
    rng = np.random.default_rng(0)
    rows = 20000
    p = rng.dirichlet(np.ones(VOCAB), size=2)
    q = rng.dirichlet(np.ones(VOCAB) * 0.3)
    proposal = np.full((rows, 1), 5) if fixed else rng.choice(VOCAB, size=(rows, 1), p=q)
    accepted, tokens = verify_sampled(proposal, None if fixed else np.tile(q, (rows, 1, 1)),
                                      np.tile(p, (rows, 1, 1)), np.random.default_rng(1))
    first = np.bincount(tokens[:, 0], minlength=VOCAB)
    assert _chi2(first, p[0]) < CHI2_LIMIT
    after = np.bincount(tokens[accepted == 1, 1], minlength=VOCAB)  # the token after a kept proposal: from p
    assert _chi2(after, p[1]) < CHI2_LIMIT
    assert 0.0 < accepted.mean() < 1.0


def test_verify_greedy_keeps_the_matching_prefix_and_the_models_next_token():
    logits = np.zeros((2, 4, VOCAB))
    for r, picks in enumerate([[3, 4, 5, 6], [3, 9, 5, 6]]):
        logits[r, np.arange(4), picks] = 1.0
    accepted, tokens = verify_greedy(np.array([[3, 4, 5], [3, 4, 5]]), logits)
    assert accepted.tolist() == [3, 1] and tokens[1, :2].tolist() == [3, 9]


def test_adaptive_k_follows_the_acceptance_rate_and_pauses_when_nothing_pays():
    adapt = AdaptiveK(6)
    start = adapt.next_k()
    for _ in range(5):
        adapt.update(6, 6)
    assert adapt.next_k() == 6 > start  # everything kept: the longest runs pay
    for _ in range(30):
        adapt.update(3, 0)
    assert adapt.best_k() == 0
    assert [adapt.next_k() for _ in range(6)] == [1, 0, 1, 0, 0, 0]  # probe, pause 1, probe, pause 3
    adapt.update(1, 1)
    adapt.update(1, 1)
    assert adapt.next_k() >= 1 and adapt.misses == 0


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup()
    seq = np.array([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 2, 3])
    assert lookup.lookup(seq, 3).tolist() == [4, 5, 6]  # "2 3": latest earlier match at 6
    assert lookup.lookup(np.array([1, 2, 3, 4]), 3).size == 0


def test_bad_k_and_a_step_without_rollback_are_refused():
    with pytest.raises(UserError, match="--speculative-k must be an integer >= 1"):
        Speculator(PromptLookup(), 0)

    class NoRollback:
        def empty_cache(self, batch):
            return 0

    with pytest.raises(InputError, match="cannot check proposed tokens"):
        decode_loop(NoRollback(), np.array([[1, 2]]), max_new_tokens=3, speculation=Speculator(PromptLookup(), 2))
