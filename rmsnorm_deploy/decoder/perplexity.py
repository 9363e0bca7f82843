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

With a ``stride`` (``perplexity --stride N``, :func:`sliding`) the windows slide instead: windows
of ``context`` tokens start at ``0, stride, 2 * stride, …`` while a whole window fits (the tail
that does not fill a stride is dropped; at least ``context`` ids are needed), each starting with
the BOS token when the model adds one, as the chunks do; each window scores its last ``stride``
tokens (the logits at positions ``context - stride - 1`` … ``context - 2``), so every token from
index ``context - stride`` on is scored exactly once, each with at least ``context - stride``
tokens before it in its window. The first ``context - stride`` tokens of the text only give
context. A stride of 1 scores every token with a full window behind it (the slowest, the closest
to a model's own long-context perplexity); the chunk scheme stays the default because its numbers
are llama-perplexity's.

The model is any folder ``export --kv-cache`` wrote, either target, in its
:class:`~rmsnorm_deploy.decoder.generate.KVCacheModel` session, or a KV-cache folder optimum or
onnxruntime-genai wrote (``decoder.kv_folders``: its names and cache shape, :class:`GraphFeed`,
read from its own files). Its logits come through :func:`session_logits`, one window at a time
from an empty cache, so another source of logits (the transformers model an export came from:
``decoder.divergence``) is scored by the same code.

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
from rmsnorm_deploy.decoder.ort_step import CacheLayout
from rmsnorm_deploy.errors import InputError, UserError, one_line

__all__ = ["DEFAULT_CONTEXT", "SHIPPED_TEXT", "GraphFeed", "Perplexity", "chunked", "log_softmax64", "perplexity",
           "read_text", "scored_log_probs", "scored_nll", "scored_positions", "session_logits", "sliding", "text_ids",
           "windows_of"]

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
    stride: int | None = None  # sliding windows (:func:`sliding`); None: llama-perplexity's chunks

    def to_dict(self) -> dict[str, Any]:
        return {"perplexity": self.perplexity, "mean_nll": self.mean_nll, "scored_tokens": self.scored_tokens,
                "chunks": self.chunks, "context": self.context, "stride": self.stride, "text_tokens": self.text_tokens,
                "bos_token_id": self.bos_token_id, "seconds": round(self.seconds, 3)}


@dataclasses.dataclass(frozen=True)
class GraphFeed:
    """What :func:`session_logits` feeds a KV-cache graph with: its input and output names and its
    cache's shape; ours from the export's metadata (:meth:`of_layout`), a folder optimum or
    onnxruntime-genai wrote from that folder's own files (``decoder.kv_folders``)."""

    cache: CacheLayout
    dtype: str  # of the cache and the logits
    vocab_size: int
    max_length: int | None  # the longest window the model takes; None: its files do not say
    input_ids: str = INPUT_IDS
    attention_mask: str = ATTENTION_MASK
    position_ids: str | None = POSITION_IDS  # None: the graph takes no positions
    logits: str = LOGITS

    @classmethod
    def of_layout(cls, layout: Any) -> GraphFeed:
        """Our export's feed (a ``decoder.convention.KVCacheLayout``, already checked)."""
        return cls(CacheLayout.of(layout), layout.dtype, layout.vocab_size, layout.max_length)


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


def check_stride(stride: Any, context: int) -> None:
    """A stride is an integer from 1 to ``context - 1`` (``InputError`` otherwise)."""
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride < context:
        raise InputError(f"the perplexity stride must be an integer from 1 to the context minus 1 ({context - 1}), "
                         f"got {stride!r}")


def sliding(token_ids: Sequence[int], context: int, stride: int, bos_token_id: int | None = None) -> np.ndarray:
    """The [windows, context] int64 windows of the sliding scheme (module docstring): starts ``0,
    stride, …`` while a whole window fits, each starting with ``bos_token_id`` when one is given.
    Refuses a context below 4, a stride outside ``[1, context)`` and fewer than ``context`` ids."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 4:
        raise InputError(f"the perplexity context must be an integer >= 4, got {context!r}")
    check_stride(stride, context)
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if ids.size < context:
        raise InputError(f"the text has {ids.size} tokens; perplexity with a context of {context} needs at least "
                         f"{context} with --stride: give a longer text or a smaller context")
    starts = np.arange(0, ids.size - context + 1, stride)
    windows = ids[starts[:, None] + np.arange(context)[None, :]]
    if bos_token_id is not None:
        windows[:, 0] = bos_token_id
    return windows


def windows_of(token_ids: Sequence[int], context: int, bos_token_id: int | None = None,
               stride: int | None = None) -> np.ndarray:
    """:func:`chunked` without a stride, :func:`sliding` with one."""
    if stride is None:
        return chunked(token_ids, context, bos_token_id)
    return sliding(token_ids, context, stride, bos_token_id)


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis in float64 (the logits cast first, the maximum subtracted);
    NaN or Inf logits are refused (``UserError``): the model's perplexity would be undefined."""
    wide = np.asarray(logits, dtype=np.float64)
    if not np.all(np.isfinite(wide)):
        raise UserError("the model returned NaN or Inf logits; its perplexity is undefined")
    top = wide.max(axis=-1, keepdims=True)
    return wide - (top + np.log(np.exp(wide - top).sum(axis=-1, keepdims=True)))


def scored_positions(context: int, stride: int | None = None) -> range:
    """The positions of a window whose logits are scored (each predicts the token after it):
    ``context // 2`` … ``context - 2`` in chunks, the last ``stride`` (``context - stride - 1`` …
    ``context - 2``) in sliding windows."""
    if stride is None:
        return range(context // 2, context - 1)
    return range(context - stride - 1, context - 1)


def scored_log_probs(logits: np.ndarray, window: np.ndarray,
                     stride: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(log-probabilities [scored, vocab] float64, the tokens they predict [scored])`` of one window
    (logits [context, vocab]) at its :func:`scored_positions`."""
    rows = scored_positions(len(window), stride)
    return log_softmax64(logits[rows.start: rows.stop]), np.asarray(window[rows.start + 1:], dtype=np.int64)


def scored_nll(logits: np.ndarray, window: np.ndarray, stride: int | None = None) -> tuple[float, int]:
    """``(summed negative log-likelihood, tokens scored)`` of one window (:func:`scored_log_probs`)."""
    log_probs, targets = scored_log_probs(logits, window, stride)
    return float(-log_probs[np.arange(len(targets)), targets].sum()), len(targets)


def session_logits(model: Any, context: int) -> LogitsOf:
    """The logits of one window of ``context`` tokens from ``model`` (an open
    :class:`~rmsnorm_deploy.decoder.generate.KVCacheModel`, or a folder of optimum or
    onnxruntime-genai opened by ``decoder.kv_folders``, which carries its :class:`GraphFeed`): a
    prefill from an empty cache. Refuses a bfloat16 model and a context past the model's maximum."""
    feed = getattr(model, "graph_feed", None) or GraphFeed.of_layout(model.layout)
    if feed.dtype == "bfloat16":
        raise UserError("perplexity reads a float32 or float16 export; this one is bfloat16 (export it as float32)")
    if feed.max_length is not None and context > feed.max_length:
        raise InputError(f"a context of {context} tokens exceeds the model's maximum of {feed.max_length}")
    cache = feed.cache
    session = model.session
    past_length = cache.max_length if cache.share_buffer else 0
    empty = np.zeros((1, cache.kv_heads, past_length, cache.head_dim), numpy_dtype(feed.dtype))
    fixed = {past: empty for past, _ in cache.pairs()}
    # int64 as the convention says; int32 where a foreign graph declares it (its own builder's choice)
    integer = {i.name: np.int32 if i.type == "tensor(int32)" else np.int64 for i in session.get_inputs()}
    fixed[feed.attention_mask] = np.ones((1, context), integer.get(feed.attention_mask, np.int64))
    if feed.position_ids is not None and feed.position_ids in integer:
        fixed[feed.position_ids] = np.arange(context, dtype=integer[feed.position_ids])[None, :]
    ids_type = integer.get(feed.input_ids, np.int64)

    def logits_of(window: np.ndarray) -> np.ndarray:
        try:
            (logits,) = session.run([feed.logits], {**fixed, feed.input_ids: window[None, :].astype(ids_type)})
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
               bos_token_id: int | None = None, on_chunk: OnChunk | None = None,
               stride: int | None = None) -> Perplexity:
    """The perplexity of ``model`` (an open :class:`~rmsnorm_deploy.decoder.generate.KVCacheModel`
    or ``decoder.kv_folders`` model, inside its ``with`` block) over ``token_ids`` in
    llama-perplexity's scheme, or with ``stride`` in sliding windows (module docstring)."""
    logits_of = session_logits(model, context)
    windows = windows_of(token_ids, context, bos_token_id, stride)
    check_windows(windows, model.layout.vocab_size)
    total, count = 0.0, 0
    start = time.perf_counter()
    for done, window in enumerate(windows, 1):
        nll, scored = scored_nll(logits_of(window), window, stride)
        total += nll
        count += scored
        if on_chunk is not None:
            on_chunk(done, len(windows))
    mean = total / count
    return Perplexity(perplexity=math.exp(mean), mean_nll=mean, scored_tokens=count, chunks=len(windows),
                      context=context, text_tokens=len(token_ids), bos_token_id=bos_token_id,
                      seconds=time.perf_counter() - start, stride=stride)


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
