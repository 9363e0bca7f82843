"""Nothing of a stopped ``serve`` stays on disk, a crash included: its PyTriton workspace, the
``/tmp/folder*`` copies Triton makes of each model, PyTriton's shared-memory segments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rmsnorm_deploy.serving.triton import leftovers
from rmsnorm_deploy.serving.triton.process import start_serve_process


def _config(workspace: Path) -> str:
    """What Triton writes into a model's folder (its config.pbtxt names PyTriton's workspace)."""
    return (f'name: "model"\nparameters {{\n  key: "workspace-path"\n  value {{\n    string_value: "{workspace}"\n'
            "  }\n}\nbackend: \"python\"\n")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def places(tmp_path, monkeypatch):
    home, temp, shm = tmp_path / "home", tmp_path / "tmp", tmp_path / "shm"
    for folder in (home, temp, shm):
        folder.mkdir()
    monkeypatch.setattr(leftovers, "pytriton_home", lambda: home)
    monkeypatch.setattr(leftovers, "TRITON_TEMP", temp)
    monkeypatch.setattr(leftovers, "SHARED_MEMORY", shm)
    return home, temp, shm


def _server_files(home: Path, temp: Path, shm: Path, pid: int, tag: str) -> list[Path]:
    workspace = home / f"{leftovers.WORKSPACE_PREFIX}{pid}-{tag}"
    (workspace / "tritonserver").mkdir(parents=True)
    folder = temp / f"folder{tag[:6]}"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(_config(workspace))
    segment = shm / f"pytrtion{pid}-{tag}"
    segment.write_bytes(b"\0" * 16)
    return [workspace, folder, segment]


def test_leftovers_of_dead_serve_processes_go_and_nothing_else(places):
    home, temp, shm = places
    dead = _server_files(home, temp, shm, _dead_pid(), "aa11bb")
    live = _server_files(home, temp, shm, os.getpid(), "cc22dd")
    foreign = temp / "folderXy12Zw"  # another program's Triton
    foreign.mkdir()
    (foreign / "config.pbtxt").write_text(_config(home / "workspace_k3j2h1"))
    (home / "workspace_k3j2h1").mkdir()
    assert sorted(leftovers.remove_leftovers()) == sorted(dead)
    assert not any(p.exists() for p in dead)
    assert all(p.exists() for p in live) and foreign.exists() and (home / "workspace_k3j2h1").exists()
    # this process's own, once it stopped
    assert sorted(leftovers.remove_leftovers(own=live[0])) == sorted(live)
    assert foreign.exists()


def test_a_new_workspace_names_this_process(places):
    path = leftovers.new_workspace()
    assert path.parent == places[0] and path.name.startswith(f"{leftovers.WORKSPACE_PREFIX}{os.getpid()}-")
    assert not path.exists()  # PyTriton creates it


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(stat.parent.name))
                    todo.append(found[-1])
            except (OSError, ValueError):
                continue
    return found


def _named(workspace: Path) -> list[Path]:
    return [f for f in Path("/tmp").glob("folder*") if (f / "config.pbtxt").is_file()
            and str(workspace) in (f / "config.pbtxt").read_text(errors="replace")]


def test_a_crashed_triton_leaves_nothing_behind(tiny_export):
    pytest.importorskip("pytriton", reason="serve needs nvidia-pytriton")
    proc = start_serve_process(tiny_export, timeout_s=90)
    try:
        triton = next(pid for pid in _descendants(proc.process.pid)
                      if Path(f"/proc/{pid}/exe").resolve().name == "tritonserver")
        workspace = Path(f"/proc/{triton}/exe").resolve().parents[2]
        assert workspace.is_dir() and _named(workspace), "Triton made no model folder to check"
        os.kill(triton, signal.SIGKILL)  # a crash, as when a request took Triton 2.51 down
        assert proc.process.wait(timeout=60) == 1
    finally:
        proc.stop()
    log = "".join(proc.log)
    assert "exited on its own" in log, log
    assert not workspace.exists(), workspace
    assert _named(workspace) == []
    assert sorted(Path("/dev/shm").glob(f"pytrtion{proc.process.pid}-*")) == []
