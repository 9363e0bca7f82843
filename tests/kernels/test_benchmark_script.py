"""benchmarks/gpu_kernel.py must not die on its first GPU run: its CPU smoke mode runs here.

Benchmarks are not tests; this only runs the script's code paths (correctness checks,
timing loop, tables, result files) through Triton's interpreter on tiny shapes.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_kernel.py"

pytest.importorskip("triton", reason="the benchmark script runs the Triton kernel")


def _run(*args: str, env_update: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_update or {})
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_smoke_run_on_the_cpu_writes_every_result_file(tmp_path):
    done = _run("--interpret", "--no-compile", "--no-sweep", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "## Correctness" in done.stdout and "FAIL" not in done.stdout
    bench = [p for p in tmp_path.glob("gpu_kernel-*.csv") if not p.name.endswith("-correctness.csv")]
    assert len(bench) == 1
    rows = list(csv.DictReader(bench[0].open()))
    assert {r["impl"] for r in rows} == {"kernel", "eager", "copy"}
    assert all(r["gpu"] and r["torch"] and r["triton"] and r["cuda"] for r in rows)
    assert all(not r["error"] and float(r["gbps"]) > 0 for r in rows), [r["error"] for r in rows]
    assert len(list(tmp_path.glob("gpu_kernel-*-correctness.csv"))) == 1
    assert len(list(tmp_path.glob("gpu_kernel-*.md"))) == 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no PNG plot" in done.stdout
    else:
        assert len(list(tmp_path.glob("gpu_kernel-*.png"))) == 1


def test_without_a_gpu_it_refuses_and_says_how_to_smoke_test(tmp_path):
    done = _run("--out-dir", str(tmp_path), env_update={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "needs a CUDA GPU (torch sees none); --interpret runs a CPU smoke test" in done.stderr
    assert not list(tmp_path.iterdir())
