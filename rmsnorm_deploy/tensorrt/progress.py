"""A progress bar for engine builds, fed by TensorRT's ``IProgressMonitor``.

TensorRT reports nested phases (``phase_start(name, parent, steps)``, ``step_complete``,
``phase_finish``). :class:`BuildProgress` keeps the stack of open phases and draws one line:
the bar of the outermost phase and the path of the innermost, e.g.
``[######----] 60% Building engine > Tactic selection 12/40``. On a terminal the line is
redrawn in place (at most every 0.1 s); elsewhere (CI logs) each top-level phase is printed
once when it starts. Ctrl-C cancels the build: ``step_complete`` returns ``False``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class BuildProgress:
    """Phase bookkeeping and drawing, independent of TensorRT (the adapter below forwards to it)."""

    WIDTH = 20

    def __init__(self, stream: TextIO | None = None, *, interactive: bool | None = None, min_interval: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.min_interval = min_interval
        self.phases: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.cancelled = False
        self._last_draw = 0.0
        self._drawn = False

    def phase_start(self, name: str, parent: str | None, steps: int) -> None:
        self.phases[name] = {"parent": parent, "steps": max(int(steps), 0), "done": 0}
        self.order.append(name)
        if not self.interactive and parent is None:
            print(f"building: {name}", file=self.stream, flush=True)
        self._draw()

    def step_complete(self, name: str, step: int) -> bool:
        if name in self.phases:
            self.phases[name]["done"] = int(step)
        self._draw()
        return not self.cancelled

    def phase_finish(self, name: str) -> None:
        self.phases.pop(name, None)
        if name in self.order:
            self.order.remove(name)
        self._draw(force=not self.phases)

    def line(self) -> str:
        """The current progress line (empty when no phase is open)."""
        if not self.order:
            return ""
        top = self.order[0]
        done, steps = self.phases[top]["done"], self.phases[top]["steps"]
        fraction = min(done / steps, 1.0) if steps else 0.0
        filled = int(round(fraction * self.WIDTH))
        inner = self.order[-1]
        path = " > ".join(self.order)
        inner_steps = self.phases[inner]["steps"]
        counter = f" {self.phases[inner]['done']}/{inner_steps}" if inner_steps else ""
        return f"[{'#' * filled}{'-' * (self.WIDTH - filled)}] {fraction:4.0%} {path}{counter}"

    def close(self) -> None:
        if self.interactive and self._drawn:
            print(file=self.stream, flush=True)
            self._drawn = False

    def _draw(self, *, force: bool = False) -> None:
        if not self.interactive:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval:
            return
        self._last_draw = now
        text = self.line()
        self.stream.write("\r\x1b[2K" + text[:200])
        self.stream.flush()
        self._drawn = bool(text)


def progress_monitor(trt: Any, progress: BuildProgress) -> Any:
    """A ``trt.IProgressMonitor`` that forwards to ``progress`` (TensorRT 10.0+ Python API)."""

    class _Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                progress.phase_start(phase_name, parent_phase, num_steps)
            except KeyboardInterrupt:
                progress.cancelled = True  # phase_start cannot cancel; the next step_complete does

        def step_complete(self, phase_name, step):
            try:
                return progress.step_complete(phase_name, step)
            except KeyboardInterrupt:
                progress.cancelled = True
                return False

        def phase_finish(self, phase_name):
            try:
                progress.phase_finish(phase_name)
            except KeyboardInterrupt:
                progress.cancelled = True

    return _Monitor()
