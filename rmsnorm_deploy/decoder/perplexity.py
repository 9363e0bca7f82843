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
:class:`~rmsnorm_deploy.decoder.generate.KVCacheModel` session (a folder without this package's
KV-cache metadata, as optimum or onnxruntime-genai write them, is refused when it is opened). Its
logits come through :func:`session_logits`, one window at a time, so another source of logits (the
transformers model an export came from: ``decoder.divergence``) is scored by the same code.

The text: :func:`text_ids` tokenizes it with the folder's ``tokenizer.json`` (special tokens added
as the tokenizer adds them); when the tokenizer puts the model's BOS token in front, each chunk
starts with it, as llama.cpp's ``add_bos_token`` does. :data:`SHIPPED_TEXT` is the text read when
none is given (``texts/README.md``: the GNU GPL v3, what ``benchmarks/real_checkpoints.py`` measured).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from rmsnorm_deploy.contract.dtypes import numpy_dtype
from rmsnorm_deploy.decoder.convention import ATTENTION_MASK, INPUT_IDS, LOGITS, POSITION_IDS
from rmsnorm_deploy.decoder.loop import CacheLayout
from rmsnorm_deploy.errors import InputError, UserError, one_line

__all__ = ["DEFAULT_CONTEXT", "SHIPPED_TEXT", "Perplexity", "chunked", "log_softmax64", "perplexity", "read_text",
           "scored_log_probs", "scored_nll", "scored_positions", "session_logits", "text_ids"]

#: llama-perplexity's context in the tables this is compared with (``-c 256``).
DEFAULT_CONTEXT = 256
#: The text read when none is given: the GNU GPL v3 as Debian ships it (``texts/README.md``).
SHIPPED_TEXT = Path(__file__).resolve().parent / "texts" / "GPL-3"
SHIPPED_TEXT_NAME = "the GNU GPL v3 shipped with rmsnorm-deploy (Debian's /usr/share/common-licenses/GPL-3)"
#: ``window [context] int64 -> logits [context, vocab]``: one chunk run from an empty cache.
LogitsOf = Callable[[np.ndarray], np.ndarray]
#: ``(chunks done, chunks in all)`` after each chunk: a command's progress line.
OnChunk = Callable[[int, int], None]


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


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis in float64 (the logits cast first, the maximum subtracted);
    NaN or Inf logits are refused (``UserError``): the model's perplexity would be undefined."""
    wide = np.asarray(logits, dtype=np.float64)
    if not np.all(np.isfinite(wide)):
        raise UserError("the model returned NaN or Inf logits; its perplexity is undefined")
    top = wide.max(axis=-1, keepdims=True)
    return wide - (top + np.log(np.exp(wide - top).sum(axis=-1, keepdims=True)))


def scored_positions(context: int) -> range:
    """The positions of a window whose logits are scored: ``context // 2`` … ``context - 2`` (each
    predicts the token after it)."""
    return range(context // 2, context - 1)


def scored_log_probs(logits: np.ndarray, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log-probabilities [scored, vocab] float64, the tokens they predict [scored])`` of one window
    (logits [context, vocab]) at its :func:`scored_positions`."""
    rows = scored_positions(len(window))
    return log_softmax64(logits[rows.start: rows.stop]), np.asarray(window[rows.start + 1:], dtype=np.int64)


def scored_nll(logits: np.ndarray, window: np.ndarray) -> tuple[float, int]:
    """``(summed negative log-likelihood, tokens scored)`` of one window (:func:`scored_log_probs`)."""
    log_probs, targets = scored_log_probs(logits, window)
    return float(-log_probs[np.arange(len(targets)), targets].sum()), len(targets)


def session_logits(model: Any, context: int) -> LogitsOf:
    """The logits of one window of ``context`` tokens from ``model`` (an open
    :class:`~rmsnorm_deploy.decoder.generate.KVCacheModel`): a prefill from an empty cache.
    Refuses a bfloat16 export and a context past the model's maximum."""
    layout = model.layout
    if layout.dtype == "bfloat16":
        raise UserError("perplexity reads a float32 or float16 export; this one is bfloat16 (export it as float32)")
    if context > layout.max_length:
        raise InputError(f"a context of {context} tokens exceeds the model's maximum of {layout.max_length}")
    cache = CacheLayout.of(layout)
    session = model.session
    past_length = layout.max_length if cache.share_buffer else 0
    empty = np.zeros((1, cache.kv_heads, past_length, cache.head_dim), numpy_dtype(layout.dtype))
    fixed = {past: empty for past, _ in cache.pairs()}
    fixed[ATTENTION_MASK] = np.ones((1, context), np.int64)
    if POSITION_IDS in {i.name for i in session.get_inputs()}:
        fixed[POSITION_IDS] = np.arange(context, dtype=np.int64)[None, :]

    def logits_of(window: np.ndarray) -> np.ndarray:
        try:
            (logits,) = session.run([LOGITS], {**fixed, INPUT_IDS: window[None, :]})
        except Exception as exc:  # ONNX Runtime raises its own exception types
            raise UserError(f"ONNX Runtime failed to run a perplexity chunk: {one_line(exc)}") from None
        return logits[0]

    return logits_of


def check_windows(windows: np.ndarray, vocab_size: int) -> None:
    """Every token id of ``windows`` inside ``[0, vocab_size)`` (``InputError`` naming the first outside)."""
    if windows.size and int(windows.max()) >= vocab_size:
        raise InputError(f"token id {int(windows.max())} is outside the model's vocabulary [0, {vocab_size})")
    if windows.size and int(windows.min()) < 0:
        raise InputError(f"token id {int(windows.min())} is negative")


def perplexity(model: Any, token_ids: Sequence[int], *, context: int = DEFAULT_CONTEXT,
               bos_token_id: int | None = None, on_chunk: OnChunk | None = None) -> Perplexity:
    """The perplexity of ``model`` (an open :class:`~rmsnorm_deploy.decoder.generate.KVCacheModel`,
    inside its ``with`` block) over ``token_ids`` in llama-perplexity's scheme (module docstring)."""
    logits_of = session_logits(model, context)
    windows = chunked(token_ids, context, bos_token_id)
    check_windows(windows, model.layout.vocab_size)
    total, count = 0.0, 0
    start = time.perf_counter()
    for done, window in enumerate(windows, 1):
        nll, scored = scored_nll(logits_of(window), window)
        total += nll
        count += scored
        if on_chunk is not None:
            on_chunk(done, len(windows))
    mean = total / count
    return Perplexity(perplexity=math.exp(mean), mean_nll=mean, scored_tokens=count, chunks=len(windows),
                      context=context, text_tokens=len(token_ids), bos_token_id=bos_token_id,
                      seconds=time.perf_counter() - start)


# -- the text ---------------------------------------------------------------------------------------
def read_text(path: str | Path) -> str:
    """A text file as UTF-8 (``InputError`` naming the first byte that is not)."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); give a UTF-8 "
                         "text, or token ids with --tokens") from None


def leading_bos(token_ids: Sequence[int], bos_token_id: int | None) -> int | None:
    """The BOS id each chunk starts with: the model's, when the tokenizer put it in front of the text."""
    return bos_token_id if bos_token_id is not None and len(token_ids) and int(token_ids[0]) == bos_token_id else None


def text_ids(model: Any, text: str) -> tuple[list[int], int | None]:
    """``(token ids, the BOS id each chunk starts with or None)`` of ``text`` with the tokenizer of
    ``model``'s folder (a :class:`~rmsnorm_deploy.decoder.generate.KVCacheModel`)."""
    if model.tokenizer is None:
        raise InputError(f"{model.folder} has no tokenizer.json to read the text with")
    ids = model.encode(text)
    return ids, leading_bos(ids, model.special.get("bos_token_id"))
