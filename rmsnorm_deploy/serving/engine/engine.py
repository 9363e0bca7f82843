"""The generation engine: one thread owns the ONNX Runtime session and runs every stream.

Front ends (the KServe models of ``serve``, an asyncio server) call :meth:`Engine.submit` from any
thread and get a :class:`Stream`: a thread-safe handle to iterate tokens as they come (blocking),
to ``async for`` over them or ``await`` the whole answer from an event loop (the engine thread
wakes the loop with ``call_soon_threadsafe``), and to :meth:`Stream.cancel`. Nothing is held
across a generation: a front end waits on its own stream only.

The engine thread loops over iterations of its batch (``serving.engine.slots``): admit waiting requests
into free slots, drop cancelled streams (their slot is free for the next iteration), prefill
newcomers (at most ``prefill_chunk`` prompt tokens per iteration), then one decode step of every
running stream. ``SlotBatch`` decodes all streams in one ONNX Runtime run (continuous batching,
the ``--target onnxruntime`` graph); ``TurnBatch`` lets them take turns at batch 1 (the portable
graph, or a non-CPU provider); :attr:`Engine.batching` says which and why.

The KV cache is one budget of ``max_tokens_in_flight`` tokens split evenly across the slots (as
llama-server splits ``-c`` across ``-np``): its default is sized to the model and the machine
(:func:`default_tokens_in_flight`), never a model-length slot per stream. A prompt longer than a
slot is refused in one line naming the largest; a stream whose new tokens would outgrow its slot
ends when the slot is full, with finish reason ``length`` (a slot is one contiguous row of the cache, so it
cannot borrow another's room). Prompt KV is kept across requests (``serving.engine.prefix_cache``).

Each stream picks its tokens with its own picker (``token_picker``: greedy, or its own generator
seeded as ``generate`` seeds it) and ends as ``generate`` ends a batch-1 row: after an
end-of-sequence token (included) or ``max_new_tokens`` tokens.

With ``speculation`` (``serve --speculative ngram|DRAFT_DIR``) a stream whose picker is plain
``Sampling`` proposes tokens and has several checked in one run (``serving.engine.speculation``:
greedy tokens unchanged, sampled ones from the model's distribution); :meth:`Engine.speculation_stats`.

Backpressure and faults: at most ``max_batch`` streams run and ``max_queue`` wait; beyond that
:meth:`Engine.submit` raises :class:`EngineBusy` at once. Before warm-up and while draining it
raises :class:`EngineUnavailable`. A run that fails fails the streams in it (``StreamFailed``, one
line) and the engine carries on. :meth:`Engine.drain` stops admitting, lets what runs finish (or
cancels it after a timeout) and stops the thread.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import numpy as np

from rmsnorm_deploy.decoder.generate import DEFAULT_MAX_NEW_TOKENS, FROM_FOLDER, check_max_new_tokens
from rmsnorm_deploy.decoder.loop import Sampling, token_picker
from rmsnorm_deploy.errors import InputError, UserError, one_line
from rmsnorm_deploy.resources import check_memory, memory_budget
from rmsnorm_deploy.serving.engine.slots import SlotBatch, TurnBatch, slots_refusal
from rmsnorm_deploy.serving.engine.speculation import EngineSpeculation, plain_sampling

__all__ = ["Engine", "EngineBusy", "EngineOptions", "EngineUnavailable", "Stream", "StreamCancelled", "StreamFailed",
           "default_tokens_in_flight"]

#: The default KV budget in tokens, all slots together (a model or machine that holds less gets less):
#: a decode step's attention in ONNX Runtime's GroupQueryAttention costs with the slot's length, so a
#: model-length slot per stream is slow as well as large (SmolLM2: 0.43x llama-server's tokens/s at 16
#: clients with 8,192 tokens a slot, 1.08x with 256). 32,768 is 2,048 tokens a slot at 16 slots.
DEFAULT_TOKENS_IN_FLIGHT = 32768
#: The share of the memory budget (``resources.memory_budget``) the default KV cache may take.
KV_MEMORY_SHARE = 0.5


class EngineBusy(UserError):
    """Every slot is busy and the queue is full: retry later (HTTP 429/503, gRPC UNAVAILABLE)."""


class EngineUnavailable(UserError):
    """The engine is not warm yet, or it is draining before the server stops (HTTP 503)."""


class StreamFailed(Exception):
    """A run this stream was in failed (a server fault: HTTP 500); the message is one line."""


class StreamCancelled(Exception):
    """The stream was cancelled (by its client, or by a drain that ran out of time)."""


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The engine's limits (``serve``'s options of the same names)."""

    max_batch: int = 16  # streams decoded together (slots of the KV cache)
    max_queue: int = 64  # requests waiting for a slot; beyond that a request is refused at once
    max_tokens_in_flight: int | None = None  # KV cache size in tokens (default: default_tokens_in_flight)
    prefill_chunk: int = 32  # prompt tokens prefilled per iteration (bounds running streams' stall)
    prefix_cache_mb: int = 256  # copies of prompt KV kept across requests beyond the slots' own (0: off)
    drain_timeout_s: float = 30.0  # on drain, in-flight streams are cancelled after this

    def check(self) -> None:
        for flag, value, low in (("--max-batch", self.max_batch, 1), ("--max-queue", self.max_queue, 0),
                                 ("--prefill-chunk", self.prefill_chunk, 1), ("--prefix-cache-mb", self.prefix_cache_mb, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UserError(f"{flag} must be an integer >= {low}, got {value!r}")
        t = self.max_tokens_in_flight
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 2 * self.max_batch):
            raise UserError(f"--max-tokens-in-flight must be an integer >= 2 x --max-batch ({2 * self.max_batch}), "
                            f"got {t!r}")
        if not (isinstance(self.drain_timeout_s, (int, float)) and 0 <= self.drain_timeout_s < float("inf")):
            raise UserError(f"--drain-timeout must be a number of seconds >= 0, got {self.drain_timeout_s!r}")


def default_tokens_in_flight(layout: Any, slots: int) -> int:
    """The KV budget when ``--max-tokens-in-flight`` is not given: the least of ``slots`` x the
    model's length, :data:`DEFAULT_TOKENS_IN_FLIGHT`, and what :data:`KV_MEMORY_SHARE` of this
    machine's memory budget holds; a multiple of ``slots`` (``layout``: a KVCacheLayout)."""
    tokens = min(slots * layout.max_length, DEFAULT_TOKENS_IN_FLIGHT)
    budget = memory_budget()
    if budget is not None:
        tokens = min(tokens, int(budget * KV_MEMORY_SHARE) // SlotBatch.cache_bytes(layout, 1, 1))
    return max(tokens // slots, 2) * slots  # (two tokens a slot at least: check_memory then says it cannot fit)


class Stream:
    """One request in the engine: its tokens as they come, how it ended, and a way to cancel it.

    Thread-safe. ``for token in stream`` blocks for each token; ``async for token in stream``
    (or :meth:`tokens_async`) and ``await stream.result_async()`` wait in an event loop. Leaving
    either loop early cancels the stream (a client gone). After the end, :attr:`finish_reason` is
    ``"stop"`` (an end-of-sequence token, included), ``"length"`` (``max_new_tokens``),
    ``"cancelled"`` or ``"error"``; iteration raises :class:`StreamFailed` (or its grammar's
    ``GrammarStopped``) or :class:`StreamCancelled` for the last two.
    """

    def __init__(self, engine: Engine, number: int, prompt: list[int], max_new_tokens: int,
                 pick: Callable[[np.ndarray], np.ndarray], eos: frozenset[int]):
        self.engine, self.number, self.prompt = engine, number, prompt
        self.max_new_tokens, self.pick, self.eos = max_new_tokens, pick, eos
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._cond = threading.Condition()
        self._wakers: list[Callable[[], None]] = []
        self.cancel_requested = False
        self.ending: str | None = None  # "stop" or "length" once a pushed token ends it (finish_reason on retiring)
        self.sampling: Sampling | None = None  # set by the engine: speculation's (None: none)
        self.follows: Stream | None = None  # the stream of the same prompt whose prefill this one shares

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    # -- the engine's side ----------------------------------------------------------------------
    def _push(self, token: int) -> bool:
        """Hand out a token; True when it ends the stream (which ``Engine._retire`` frees and counts, then ends)."""
        with self._cond:
            if self.finish_reason is not None:  # ended meanwhile (a drain that ran out of time)
                return True
            self.tokens.append(token)
            now, last = time.perf_counter(), self.last_token_at
            self.first_token_at, self.last_token_at = self.first_token_at or now, now
            ended = token in self.eos or len(self.tokens) >= self.max_new_tokens
            if ended:
                self.ending = "stop" if token in self.eos else "length"
        self.engine._token_out(now - self.submitted_at if last is None else None, None if last is None else now - last)
        self._wake()
        return ended

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error = reason, error
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    # -- the front end's side ---------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the stream: its slot is free for the next iteration (a queued one never starts)."""
        self.engine._cancel(self)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def __iter__(self) -> Iterator[int]:
        index = 0
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: len(self.tokens) > index or self.done)
                    new, done = self.tokens[index:], self.done
                yield from new
                index += len(new)
                if done and index == len(self.tokens):
                    self._raise_if_failed()
                    return
        finally:
            if not self.done:
                self.cancel()

    def result(self, timeout: float | None = None) -> list[int]:
        """All new tokens once the stream ends (``TimeoutError`` after ``timeout`` seconds)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"the stream did not end within {timeout} s")
        self._raise_if_failed()
        return list(self.tokens)

    async def tokens_async(self) -> AsyncIterator[int]:
        """The tokens in an event loop: the engine thread wakes it with ``call_soon_threadsafe``."""
        loop = asyncio.get_running_loop()
        news = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(news.set)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        with self._cond:
            self._wakers.append(wake)
        index = 0
        try:
            while True:
                news.clear()
                with self._cond:
                    new, done = self.tokens[index:], self.done
                for token in new:
                    yield token
                index += len(new)
                if done and index == len(self.tokens):
                    self._raise_if_failed()
                    return
                if not new:
                    await news.wait()
        finally:
            with self._cond:
                self._wakers.remove(wake)
            if not self.done:
                self.cancel()

    def __aiter__(self) -> AsyncIterator[int]:
        return self.tokens_async()

    async def result_async(self) -> list[int]:
        return [token async for token in self.tokens_async()]


class Engine:
    """The generation engine over an open ``KVCacheModel`` (see the module docstring)."""

    def __init__(self, model: Any, options: EngineOptions | None = None, *, batching: str = "auto",
                 speculation: Any = None):
        self.model = model
        self.options = options = options or EngineOptions()
        options.check()
        lay = model.layout
        if batching not in ("auto", "turns"):
            raise UserError(f"batching must be 'auto' or 'turns', got {batching!r}")
        self.refusal = slots_refusal(model) if batching == "auto" else "taking turns was asked for"
        budget = options.max_tokens_in_flight or default_tokens_in_flight(lay, options.max_batch)
        self.slot_length = min(lay.max_length, budget // options.max_batch)
        if self.refusal is None:
            check_memory(SlotBatch.cache_bytes(lay, options.max_batch, self.slot_length),
                         f"a KV cache of {options.max_batch} slots of {self.slot_length} tokens",
                         "lower --max-batch or --max-tokens-in-flight")
            self.batch: SlotBatch | TurnBatch = SlotBatch(model, slots=options.max_batch, slot_length=self.slot_length,
                                                          prefill_chunk=options.prefill_chunk,
                                                          prefix_cache_bytes=options.prefix_cache_mb << 20)
        else:
            self.slot_length = lay.max_length
            self.batch = TurnBatch(model, slots=options.max_batch)
        #: ``serve --speculative``: a ``decoder.generate.SpeculationOptions``, checked here (``InputError``)
        self.speculation = None
        if speculation is not None:
            speculation.check(model, self.slot_length)
            self.speculation = self.batch.speculation = EngineSpeculation(speculation)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Stream] = collections.deque()
        self._running: set[Stream] = set()
        self._numbers = itertools.count()
        self._state = "new"  # new, warming, ready, draining, stopped
        self._thread: threading.Thread | None = None
        self.counts = collections.Counter()  # stop, length, cancelled, error, refused_busy, steps
        self.generated = 0  # tokens handed out
        #: called with (seconds to the first token, None) or (None, seconds since the previous token)
        #: for each token handed out (``serving.engine.metrics`` sets it)
        self.observer: Callable[[float | None, float | None], None] | None = None
        self.metrics: Any = None  # serving.engine.metrics.EngineMetrics, made by the first /metrics route

    # -- what it is --------------------------------------------------------------------------------
    @property
    def batching(self) -> str:
        o = self.options
        if self.refusal is None:
            mib = SlotBatch.cache_bytes(self.model.layout, o.max_batch, self.slot_length) / 2**20
            source = "--max-tokens-in-flight" if o.max_tokens_in_flight else "default"
            prefix = (f"a prefix cache of up to {o.prefix_cache_mb} MiB beside the slots' own" if o.prefix_cache_mb
                      else "the slots' own only, --prefix-cache-mb 0")
            return (f"continuous batching: up to {o.max_batch} streams decoded together in slots of "
                    f"{self.slot_length} tokens (KV cache {o.max_batch * self.slot_length:,} tokens, {mib:,.1f} MiB, "
                    f"{source}; the largest request: {self.slot_length} tokens, prompt and new tokens together), "
                    f"prompts prefilled {o.prefill_chunk} tokens per step, prompt KV reused across requests "
                    f"({prefix}), {o.max_queue} more requests queued")
        return (f"one stream at a time: up to {o.max_batch} streams take turns, one batch-1 step each "
                f"({self.refusal}); {o.max_queue} more requests queued")

    @property
    def ready(self) -> bool:
        return self._state == "ready"

    def stats(self) -> dict[str, int]:
        """Streams running and waiting now, and how the others ended (``counts`` also has the steps)."""
        with self._cond:
            ended = {k: v for k, v in self.counts.items() if k != "steps"}
            return {"running": len(self._running), "waiting": len(self._waiting), **ended}

    def token_stats(self) -> dict[str, int]:
        """Tokens prefilled (run through the model) and generated, requests that reused a cached
        prompt prefix (``prefix_hits``) and the prompt tokens they did not prefill (with those of
        streams that copied another's prefill: ``shared_prefills``), the prefix store's entries and bytes."""
        store = self.batch.store
        with self._cond:
            counts = self.batch.counts
            return {"prefill_tokens": counts["prefill_tokens"], "generated_tokens": self.generated,
                    "prefix_hits": counts["prefix_hits"], "prefix_tokens_saved": counts["prefix_tokens_saved"],
                    "shared_prefills": counts["forked_prefills"],
                    "prefix_store_entries": len(store.entries) if store else 0,
                    "prefix_store_bytes": store.nbytes if store else 0}

    def speculation_stats(self) -> dict[str, Any] | None:
        """``serve --speculative``: proposed and accepted tokens, runs of the model per stream after
        the prefill and tokens per run (``SpeculationStats``), streams that could not speculate;
        ``None`` without speculation."""
        return None if self.speculation is None else self.speculation.totals()

    def _token_out(self, first: float | None, gap: float | None) -> None:
        self.generated += 1
        if self.observer is not None:
            self.observer(first, gap)

    # -- life cycle ----------------------------------------------------------------------------------
    def start(self, *, warm: bool = True, timeout_s: float = 600) -> Engine:
        """Start the engine thread; ``warm``: first a short request in every slot at once (widest batch's memory)."""
        with self._cond:
            if self._state != "new":
                raise RuntimeError(f"the engine was already started ({self._state})")
            self._state = "warming"
        self._thread = threading.Thread(target=self._loop, name="generation-engine", daemon=True)
        self._thread.start()
        if warm:
            bos = [self.model.special.get("bos_token_id") or 0]
            for stream in [self._enqueue(bos, 2, token_picker(), frozenset()) for _ in range(self.options.max_batch)]:
                stream.result(timeout_s)
        with self._cond:
            self.counts.clear()  # the warm-up is not a request
            self.batch.counts.clear()
            self.generated = 0
            if self.speculation is not None:
                self.speculation.reset()
            self._state = "ready"
        return self

    def drain(self, timeout_s: float | None = None) -> bool:
        """Stop admitting, let running and queued streams finish for up to ``timeout_s`` (default
        ``drain_timeout_s``), cancel what is left, stop the thread. True when nothing was cancelled."""
        timeout_s = self.options.drain_timeout_s if timeout_s is None else timeout_s
        with self._cond:
            if self._state in ("new", "stopped"):
                self._state = "stopped"
                return True
            self._state = "draining"
            finished = self._cond.wait_for(lambda: not self._running and not self._waiting, timeout_s)
            left = list(self._running) + list(self._waiting)
            self._running.clear()
            self._waiting.clear()
            self.counts["cancelled"] += len(left)
            self._state = "stopped"
            self._cond.notify_all()
        for stream in left:
            stream.cancel_requested = True
            stream._finish("cancelled", StreamCancelled(
                f"cancelled: the server is stopping and the request did not finish within {timeout_s:g} s"))
        if self._thread is not None:
            self._thread.join(timeout=60)
        return finished

    # -- requests ---------------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               sampling: Sampling | None = None, eos_token_id: int | Sequence[int] | str | None = FROM_FOLDER,
               name: str = "max_new_tokens", pick: Callable[[np.ndarray], np.ndarray] | None = None,
               follow: Stream | None = None) -> Stream:
        """Queue one prompt; checked here (``InputError``), refused at once when full
        (:class:`EngineBusy`) or not serving (:class:`EngineUnavailable`). ``pick``: the stream's
        own picker (``serving.engine.sampling.Chooser``), instead of ``sampling``'s. ``follow``: a
        stream of the same prompt submitted just before (OpenAI's ``n``): this one starts from a copy
        of its prompt KV and its last prompt logits instead of prefilling the prompt again."""
        check_max_new_tokens(max_new_tokens, name=name)
        if isinstance(prompt, (str, bytes)):
            raise InputError("the prompt must be token ids (a sequence of integers), not text")
        self.model.check_prompts([list(prompt)], max_new_tokens, name=name)
        row = [int(t) for t in prompt]
        if len(row) >= self.slot_length:
            raise InputError(f"the prompt has {len(row)} tokens; this server's streams hold {self.slot_length} "
                             f"tokens (--max-tokens-in-flight over --max-batch), so at most "
                             f"{self.slot_length - 1} prompt tokens")
        # a stream that would outgrow its slot ends there, with finish_reason "length" (as llama-server's do)
        max_new_tokens = min(max_new_tokens, self.slot_length - len(row))
        if eos_token_id == FROM_FOLDER:
            eos_token_id = self.model.special.get("eos_token_id")
        eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        with self._cond:
            if self._state != "ready":
                raise EngineUnavailable("the server is stopping; send the request to another replica"
                                        if self._state in ("draining", "stopped") else
                                        "the model is still warming up; retry when it reports ready")
            free = self.batch_free()
            if len(self._waiting) >= free + self.options.max_queue:
                self.counts["refused_busy"] += 1
                o = self.options
                raise EngineBusy(f"the server is busy: its {o.max_batch} streams and its queue of {o.max_queue} are "
                                 f"full (--max-batch {o.max_batch}, --max-queue {o.max_queue}); retry later")
        return self._enqueue(row, max_new_tokens, pick or token_picker(sampling), eos, plain_sampling(sampling, pick),
                             follow if follow is not None and follow.prompt == row else None)

    def batch_free(self) -> int:
        return self.options.max_batch - len(self._running)

    def _enqueue(self, prompt: list[int], max_new_tokens: int, pick: Callable, eos: frozenset[int],
                 sampling: Sampling | None = None, follow: Stream | None = None) -> Stream:
        stream = Stream(self, next(self._numbers), prompt, max_new_tokens, pick, eos)
        stream.sampling = sampling  # what speculation checks proposals with (None: it must not)
        stream.follows = follow
        with self._cond:
            self._waiting.append(stream)
            self._cond.notify_all()
        return stream

    def _cancel(self, stream: Stream) -> None:
        with self._cond:
            stream.cancel_requested = True
            if stream in self._waiting:
                self._waiting.remove(stream)
                self.counts["cancelled"] += 1
                stream._finish("cancelled", StreamCancelled("cancelled before it started"))
            self._cond.notify_all()

    # -- the engine thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting or self._running or self._state == "stopped")
                if self._state == "stopped":
                    return
                admitted = []
                while self._waiting and len(self._running) < self.options.max_batch:
                    stream = self._waiting.popleft()
                    self._running.add(stream)
                    admitted.append(stream)
                cancelled = [s for s in self._running if s.cancel_requested]
            for stream in admitted:
                try:
                    self.batch.admit(stream)
                except Exception as exc:  # noqa: BLE001 - a stream that cannot start fails alone
                    self._retire(stream, "error", StreamFailed(f"generation failed: {one_line(exc)}"))
            for stream in cancelled:
                self._retire(stream, "cancelled", StreamCancelled("cancelled"))
            self._iteration()

    def _iteration(self) -> None:
        try:
            for streams, token, failure in self.batch.iteration():
                if failure is not None:
                    error = failure if isinstance(failure, Exception) else StreamFailed(f"generation failed: {failure}")
                    for stream in streams:
                        self._retire(stream, "error", error)
                elif streams[0].cancel_requested or streams[0]._push(token):
                    self._retire(streams[0], streams[0].ending or "cancelled", StreamCancelled("cancelled"))
        except Exception as exc:  # noqa: BLE001 - the engine outlives any one iteration
            for stream in list(self._running):
                self._retire(stream, "error", StreamFailed(f"generation failed: {one_line(exc)}"))
        self.counts["steps"] += 1

    def _retire(self, stream: Stream, reason: str, error: BaseException | None) -> None:
        """Free the stream's slot, count it, then end it (whoever waits on it sees the counts)."""
        self.batch.release(stream)
        if self.speculation is not None:
            self.speculation.release(stream)
        with self._cond:
            if stream in self._running:  # (a drain that ran out of time counted it already)
                self._running.discard(stream)
                self.counts[stream.finish_reason or reason] += 1
            self._cond.notify_all()
        stream._finish(reason, None if reason in ("stop", "length") else error)
