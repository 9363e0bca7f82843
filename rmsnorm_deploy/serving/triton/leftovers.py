"""What an embedded Triton leaves on disk, named so that ``serve`` can find and remove it.

PyTriton 0.7 copies Triton (22 MB) into a workspace under ``~/.cache/pytriton/`` and removes it on
a clean stop. Triton writes each model it is handed into ``/tmp/folderXXXXXX`` (its config names
the workspace) and removes it on unload; when Triton or a model's stub dies, nothing unloads and
the folders stay, and so do PyTriton's shared-memory segments ``/dev/shm/pytrtion<pid>-*``. So
``serve`` gives its workspace a name that carries its process id (:func:`new_workspace`), and
:func:`remove_leftovers` removes, after any stop, this process's workspace, the Triton folders that
name it and its segments, and at start-up those of earlier ``serve`` processes that no longer run
(killed with SIGKILL, say). Nothing of another program is touched: only names of this form.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

#: ``<PYTRITON_HOME>/workspace_rmsnorm-deploy-<pid>-<random>``
WORKSPACE_PREFIX = "workspace_rmsnorm-deploy-"
_WORKSPACE = re.compile(rf"^{re.escape(WORKSPACE_PREFIX)}(\d+)-[0-9a-f]+$")
#: where Triton 2.51 writes a model handed over in a load request (``mkdtemp("/tmp/folderXXXXXX")``)
TRITON_TEMP = Path("/tmp")
_TRITON_FOLDER = re.compile(r"^folder[A-Za-z0-9]{6}$")
_WORKSPACE_PATH = re.compile(r'key:\s*"workspace-path"\s*value\s*\{\s*string_value:\s*"([^"]+)"')
SHARED_MEMORY = Path("/dev/shm")


def pytriton_home() -> Path:
    from pytriton.constants import PYTRITON_HOME

    return Path(PYTRITON_HOME)


def new_workspace() -> Path:
    """A path for this process's PyTriton workspace (PyTriton creates the folder and removes it on stop)."""
    return pytriton_home() / f"{WORKSPACE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _workspace_owner(path: Path) -> int | None:
    match = _WORKSPACE.match(path.name)
    return int(match[1]) if match else None


def remove_leftovers(own: Path | None = None) -> list[Path]:
    """Remove ``own`` (this process's workspace, stopped) and what it left, and the leftovers of
    ``serve`` processes that no longer run; the paths removed."""
    gone: set[Path] = set()
    home = pytriton_home()
    candidates = list(home.glob(f"{WORKSPACE_PREFIX}*")) if home.is_dir() else []
    stale = {p for p in candidates if (pid := _workspace_owner(p)) is not None and not _running(pid)}
    if own is not None:
        stale.add(own)
    owners = {_workspace_owner(p) for p in stale} - {None}
    removed: list[Path] = []
    for folder in _triton_folders():
        workspace = _named_workspace(folder)
        if workspace is not None and (workspace in stale or (_workspace_owner(workspace) in owners)):
            gone.add(folder)
    gone |= {p for p in stale if p.is_dir() and not p.is_symlink()}
    for pid in owners:
        gone |= set(SHARED_MEMORY.glob(f"pytrtion{pid}-*")) if SHARED_MEMORY.is_dir() else set()
    for path in sorted(gone):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        if not path.exists():
            removed.append(path)
    return removed


def _triton_folders() -> list[Path]:
    try:
        entries = list(os.scandir(TRITON_TEMP))
    except OSError:
        return []
    uid = os.getuid()
    return [Path(e.path) for e in entries if _TRITON_FOLDER.match(e.name) and e.is_dir(follow_symlinks=False)
            and e.stat(follow_symlinks=False).st_uid == uid]


def _named_workspace(folder: Path) -> Path | None:
    """The workspace a Triton model folder's ``config.pbtxt`` names (PyTriton's ``workspace-path``)."""
    try:
        with open(folder / "config.pbtxt", "rb") as handle:
            text = handle.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return None
    match = _WORKSPACE_PATH.search(text)
    return Path(match[1]) if match else None
