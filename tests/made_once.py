"""Folders the tests make once per run and share between the pytest-xdist workers.

A session fixture runs once per worker: a model exported by a session fixture was exported by
each worker, seconds of the suite each time. :func:`made_once` makes a named folder once, in the
run's shared temporary folder, under a file lock: the first worker to ask makes it, the others wait
and reuse it. Tests read these folders and never write into them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from rmsnorm_deploy.exporter.gguf import file_lock


def shared_root(tmp_path_factory) -> Path:
    """The temporary folder every worker of this run sees (each worker's own is a folder in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``name``, made by ``make(folder)`` once per run for every worker. A ``make`` that
    raised leaves no folder for the next one to trust: it is made again from nothing."""
    root = shared_root(tmp_path_factory) / "made-once"
    root.mkdir(parents=True, exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with file_lock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            done.touch()
    return folder
