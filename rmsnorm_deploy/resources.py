"""Leaf facts any package may ask for: the package's version, installed packages' versions, and
the memory budget that sizes read from untrusted input (metadata, configs, declared dims) are
checked against before anything is allocated."""

from __future__ import annotations

import importlib.metadata
import os

from rmsnorm_deploy.errors import UserError

__version__ = "0.1.0"
NOT_INSTALLED = "not installed"


def package_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


# -- the memory budget: sizes from untrusted input are checked before anything is allocated -------
#: The share of the available memory one allocation plan may take.
MEMORY_MARGIN = 0.8


def available_memory() -> int | None:
    """Bytes of memory available now (Linux ``MemAvailable``, else ``os.sysconf`` free pages), or ``None``."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def memory_budget() -> int | None:
    """Bytes one command may plan to allocate: :data:`MEMORY_MARGIN` of :func:`available_memory`."""
    available = available_memory()
    return None if available is None else int(available * MEMORY_MARGIN)


def check_memory(nbytes: float, what: str, fix: str) -> None:
    """Refuse, in one line naming the size and the budget, to allocate ``nbytes`` for ``what``
    when it exceeds :func:`memory_budget`."""
    budget = memory_budget()
    if budget is not None and nbytes > budget:
        raise UserError(f"{what} needs about {_gib(nbytes)} of memory but this machine has a budget of "
                        f"{_gib(budget)} ({MEMORY_MARGIN:.0%} of the available {_gib(budget / MEMORY_MARGIN)}); {fix}")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"
