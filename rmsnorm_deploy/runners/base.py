"""The runner interface shared by every backend."""

from __future__ import annotations

import abc
from typing import Any

import numpy as np


class Runner(abc.ABC):
    """Runs a model: ``infer(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]``.

    bfloat16 arrays use ``ml_dtypes.bfloat16`` both ways.
    """

    #: A short name for tables and tolerance keys, e.g. ``onnxruntime``.
    backend: str = "runner"

    def __init__(self) -> None:
        self.is_active = False

    @property
    def name(self) -> str:
        """The backend plus what it actually runs on, e.g. ``onnxruntime[cpu]``."""
        return self.backend

    def activate(self) -> None:
        if not self.is_active:
            self._activate()
            self.is_active = True

    def deactivate(self) -> None:
        if self.is_active:
            self._deactivate()
            self.is_active = False

    def __enter__(self) -> "Runner":
        self.activate()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.deactivate()

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.is_active:
            raise RuntimeError(f"{self.name} runner used outside its `with` block; call activate() first")
        return self._infer(feed)

    @abc.abstractmethod
    def _activate(self) -> None: ...

    def _deactivate(self) -> None:  # noqa: B027 - optional hook
        pass

    @abc.abstractmethod
    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
