"""How far a model's next-token distributions are from a reference's over a text: KL divergence,
top-1 agreement and both perplexities, as llama.cpp's ``llama-perplexity --kl-divergence`` reports them.

The positions are perplexity's (``decoder.perplexity``: chunks of ``context`` tokens from an empty
cache, the second half scored; with a ``stride``, sliding windows, each scoring its last ``stride``
tokens); both models read the same token ids. At each scored position, with
``P`` the reference's distribution and ``Q`` the model's (log-softmax of the logits in float64):

* ``KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))`` in nats; reported as its mean over the
  positions (and that mean's standard error, llama.cpp's ``Mean KLD`` ``±``), its median, its
  99th percentile (linear between the two nearest sorted values, as
  llama.cpp's ``percentile``, numpy's default) and its maximum;
* top-1 agreement: the share of positions where the two argmax tokens are the same (llama.cpp's
  "Same top p");
* each model's perplexity over the same positions (llama.cpp's "Mean PPL(Q)" and "Mean PPL(base)");
* ``ln(PPL(model) / PPL(reference))``, the mean over the positions of the two negative
  log-likelihoods' difference, and its standard error, from that difference's spread over the
  positions (llama.cpp's "Mean ln(PPL(Q)/PPL(base))" and its ``±``: the same value, since its
  covariance form is this paired difference's variance). Two models scored against one
  reference on one text differ in perplexity by more than noise only when their log ratios are
  several of these apart.

llama.cpp stores the reference's log-probabilities in 16 bits and leaves out reference
probabilities below ``e^-16``; here both are full float64, so ``KL`` of a model against itself is 0
exactly and a few units in the last place may separate the two tools' numbers.

The reference is any source of logits (``perplexity.LogitsOf``): another export folder in its ONNX
Runtime session (``rmsnorm-deploy perplexity --kl-divergence REF_DIR``) or the transformers model an
export came from (:func:`torch_logits`: what ``export --quantize`` measures its cost against, in
:func:`quantization_text_cost`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rmsnorm_deploy.decoder.generate import KVCacheModel
from rmsnorm_deploy.decoder.perplexity import (
    DEFAULT_CONTEXT,
    SHIPPED_TEXT,
    SHIPPED_TEXT_NAME,
    LogitsOf,
    OnChunk,
    check_windows,
    chunked,
    log_softmax64,
    read_text,
    scored_positions,
    session_logits,
    text_ids,
)
from rmsnorm_deploy.errors import InputError

__all__ = ["QUANTIZATION_TEXT_CHUNKS", "Divergence", "divergence", "quantization_text_cost", "text_cost_line",
           "torch_logits"]

#: Chunks of the shipped text ``export --quantize`` measures its cost on (the first ones): enough
#: positions for a mean, few enough to keep the export's time bounded on a large model.
QUANTIZATION_TEXT_CHUNKS = 4
#: Rows of one chunk whose float64 log-probabilities are held at once (memory bound at a large vocabulary).
_ROWS = 32


@dataclasses.dataclass
class Divergence:
    perplexity: float  # the model's, over the scored positions
    reference_perplexity: float  # the reference's, over the same positions
    kl_mean: float  # nats per scored position, KL(reference || model)
    kl_stderr: float  # the standard error of that mean over the positions (0 for fewer than 2)
    kl_median: float
    kl_p99: float
    kl_max: float
    same_top: float  # share of positions where both argmax tokens are the same
    scored_tokens: int
    chunks: int
    context: int
    text_tokens: int
    bos_token_id: int | None
    seconds: float
    stride: int | None = None  # sliding windows (``perplexity.sliding``); None: llama-perplexity's chunks
    log_ratio: float = 0.0  # ln(perplexity / reference_perplexity): the mean per-position NLL difference
    log_ratio_stderr: float = 0.0  # its standard error over the positions (0 for fewer than 2)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 3)}

    def summary(self) -> str:
        return (f"perplexity {self.perplexity:.4f} (reference {self.reference_perplexity:.4f}, ratio "
                f"{self.perplexity / self.reference_perplexity:.4f}, ln ratio {self.log_ratio:+.5f} ± "
                f"{self.log_ratio_stderr:.5f}); KL divergence mean {self.kl_mean:.6f} ± {self.kl_stderr:.6f}, "
                f"median {self.kl_median:.6f}, p99 {self.kl_p99:.6f}, max {self.kl_max:.6f}; same top token "
                f"{self.same_top:.2%} of {self.scored_tokens} positions")


@dataclasses.dataclass
class _Chunk:
    nll: float  # the model's summed negative log-likelihood over the scored positions
    reference_nll: float
    nll_difference: np.ndarray  # the model's minus the reference's negative log-likelihood, per scored position
    kl: np.ndarray  # KL(reference || model) per scored position
    same_top: np.ndarray  # whether the two argmax tokens agree, per scored position


def _chunk(logits: np.ndarray, reference: np.ndarray, window: np.ndarray, stride: int | None = None) -> _Chunk:
    """One window's scored positions, :data:`_ROWS` at a time, each model's log-softmax computed once.
    The negative log-likelihoods are ``perplexity.scored_nll``'s: the same values summed in one array."""
    if logits.shape != reference.shape:
        raise InputError(f"the model's logits are {list(logits.shape)} and the reference's {list(reference.shape)}; "
                         "compare two models with the same vocabulary")
    rows = scored_positions(len(window), stride)
    targets = np.asarray(window[rows.start + 1:], dtype=np.int64)
    picked: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    kl, same = [], []
    for row in range(rows.start, rows.stop, _ROWS):
        end = min(row + _ROWS, rows.stop)
        log_q, log_p = log_softmax64(logits[row:end]), log_softmax64(reference[row:end])
        wanted = targets[row - rows.start: end - rows.start]
        picked[0].append(log_q[np.arange(len(wanted)), wanted])
        picked[1].append(log_p[np.arange(len(wanted)), wanted])
        kl.append((np.exp(log_p) * (log_p - log_q)).sum(axis=-1))
        same.append(np.argmax(log_q, axis=-1) == np.argmax(log_p, axis=-1))
    model_ll, reference_ll = np.concatenate(picked[0]), np.concatenate(picked[1])
    return _Chunk(float(-model_ll.sum()), float(-reference_ll.sum()), reference_ll - model_ll,
                  np.concatenate(kl), np.concatenate(same))


def divergence(logits_of: LogitsOf, reference_of: LogitsOf, windows: np.ndarray, *, text_tokens: int,
               bos_token_id: int | None = None, on_chunk: OnChunk | None = None,
               stride: int | None = None) -> Divergence:
    """The model's distributions (``logits_of``) against the reference's (``reference_of``) over
    ``windows`` (``perplexity.chunked``, or ``perplexity.sliding`` with the same ``stride``), at
    perplexity's scored positions (module docstring)."""
    start = time.perf_counter()
    chunks = []
    for done, window in enumerate(windows, 1):
        chunks.append(_chunk(logits_of(window), reference_of(window), window, stride))
        if on_chunk is not None:
            on_chunk(done, len(windows))
    total = total_ref = 0.0
    for chunk in chunks:  # summed chunk by chunk, in order, as ``perplexity.perplexity`` sums
        total += chunk.nll
        total_ref += chunk.reference_nll
    kl = np.concatenate([c.kl for c in chunks])
    count = len(kl)
    difference = np.concatenate([c.nll_difference for c in chunks])
    stderr = float(difference.std(ddof=1) / math.sqrt(count)) if count > 1 else 0.0
    kl_stderr = float(kl.std(ddof=1) / math.sqrt(count)) if count > 1 else 0.0
    return Divergence(perplexity=math.exp(total / count), reference_perplexity=math.exp(total_ref / count),
                      kl_mean=float(kl.mean()), kl_stderr=kl_stderr, kl_median=float(np.median(kl)),
                      kl_p99=float(np.percentile(kl, 99)),
                      kl_max=float(kl.max()), same_top=float(np.concatenate([c.same_top for c in chunks]).mean()),
                      scored_tokens=count, chunks=len(windows), context=len(windows[0]), text_tokens=text_tokens,
                      bos_token_id=bos_token_id, seconds=time.perf_counter() - start, stride=stride,
                      log_ratio=(total - total_ref) / count, log_ratio_stderr=stderr)


def torch_logits(lm: Any) -> LogitsOf:
    """The logits of one window from a transformers causal LM (no cache, every position), in its dtype."""

    def logits_of(window: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out = lm(input_ids=torch.from_numpy(np.ascontiguousarray(window))[None, :], use_cache=False)
        return out.logits[0].float().numpy()

    return logits_of


def quantization_text_cost(lm: Any, folder: str | Path, *, chunks: int = QUANTIZATION_TEXT_CHUNKS,
                           context: int = DEFAULT_CONTEXT) -> dict[str, Any]:
    """What quantization cost on text: the quantized export in ``folder`` against ``lm``, the
    unquantized transformers model it came from, over the first ``chunks`` chunks of the shipped
    text tokenized with the folder's tokenizer. ``{"measured": False, "why": ...}`` when it cannot
    be measured (no tokenizer, a text too short for the context, a context past the model)."""
    text = {"text": SHIPPED_TEXT_NAME, "chunks_of_text": f"the first {chunks} chunks of {context} tokens"}
    reference = f"transformers: the unquantized model, {next(lm.parameters()).dtype}".replace("torch.", "")
    with KVCacheModel(folder) as model:
        try:
            ids, bos = text_ids(model, read_text(SHIPPED_TEXT))
            logits_of = session_logits(model, context)
            windows = chunked(ids, context, bos)[:chunks]
            check_windows(windows, model.layout.vocab_size)
        except InputError as exc:
            return {"measured": False, "why": str(exc), "reference": reference, **text}
        result = divergence(logits_of, torch_logits(lm), windows, text_tokens=len(ids), bos_token_id=bos)
    return {"measured": True, "reference": reference, **text, **result.to_dict()}


def text_cost_line(cost: dict[str, Any]) -> str:
    """One line of :func:`quantization_text_cost`'s result, for the export's output."""
    if not cost.get("measured"):
        return f"not measured: {cost.get('why')}"
    return (f"perplexity {cost['perplexity']:.4f} vs {cost['reference_perplexity']:.4f} unquantized (ln ratio "
            f"{cost['log_ratio']:+.4f} ± {cost['log_ratio_stderr']:.4f}); KL divergence "
            f"mean {cost['kl_mean']:.4g}, p99 {cost['kl_p99']:.4g}; same top token {cost['same_top']:.1%} "
            f"({cost['scored_tokens']} positions: {cost['chunks_of_text']})")
