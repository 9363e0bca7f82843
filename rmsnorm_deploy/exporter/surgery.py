"""Module surgery for the exporter: swap submodules for a while, keep torch.onnx quiet, free weights.

Shared by the pipeline (norms swapped for the custom op) and the float64 run (norms swapped
for their oracle), so neither imports the other.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def swapped_modules(model: torch.nn.Module, replacements: dict[str, torch.nn.Module]) -> Iterator[None]:
    """Replace submodules by path for the duration of the block; always put the originals back."""
    originals: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    try:
        for path, new in replacements.items():
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            originals.append((parent, attr, getattr(parent, attr)))
            setattr(parent, attr, new)
        yield
    finally:
        for parent, attr, old in reversed(originals):
            setattr(parent, attr, old)


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """Keep torch.onnx's chatter (stdout prints, warnings, log lines) off the user's terminal:
    stdout is the result table's. A failure still surfaces, as :class:`ExportError`."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch._export", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def release_weights(loaded: Any, detection: Any) -> None:
    """Free the module's weights. Each parameter and buffer is emptied in place rather than only
    dereferenced, because libraries keep references: onnxscript's rewrite rules hold on to the
    last graph they matched, whose stale values hold the module's parameters. The norms' gains
    (a vector each) are kept, copied: the parity's static contract compares the graph's with them."""
    import gc

    gains = {id(n): None if n.weight is None else n.weight.detach().clone() for n in detection.norms}
    with torch.no_grad():
        for t in list(loaded.module.parameters()) + list(loaded.module.buffers()):
            t.data = torch.empty(0, dtype=t.dtype)
    loaded.module = None  # type: ignore[assignment]
    for norm in detection.norms:
        norm.module = None  # type: ignore[assignment]
        norm.weight = gains[id(norm)]
    gc.collect()
