"""Every benchmark script still starts: its imports (the package's API, the helpers it borrows from
another script) resolve and its ``--help`` parses. Benchmarks are not run by the suite; this only
keeps one from rotting silently when the code it calls moves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: the scripts a user runs here (the GPU machine's gpu_check.py and gpu_kernel.py: tests/kernels)
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("bench_*.py")) + ["real_checkpoints.py", "speculative.py",
                                                                  "perplexity_folders.py"]


def test_every_benchmark_script_starts():
    """One interpreter imports each script as ``__main__`` would (from ``benchmarks/``) and asks for
    its help: a script that cannot import what it uses fails here, by name."""
    probe = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "failed = []\n"
        f"for name in {SCRIPTS!r}:\n"
        "    sys.argv = [name, '--help']\n"
        "    try:\n"
        f"        runpy.run_path({str(BENCHMARKS)!r} + '/' + name, run_name='__main__')\n"
        "    except SystemExit as exc:\n"
        "        if exc.code not in (0, None):\n"
        "            failed.append(f'{name}: exit {exc.code}')\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('FAILED', failed)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            cwd=BENCHMARKS.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "FAILED []" in result.stdout, result.stdout[-2000:]
    assert len(SCRIPTS) >= 10  # the scripts were found
