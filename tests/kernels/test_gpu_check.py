"""benchmarks/gpu_check.py (``make gpu-check``) must work on its first GPU run: its CPU-side
pieces run here. The dry run goes through Triton's interpreter and torch on the CPU; the
bandwidth step's own smoke test is test_benchmark_script.py, so here its command is checked."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"

pytest.importorskip("triton", reason="the GPU check runs the Triton kernel")
pytest.importorskip("onnxruntime", reason="the GPU check's model step runs ONNX Runtime CPU")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


@pytest.mark.slow
def test_dry_run_runs_the_kernel_tests_and_writes_the_summary(monkeypatch, tmp_path):
    """~15-30 s: one pytest subprocess (a few interpreted kernel tests); the one run of a real step
    through main(), its JUnit counts, the summary and the copy into benchmarks/results."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out, copied = tmp_path / "out", tmp_path / "results"
    code = gpu_check.main(["--dry-run", "--steps", "kernel-tests", "--out-dir", str(out), "--copy-to", str(copied)])
    summary = json.loads((out / "gpu_check.json").read_text())
    assert code == 0, (out / "kernel-tests.log").read_text()[-3000:]
    assert summary["passed"] and summary["dry_run"]
    (step,) = summary["steps"]
    assert step["step"] == "kernel-tests" and step["status"] == "pass"
    assert step["tests"] > 0 and step["failures"] == 0 and step["errors"] == 0
    assert (out / "kernel-tests.xml").exists() and "TRITON_INTERPRET=1, a subset" in step["detail"]
    assert "| kernel-tests | pass |" in (out / "gpu_check.md").read_text()
    names = sorted(p.name for p in copied.iterdir())
    assert len(names) == 2 and all(re.fullmatch(r"gpu_check-cpu-dry-run-.*\.(json|md)", n) for n in names), names


def test_the_model_step_compares_torch_with_onnxruntime_cpu(tmp_path):
    args = gpu_check.parse_args(["--dry-run", "--out-dir", str(tmp_path)])
    result = gpu_check.model_check(args, 100.0)
    assert result["status"] == "pass", result["detail"]
    rows = result["rows"]
    assert [r["dtype"] for r in rows] == ["float32", "float16"] and all(r["passed"] and r["outputs"] for r in rows)
    assert all(r["torch_device"] == "cpu" and r["onnxruntime_nodes"].endswith("on cpu") for r in rows)
    assert "tolerance atol=0.02 rtol=0.02" in rows[1]["detail"]  # the table's "model" row for float16


def test_a_model_without_our_metadata_fails_the_model_step(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "third-party.onnx"
    onnx.save(helper.make_model(graph), path)
    args = gpu_check.parse_args(["--dry-run", "--out-dir", str(tmp_path), "--model", str(path)])
    with pytest.raises(ValueError, match="has no rmsnorm_deploy metadata"):
        gpu_check.model_check(args, 100.0)


def test_without_a_gpu_it_refuses_and_says_how_to_smoke_test(monkeypatch, tmp_path, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "gpu_check needs a CUDA GPU" in err and "--dry-run runs a CPU smoke test" in err
    assert not (tmp_path / "out").exists()


def test_results_go_under_OUT_when_it_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.parse_args([]).out_dir == tmp_path / "gpu-check"
    monkeypatch.delenv("OUT")
    args = gpu_check.parse_args([])
    assert args.out_dir == REPO / "benchmarks" / "results" / "gpu" and args.model == "tiny"
    assert gpu_check.parse_args(["--dry-run"]).model == "standalone"


def test_bad_steps_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(["--steps", "kernel-tests,speed"])
    assert exit_info.value.code == 2 and "unknown step(s) ['speed']" in capsys.readouterr().err


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_bandwidth_step_runs_gpu_kernel_py_and_keeps_its_files(monkeypatch, tmp_path, dry_run):
    calls = []

    def fake_run(cmd, log, limit, dry):
        calls.append((cmd, dry))
        out = Path(cmd[cmd.index("--out-dir") + 1])
        (out / "gpu_kernel-h200-x.csv").write_text("impl,gbps\nkernel,1\n")
        (out / "gpu_kernel-h200-x.png").write_bytes(b"png")
        return 0, "bf16 16384x4096 kernel/copy 0.93 PASS"

    monkeypatch.setattr(gpu_check, "_run", fake_run)
    args = gpu_check.parse_args(["--out-dir", str(tmp_path)] + (["--dry-run"] if dry_run else []))
    result = gpu_check.bandwidth(args, 100.0)
    ((cmd, dry),) = calls
    assert cmd[1].endswith("benchmarks/gpu_kernel.py") and "--no-sweep" in cmd and dry is dry_run
    assert ("--interpret" in cmd) is dry_run and ("--no-compile" in cmd) is dry_run
    assert result["status"] == "pass" and result["files"] == ["gpu_kernel-h200-x.csv", "gpu_kernel-h200-x.png"]
    assert result["summary"] == ["bf16 16384x4096 kernel/copy 0.93 PASS"]


def test_zero_kernel_tests_is_not_a_pass(monkeypatch, tmp_path):
    def fake_run(cmd, log, limit, dry):
        junit = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
        Path(junit).write_text('<testsuites><testsuite tests="0" failures="0" errors="0" skipped="0"/></testsuites>')
        return 5, "no tests ran"

    monkeypatch.setattr(gpu_check, "_run", fake_run)
    result = gpu_check.kernel_tests(gpu_check.parse_args(["--out-dir", str(tmp_path)]), 100.0)
    assert result["status"] == "FAIL" and "0 ran" in result["detail"]


def test_a_failing_kernel_test_fails_the_step(monkeypatch, tmp_path):
    def fake_run(cmd, log, limit, dry):
        junit = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
        Path(junit).write_text('<testsuites><testsuite tests="9" failures="1" errors="0" skipped="2"/></testsuites>')
        return 1, "FAILED tests/kernels/test_kernel.py::test_kernel_matches_oracle[llama-199x4096-bfloat16]"

    monkeypatch.setattr(gpu_check, "_run", fake_run)
    args = gpu_check.parse_args(["--out-dir", str(tmp_path)])
    result = gpu_check.kernel_tests(args, 100.0)
    assert result["status"] == "FAIL" and "7 ran, 1 failed, 2 skipped (compiled on the GPU)" in result["detail"]
    assert "llama-199x4096-bfloat16" in result["detail"]


@pytest.mark.slow
def test_the_kernel_tests_need_neither_hypothesis_nor_xdist_nor_transformers():
    """The device image may lack them: collection must work with each import refused. A fresh
    interpreter is the only way to refuse imports this process has made (~5 s of torch import)."""
    code = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('hypothesis', 'xdist', 'transformers'):\n"
        "            raise ImportError(f'{name} is refused here')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', 'tests/kernels/test_kernel.py']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # no hypothesis/xdist plugins either
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"\b\d+ tests collected", done.stdout)


def test_make_gpu_check_uses_the_machines_python_without_a_venv():
    text = (REPO / "Makefile").read_text()
    target = re.search(r"^gpu-check:(.*)\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert target, "Makefile has no gpu-check target"
    prerequisites, recipe = target.group(1), target.group(2)
    assert "STAMP" not in prerequisites and "venv" not in recipe.lower()
    # the checkout first, then what the caller's PYTHONPATH holds (the GPU bundle's env.sh puts onnxruntime-gpu there)
    assert "PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) benchmarks/gpu_check.py" in recipe
