"""Perplexity of a KV-cache export over token ids, scored the way llama.cpp's ``llama-perplexity`` scores.

Perplexity is the number llama.cpp users compare quantizations by, so ours is computed in their
scheme and nothing else, to sit beside theirs on the same weights and text:

* the token ids (the whole text tokenized once, with the BOS token in front when the tokenizer
  adds one) are cut into ``len(ids) // context`` chunks of ``context`` tokens; the tail that does
  not fill a chunk is dropped, and fewer than two chunks' worth of tokens is refused, as
  llama.cpp refuses it;
* each chunk is run alone from an empty cache (one prefill, every position's logits); when the
  model adds a BOS token, the chunk's first token is replaced by it;
* only the second half is scored: the logits at positions ``context // 2`` … ``context - 2``
  predict the tokens after them (``context - context // 2 - 1`` tokens a chunk);
* the negative log-likelihood is summed in float64 (log-softmax of the logits cast to float64)
  and the perplexity is ``exp(total / count)``.

The model is any folder ``export --kv-cache`` wrote, either target, in its
:class:`~rmsnorm_deploy.decoder.generate.KVCacheModel` session.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import numpy as np

from rmsnorm_deploy.contract.dtypes import numpy_dtype
from rmsnorm_deploy.decoder.convention import ATTENTION_MASK, INPUT_IDS, LOGITS, POSITION_IDS
from rmsnorm_deploy.decoder.loop import CacheLayout
from rmsnorm_deploy.errors import InputError, UserError, one_line

__all__ = ["DEFAULT_CONTEXT", "Perplexity", "chunked", "perplexity", "scored_nll"]

#: llama-perplexity's context in the tables this is compared with (``-c 256``).
DEFAULT_CONTEXT = 256


@dataclasses.dataclass
class Perplexity:
    perplexity: float
    mean_nll: float  # nats per scored token
    scored_tokens: int
    chunks: int
    context: int
    text_tokens: int  # the token ids given (the dropped tail included)
    bos_token_id: int | None  # the token each chunk starts with, None when the model adds none
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"perplexity": self.perplexity, "mean_nll": self.mean_nll, "scored_tokens": self.scored_tokens,
                "chunks": self.chunks, "context": self.context, "text_tokens": self.text_tokens,
                "bos_token_id": self.bos_token_id, "seconds": round(self.seconds, 3)}


def chunked(token_ids: Sequence[int], context: int, bos_token_id: int | None = None) -> np.ndarray:
    """The [chunks, context] int64 windows llama-perplexity runs, each starting with ``bos_token_id``
    when one is given. Refuses (``InputError``) a context below 4 or fewer than ``2 * context`` ids."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 4:
        raise InputError(f"the perplexity context must be an integer >= 4, got {context!r}")
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if ids.size < 2 * context:
        raise InputError(f"the text has {ids.size} tokens; perplexity with a context of {context} needs at least "
                         f"{2 * context}: give a longer text or a smaller context")
    windows = ids[: (ids.size // context) * context].reshape(-1, context).copy()
    if bos_token_id is not None:
        windows[:, 0] = bos_token_id
    return windows


def scored_nll(logits: np.ndarray, window: np.ndarray) -> tuple[float, int]:
    """``(summed negative log-likelihood, tokens scored)`` of one window: the logits [context, vocab]
    at positions ``context // 2`` … ``context - 2`` against the tokens that follow them, in float64."""
    context = len(window)
    first = context // 2
    scored = np.asarray(logits[first: context - 1], dtype=np.float64)
    targets = np.asarray(window[first + 1:], dtype=np.int64)
    if not np.all(np.isfinite(scored)):
        raise UserError("the model returned NaN or Inf logits; its perplexity is undefined")
    top = scored.max(axis=-1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(scored - top).sum(axis=-1))
    picked = scored[np.arange(len(targets)), targets]
    return float((log_norm - picked).sum()), len(targets)


def perplexity(model: Any, token_ids: Sequence[int], *, context: int = DEFAULT_CONTEXT,
               bos_token_id: int | None = None) -> Perplexity:
    """The perplexity of ``model`` (an open :class:`~rmsnorm_deploy.decoder.generate.KVCacheModel`,
    inside its ``with`` block) over ``token_ids`` in llama-perplexity's scheme (module docstring)."""
    layout = model.layout
    if layout.dtype == "bfloat16":
        raise UserError("perplexity reads a float32 or float16 export; this one is bfloat16 (export it as float32)")
    if context > layout.max_length:
        raise InputError(f"a context of {context} tokens exceeds the model's maximum of {layout.max_length}")
    windows = chunked(token_ids, context, bos_token_id)
    if windows.size and int(windows.max()) >= layout.vocab_size:
        raise InputError(f"token id {int(windows.max())} is outside the model's vocabulary [0, {layout.vocab_size})")
    if windows.size and int(windows.min()) < 0:
        raise InputError(f"token id {int(windows.min())} is negative")
    cache = CacheLayout.of(layout)
    session = model.session
    takes_positions = POSITION_IDS in {i.name for i in session.get_inputs()}
    past_length = layout.max_length if cache.share_buffer else 0
    empty = np.zeros((1, cache.kv_heads, past_length, cache.head_dim), numpy_dtype(layout.dtype))
    fixed = {past: empty for past, _ in cache.pairs()}
    fixed[ATTENTION_MASK] = np.ones((1, context), np.int64)
    if takes_positions:
        fixed[POSITION_IDS] = np.arange(context, dtype=np.int64)[None, :]
    total, count = 0.0, 0
    start = time.perf_counter()
    for window in windows:
        try:
            (logits,) = session.run([LOGITS], {**fixed, INPUT_IDS: window[None, :]})
        except Exception as exc:  # ONNX Runtime raises its own exception types
            raise UserError(f"ONNX Runtime failed to run a perplexity chunk: {one_line(exc)}") from None
        nll, scored = scored_nll(logits[0], window)
        total += nll
        count += scored
    mean = total / count
    return Perplexity(perplexity=math.exp(mean), mean_nll=mean, scored_tokens=count, chunks=len(windows),
                      context=context, text_tokens=len(token_ids), bos_token_id=bos_token_id,
                      seconds=time.perf_counter() - start)
