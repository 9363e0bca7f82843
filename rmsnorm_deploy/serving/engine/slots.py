"""How the generation engine runs its streams: in slots of one KV cache, or one stream at a time.

:class:`SlotBatch` is continuous batching over the ``--target onnxruntime`` graph. The KV cache is
preallocated once: one [slots, kv_heads, slot_length, head_dim] array per past/present pair,
bound as both the past input and the present output, so GroupQueryAttention writes each new key
in place (the graph decides the shared mode by the two tensors being one buffer: a graph exported
without ``--share-buffer`` runs the same way). Every run is the decode loop's own step
(``decoder.ort_step.OrtStep``) over rows of those arrays (``OrtStep.cache_over``): this module
decides which rows run and which tokens they feed, the step binds and runs them. A stream owns one row (a slot) from its prefill to
its last token. What each run tells GroupQueryAttention per row is ``attention_mask``: the graph
takes ``seqlens_k = sum(mask) - 1`` as the row's past length and ``total_sequence_length`` as the
mask's width, so rows at different positions decode in one run with each row's mask left-padded
to the widest (row ``r`` at length ``n_r``: ``n_r + 1`` ones at the right, the new key written
at index ``n_r`` of its row, rotary position ``n_r``).

- Prefill runs one stream alone on its own row (the row's slice of each cache array is a
  contiguous view: nothing is copied), in chunks of ``prefill_chunk`` tokens (the last one up to
  a quarter longer, :data:`TAIL_SHARE`, so that a short tail does not wait an iteration of its
  own); a later chunk is GroupQueryAttention's "subsequent prompt" (past = the earlier chunks). An
  iteration prefills at most one such chunk when it exceeds ``prefill_chunk`` prompt tokens in all,
  so a newcomer stalls the running streams for one chunk at most.
- Decode runs rows ``0 .. highest busy slot`` in one run: each decoding stream's last token at its
  own position. A free or still-prefilling row in that range rides along as a placeholder (pad
  token, its own length: a free slot's is the tokens it keeps): its write lands just past the
  keys that row holds, and its logits are ignored.
- Prompt KV is kept across requests (``serving.engine.prefix_cache``): a slot a stream leaves keeps the
  KV of the tokens it fed; a newcomer goes to the free slot that shares the longest prefix with
  its prompt (else the lowest free slot, whose tokens are first copied into the ``PrefixStore``
  when there are enough of them), or has a longer prefix copied back from the store, and
  prefills only the rest.
- Streams of one prompt (OpenAI's ``n``: ``stream.follows``) prefill it once: a follower waits in
  its slot for its leader's prefill, then has the prompt's KV copied row to row and picks its first
  token from the leader's last prompt logits (kept in the leader's row). A follower whose leader is
  gone before its prefill ends prefills alone.

Measured on the 125M Llama (hidden 768 x 12 layers): a row's logits are bit-identical alone and in
a batch of 2 to 16, and a prompt's last logits bit-identical prefilled whole or in chunks of 16,
32 or 64 (MLAS computes each row of a MatMul the same whatever the batch): each stream's tokens
are those of ``generate`` on its prompt alone (the tests check it token for token).

:class:`TurnBatch` is the fallback for graphs whose cache cannot live in slots (the portable graph
concatenates its past every step; a non-CPU provider keeps the cache on its device): each stream
runs its own batch-1 decode loop (``decode_steps``), and the streams take turns one step each.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterator

import numpy as np

from rmsnorm_deploy.decoder.loop import decode_steps
from rmsnorm_deploy.decoder.ort_step import CacheLayout, OrtStep
from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.serving.engine.constraints import GrammarStopped
from rmsnorm_deploy.serving.engine.prefix_cache import PrefixStore, common_prefix

#: A prompt's last piece up to 1/TAIL_SHARE of a chunk is prefilled with the chunk before it: a chat
#: turn of 33 new tokens took two iterations at the default 32-token chunk, its first token waiting
#: for the second (16 users at once: turn 3's time to first token 0.83x their first turn's).
TAIL_SHARE = 4
#: A slot's tokens are copied into the prefix store before an unrelated prompt overwrites them only
#: when at least this many would be lost: a shorter prefix costs less to prefill than to keep.
KEEP_AT_LEAST = 16


def slots_refusal(model: Any) -> str | None:
    """Why ``model`` (a ``KVCacheModel``) cannot decode its streams in slots, or ``None`` when it can."""
    if model.layout.target != "onnxruntime":
        return ("the portable graph concatenates its past every step, so batching it would copy every row's "
                "cache at each join; export with --target onnxruntime for continuous batching")
    if model.layout.rotary_switch is not None:
        return ("LongRoPE picks one rotary table per run for every row (as transformers does for a batch), so "
                "streams decoded together would change each other's tables; they take turns")
    providers = list(model.runner.actual_providers)
    if providers[:1] != ["CPUExecutionProvider"]:
        return f"the KV cache in slots lives in host memory, which {providers[0]} would copy every step"
    return None


@dataclasses.dataclass
class _Row:
    """A stream's slot and how much of its prompt is in the cache."""

    slot: int
    filled: int = 0  # tokens in this slot's cache
    last: int = -1  # the last token handed out (the next decode step's input)
    fed: list[int] = dataclasses.field(default_factory=list)  # the tokens whose KV the slot holds (filled of them)
    failed: bool = False  # a run this row was in failed: its slot keeps nothing
    waits: Any = None  # the stream of the same prompt whose prefill this row copies (OpenAI's n)
    first_logits: np.ndarray | None = None  # the last prompt token's logits, for the streams that copy them

    def prefilling(self, stream: Any) -> bool:
        return self.filled < len(stream.prompt)


class SlotBatch:
    """Continuous batching in the slots of one preallocated KV cache (see the module docstring).
    Used by the engine thread only."""

    def __init__(self, model: Any, *, slots: int, slot_length: int, prefill_chunk: int, prefix_cache_bytes: int = 0):
        self.layout = dataclasses.replace(CacheLayout.of(model.layout), share_buffer=True, max_length=slot_length)
        self.slots, self.slot_length, self.prefill_chunk = slots, slot_length, prefill_chunk
        self.dtype = np.dtype(model.layout.dtype)
        #: the decode loop's own step, over the slots' memory (``OrtStep.cache_over``)
        self.step = OrtStep(model.session, self.layout, dtype=self.dtype)
        self.pad = int(model.special.get("pad_token_id") or 0)
        shape = (slots, self.layout.kv_heads, slot_length, self.layout.head_dim)
        # written, not only reserved: the pages are the OS's now, not at the first long stream's steps
        self.cache = [np.full(shape, 0, self.dtype) for _ in self.layout.pairs()]
        self.logits = np.empty((slots, 1, model.layout.vocab_size), self.dtype)
        self.rows: dict[Any, _Row] = {}
        self.free = list(range(slots))
        self.kept: list[list[int]] = [[] for _ in range(slots)]  # a free slot's tokens whose KV it still holds
        self.store = PrefixStore(prefix_cache_bytes)
        self.reuse_prefixes = True  # False: every prompt prefilled whole (a benchmark's baseline)
        #: prefill_tokens (run), prefix_hits (requests that reused a prefix), prefix_tokens_saved
        self.counts: collections.Counter = collections.Counter()
        self._batches: dict[int, Any] = {}  # per batch size k: rows 0..k-1 bound once, logits into self.logits
        self._rows: dict[int, Any] = {}  # per slot: its row bound once (prefill chunks, speculation's checks)
        self.speculation: Any = None  # serving.engine.speculation.EngineSpeculation, set by the engine

    @staticmethod
    def cache_bytes(layout: Any, slots: int, slot_length: int) -> int:
        """Bytes of the KV cache of ``slots`` slots of ``slot_length`` tokens (``layout``: a KVCacheLayout)."""
        per_token = 2 * layout.num_layers * layout.kv_heads * layout.head_dim * np.dtype(layout.dtype).itemsize
        return per_token * slots * slot_length

    # -- slots --------------------------------------------------------------------------------------
    def admit(self, stream: Any) -> None:
        """Give ``stream`` a free slot with as much of its prompt's KV as the slots or the store hold
        (all of the prompt but its last token at most: its logits pick the first new token). A stream
        that follows another of the same prompt still in its slot waits for that prefill instead."""
        leader = getattr(stream, "follows", None)
        if leader in self.rows and not self.rows[leader].failed:
            self.free.sort()
            slot = self.free.pop(0)
            self._keep(slot, 0)
            self.kept[slot] = []
            self.rows[stream] = _Row(slot, waits=leader)
            return
        prompt, limit = stream.prompt, (len(stream.prompt) - 1 if self.reuse_prefixes else 0)
        self.free.sort()
        slot, reused = self.free[0], 0
        for free in self.free:
            shared = min(common_prefix(self.kept[free], prompt), limit)
            if shared > reused:
                slot, reused = free, shared
        stored, key = self.store.longest(prompt) if self.store.entries else (0, None)
        if key is not None and min(stored, limit) > reused:
            slot = self.free[0]
            # Saving the slot's own tokens may evict the entry just found (the least recently used
            # of a full store): look it up again after, and reuse what is still there.
            self._keep(slot, 0)
            stored, key = self.store.longest(prompt) if self.store.entries else (0, None)
            reused = min(stored, limit) if key is not None else 0
            if reused:
                self.store.copy_into(key, reused, self._row_views(slot))
        else:
            self._keep(slot, reused)
        self.free.remove(slot)
        self.kept[slot] = []
        self.rows[stream] = _Row(slot, filled=reused, fed=list(prompt[:reused]))
        if reused:
            self.counts["prefix_hits"] += 1
            self.counts["prefix_tokens_saved"] += reused

    def release(self, stream: Any) -> None:
        row = self.rows.pop(stream, None)
        if row is not None:
            self.free.append(row.slot)
            # (fed never reaches slot_length: a stream's last token is handed out, not fed)
            self.kept[row.slot] = [] if row.failed else row.fed[:self.slot_length - 1]

    def _row_views(self, slot: int) -> list[np.ndarray]:
        return [array[slot] for array in self.cache]

    def _keep(self, slot: int, reused: int) -> None:
        """Copy a free slot's tokens into the store before a prompt that shares only ``reused`` of
        them overwrites the rest (when enough would be lost)."""
        kept = self.kept[slot]
        if self.store.budget_bytes and len(kept) - reused >= KEEP_AT_LEAST:
            self.store.put(kept, self._row_views(slot))

    def _cache(self, lo: int, hi: int, logits: np.ndarray | None = None) -> Any:
        """The step's cache over rows ``lo:hi`` of the slots (a contiguous view of each array: no copy)."""
        return self.step.cache_over([array[lo:hi] for array in self.cache], logits)

    def _run(self, run: Any, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, cache: Any) -> np.ndarray:
        """One run of the step (the one place a run can fail: RuntimeError, one line)."""
        try:
            logits, _ = run(ids, mask, positions, cache)
        except UserError as exc:
            raise RuntimeError(str(exc)) from None
        return logits

    def run_row(self, row: _Row, tokens: Any, *, every: bool = False) -> np.ndarray:
        """One run of ``row``'s slot alone over ``tokens``, fed after the ``row.filled`` keys it holds
        (a prefill chunk, or speculation's check): the last position's logits [1, vocab] (a copy), or
        with ``every`` every position's [1, len(tokens), vocab]. RuntimeError (one line) when the run fails."""
        if row.slot not in self._rows:
            self._rows[row.slot] = self._cache(row.slot, row.slot + 1)
        n, step = len(tokens), self.step
        logits = self._run(step.run_all if every else step.run, np.asarray([tokens], dtype=np.int64),
                           np.ones((1, row.filled + n), np.int64),
                           np.arange(row.filled, row.filled + n, dtype=np.int64)[None], self._rows[row.slot])
        return logits if every else np.array(logits)

    # -- one iteration --------------------------------------------------------------------------
    def iteration(self) -> Iterator[tuple[list[Any], int | None, str | None]]:
        """Prefill work, then one decode step: ``([stream], token, None)`` for each new token, or
        ``(streams, None, failure)`` for the streams of a run that failed (:func:`failure`: a
        message, or the ``GrammarStopped`` of a request whose grammar cannot go on)."""
        yield from self._prefill()
        yield from self._decode()

    def _prefill(self) -> Iterator[tuple[list[Any], int | None, str | None]]:
        budget = self.prefill_chunk
        for stream, row in sorted(self.rows.items(), key=lambda item: item[0].number):
            if row.waits is not None:
                lead = self.rows.get(row.waits)
                if lead is not None and not lead.failed and lead.first_logits is not None:
                    yield self._fork(stream, row, lead)
                    continue
                if lead is not None and not lead.failed:
                    continue  # its leader's prefill is still running
                row.waits = None  # the leader is gone before its prefill ended: prefill alone
            if not row.prefilling(stream):
                continue
            end = row.filled + self.prefill_chunk
            if len(stream.prompt) - end <= self.prefill_chunk // TAIL_SHARE:
                end = len(stream.prompt)  # a short tail rides in this run, not in an iteration of its own
            if budget < end - row.filled and budget < self.prefill_chunk:
                break  # this iteration's prompt tokens are spent
            budget -= end - row.filled
            try:
                last = self.run_row(row, stream.prompt[row.filled:end])
            except RuntimeError as exc:
                row.failed = True
                yield [stream], None, str(exc)
                continue
            self.counts["prefill_tokens"] += end - row.filled
            row.fed.extend(stream.prompt[row.filled:end])
            row.filled = end
            if not row.prefilling(stream):
                row.first_logits = last
                yield self._pick(stream, row, row.first_logits.copy())
            if budget <= 0:
                break

    def _fork(self, stream: Any, row: _Row, lead: _Row) -> tuple[list[Any], int | None, str | None]:
        """Start ``stream`` from its leader's prefill: the prompt's KV copied row to row (exact: the
        same keys a prefill of its own would write) and its first token picked from the same logits."""
        n = len(stream.prompt)
        for array in self.cache:
            array[row.slot, :, :n, :] = array[lead.slot, :, :n, :]
        row.filled, row.fed, row.waits = n, list(stream.prompt), None
        self.counts["forked_prefills"] += 1
        self.counts["prefix_tokens_saved"] += n
        return self._pick(stream, row, lead.first_logits.copy())

    @staticmethod
    def _pick(stream: Any, row: _Row, logits: np.ndarray) -> tuple[list[Any], int | None, Any]:
        """``stream``'s next token from ``logits``; a picker that raises fails this stream alone
        (:func:`failure`), the others in the run go on."""
        try:
            row.last = int(stream.pick(logits)[0])
        except Exception as exc:  # noqa: BLE001 - the request's grammar, or a fault: its stream only
            row.failed = True
            return [stream], None, failure(exc)
        return [stream], row.last, None

    def _decode(self) -> Iterator[tuple[list[Any], int | None, str | None]]:
        decoding = {row.slot: (stream, row) for stream, row in self.rows.items()
                    if not row.prefilling(stream) and not stream.done}
        if self.speculation is not None:  # streams checking proposals run alone first
            decoding = yield from self.speculation.verify(self, decoding)
        if not decoding:
            return
        k = max(decoding) + 1
        lengths = np.zeros(k, np.int64)
        ids = np.full((k, 1), self.pad, np.int64)
        for slot in self.free:
            if slot < k:  # a placeholder that writes past the keys the slot keeps
                lengths[slot] = len(self.kept[slot])
        for stream, row in self.rows.items():
            if row.slot < k:
                lengths[row.slot] = row.filled
        for slot, (_, row) in decoding.items():
            ids[slot, 0] = row.last
        width = int(lengths.max()) + 1
        mask = (np.arange(width)[None, :] >= (width - 1 - lengths)[:, None]).astype(np.int64)
        if k not in self._batches:
            self._batches[k] = self._cache(0, k, self.logits[:k])
        try:  # the logits: [k, vocab], a view of self.logits[:k], read in place
            logits = self._run(self.step.run, ids, mask, lengths[:, None], self._batches[k])
        except RuntimeError as exc:
            for _, row in decoding.values():
                row.failed = True
            yield [stream for stream, _ in decoding.values()], None, str(exc)
            return
        for slot, (stream, row) in sorted(decoding.items()):
            row.fed.append(row.last)
            row.filled += 1
            yield self._pick(stream, row, logits[slot:slot + 1])


def failure(exc: BaseException) -> str | GrammarStopped:
    """What an iteration yields for a stream whose step raised ``exc``: the ``GrammarStopped``
    itself when the request is at fault (its grammar cannot go on: the engine answers it as a
    refusal), else the fault's one line."""
    return exc if isinstance(exc, GrammarStopped) else one_line(exc)


class TurnBatch:
    """Streams take turns, one batch-1 step each, every stream in its own decode loop (see the
    module docstring). Used by the engine thread only."""

    def __init__(self, model: Any, *, slots: int):
        self.model, self.slots = model, slots
        self.loops: dict[Any, Iterator[tuple[np.ndarray, np.ndarray]]] = {}
        self.store = None  # each stream prefills its whole prompt: its cache lives in its own loop
        self.counts: collections.Counter = collections.Counter()
        self.speculation: Any = None  # serving.engine.speculation.EngineSpeculation, set by the engine

    def admit(self, stream: Any) -> None:
        self.counts["prefill_tokens"] += len(stream.prompt)
        ids = np.asarray([stream.prompt], dtype=np.int64)
        # eos handled by the engine: the loop only has to run up to max_new_tokens steps
        speculator = self.speculation.speculator(stream) if self.speculation is not None else None
        self.loops[stream] = decode_steps(self.model.stepper, ids, max_new_tokens=stream.max_new_tokens,
                                          pick=stream.pick, speculation=speculator)

    def release(self, stream: Any) -> None:
        self.loops.pop(stream, None)

    def iteration(self) -> Iterator[tuple[list[Any], int | None, str | None]]:
        for stream, loop in sorted(self.loops.items(), key=lambda item: item[0].number):
            if stream.done:
                continue
            try:
                token, _ = next(loop)
            except StopIteration:
                continue
            except Exception as exc:  # noqa: BLE001 - a failing step fails its stream only
                yield [stream], None, failure(exc)
                continue
            yield [stream], int(token[0]), None
            while self.speculation is not None and self.speculation.pending(stream) and not stream.done:
                token, _ = next(loop)  # the rest of a speculative run's tokens: made already
                yield [stream], int(token[0]), None
