"""Progress of long commands on stderr: one line per stage with its time, or a bar of steps.

On a terminal the running stage shows a ticking clock (a large export spends minutes in
``torch.onnx.export``); in a log file each stage is one line when it starts and one when it
ends, so stdout stays clean for the result table.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import IO, Iterator

from rmsnorm_deploy.errors import check_interrupted


class Stage:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.notes: list[str] = []
        self.status = ""

    def note(self, text: str) -> None:
        """Something worth showing when the stage ends (e.g. "5 norms")."""
        self.notes.append(text)

    def show(self, text: str) -> None:
        """How far the running stage is (e.g. "chunk 3/29"): beside its clock on a terminal, where the
        next tick shows it; a log file gets no line per step."""
        self.status = text


class Progress:
    def __init__(self, *, prefix: str = "", stream: IO[str] | None = None, enabled: bool = True,
                 tick_seconds: float = 1.0):
        self.prefix = prefix
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tick_seconds = tick_seconds
        self.count = 0

    def _live(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    @contextlib.contextmanager
    def stage(self, text: str) -> Iterator[Stage]:
        self.count += 1
        head = f"{self.prefix}[{self.count}] {text}"
        stage = Stage()
        start = time.perf_counter()
        stop = threading.Event()
        ticker = None
        if self.enabled:
            if self._live():
                self._write(f"{head} ...")

                def tick() -> None:
                    while not stop.wait(self.tick_seconds):
                        status = f"{stage.status} " if stage.status else ""
                        self._write(f"\r{head} ... {status}{time.perf_counter() - start:.0f}s")

                ticker = threading.Thread(target=tick, daemon=True)
                ticker.start()
            else:
                self._write(f"{head} ...\n")
        ok = abandoned = False
        try:
            yield stage
            check_interrupted()  # a Ctrl-C or SIGTERM swallowed inside the stage stops the command here
            ok = True
        except GeneratorExit:
            # never resumed by the with statement: a signal landed in its exit before it got here, and the
            # generator is being collected, perhaps after the command has printed its last line; say nothing
            abandoned = True
            raise
        finally:
            stage.seconds = time.perf_counter() - start
            stop.set()
            if ticker is not None:
                ticker.join()
            if self.enabled and not abandoned:
                status = "done" if ok else "failed"
                extra = f" ({'; '.join(stage.notes)})" if stage.notes else ""
                # on a terminal: the ticking line replaced, what it showed beyond the end erased
                end = f"\r{head} ... {status} in {stage.seconds:.1f}s{extra}\x1b[K\n" if self._live() else \
                    f"{head}: {status} in {stage.seconds:.1f}s{extra}\n"
                self._write(end)


class ProgressBar:
    """A bar of ``done / total`` steps on stderr: redrawn in place on a terminal (at most every
    ``redraw_seconds``), in a log file one line per tenth of the steps and one at the end. Shown only
    when ``enabled`` (a command decides: a terminal, or asked for); stdout is never touched."""

    WIDTH = 30

    def __init__(self, label: str, *, stream: IO[str] | None = None, enabled: bool = True,
                 redraw_seconds: float = 0.2):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.redraw_seconds = redraw_seconds
        self.start = time.perf_counter()
        self._last = float("-inf")
        self._tenth = -1
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty())

    def line(self, done: int, total: int) -> str:
        """``label [#####.....] done/total (pct), elapsed, ETA``."""
        elapsed = time.perf_counter() - self.start
        filled = self.WIDTH * done // max(total, 1)
        eta = f", ETA {elapsed / done * (total - done):.0f}s" if 0 < done < total else ""
        return (f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{total} "
                f"({100 * done // max(total, 1)}%), {elapsed:.0f}s{eta}")

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.live:
            now = time.perf_counter()
            if done < total and now - self._last < self.redraw_seconds:
                return
            self._last = now
            self.stream.write(f"\r{self.line(done, total)}\x1b[K" + ("\n" if done >= total else ""))
        else:
            tenth = 10 * done // max(total, 1)
            if tenth == self._tenth:
                return
            self._tenth = tenth
            self.stream.write(self.line(done, total) + "\n")
        self.stream.flush()
