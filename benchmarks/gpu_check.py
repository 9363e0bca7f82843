"""One GPU check (``make gpu-check``): ONNX Runtime on CUDA (every lowering, real SmolLM2's KV-cache
decoding, ``serve``'s OpenAI API, the TensorRT-RTX provider), then the kernel compiled on the GPU, its
bandwidth, and an exported model run by torch on CUDA against ONNX Runtime on the CPU.

Made for a machine with a CUDA GPU, torch, Triton, onnx, onnxscript and the CPU onnxruntime, on
which nothing can be installed: it runs from the repository root with ``PYTHONPATH=.`` (no
``pip install -e .``, no virtual environment). The ONNX Runtime steps need the wheels
``benchmarks/gpu_bundle.py`` carries there (onnxruntime-gpu, serve's, SmolLM2; its env.sh puts them
first on ``PYTHONPATH``); without them they report "not run" and why. pytest-xdist only speeds up the
kernel tests where it is present. Under 8 minutes on an H200 (``--budget`` shares the time)::

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--out-dir DIR] [--sweep] [--model PATH|tiny] [--steps ...]

The ONNX Runtime steps (``ort-cuda``, ``lowerings``, ``smollm2``, ``serve``, ``trt-rtx``) are described in
``benchmarks/gpu_check_ort.py``. Then:

1. ``kernel-tests``: ``tests/kernels/test_kernel.py`` with ``TRITON_INTERPRET`` unset, so every
   spec x float32/float16/bfloat16 x the odd shapes runs the compiled kernel on CUDA tensors
   against the float64 oracle (its own tolerance table); and ``tests/tensorrt/test_aot_launch.py``:
   the TensorRT plugin's AOT kernel (PTX) loaded and launched by the CUDA driver with TensorRT's
   argument layout, against the JIT kernel and the oracle (needs cuda-bindings); JUnit XML kept.
2. ``bandwidth``: ``benchmarks/gpu_kernel.py``: the kernel against torch eager, ``torch.compile``
   and a device-to-device copy (CSV, Markdown and PNG), after its own correctness pass.
3. ``model``: the ``tiny`` preset exported here (float32 and float16; or ``--model PATH``), its
   PyTorch source rebuilt from the model's metadata run by torch on CUDA, the ONNX model by ONNX
   Runtime on the CPU, every floating output compared under the tolerance table's ``model`` row.

Results go to ``--out-dir`` (default ``$OUT/gpu-check`` when ``OUT`` is set, else
``benchmarks/results/gpu``): ``gpu_check.json`` and ``gpu_check.md`` (the summary), the JUnit
XML, each step's log, the bandwidth files; the summary and the bandwidth CSV/PNG are also copied
into ``--copy-to`` (default ``benchmarks/results``) under names carrying the GPU and the time.

``--dry-run`` runs the same code on the CPU (Triton's interpreter, a subset of the kernel tests,
tiny bandwidth shapes, a standalone norm model, torch on the CPU; the ONNX Runtime steps rehearsed on
the CPU provider and reported "not run: no GPU"): a smoke test of this script, its numbers
meaningless. Each step reports pass, FAIL or not run (with the reason). Exit codes: 0 every step
passed, 1 a step failed, 2 no GPU (or bad arguments), 3 none failed but some did not run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python benchmarks/gpu_check.py` from a checkout
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_check_ort beside it, also when loaded by path

import gpu_check_ort  # noqa: E402 - beside this script (benchmarks/ is on sys.path when it runs)

STEPS = (*gpu_check_ort.STEPS, "kernel-tests", "bandwidth", "model")
#: each step's share of the budget, in order; a step also gets what earlier steps left unused (on an H200:
#: kernel tests 26 s, bandwidth 38 s, model 37 s; a SmolLM2 export ~40 s)
SHARES = {"ort-cuda": 0.04, "lowerings": 0.10, "smollm2": 0.26, "serve": 0.14, "trt-rtx": 0.06,
          "kernel-tests": 0.12, "bandwidth": 0.18, "model": 0.10}
DEFAULT_BUDGET_S = 450
MODEL_DTYPES = ("float32", "float16")
#: the compiled kernel against the oracle, and the TensorRT plugin's AOT kernel launched by the CUDA driver
KERNEL_TESTS = ("tests/kernels/test_kernel.py", "tests/tensorrt/test_aot_launch.py")
#: the kernel tests a dry run keeps (the interpreter takes ~0.1 ms of Python per op per program)
DRY_RUN_TESTS = "test_kernel_matches_oracle and llama and 1x7"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where results go (default $OUT/gpu-check when OUT is set, else benchmarks/results/gpu)")
    p.add_argument("--copy-to", type=Path, default=REPO / "benchmarks" / "results",
                   help="also copy the summary and the bandwidth CSV/PNG here (default benchmarks/results)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all steps (default 450)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {', '.join(STEPS)}")
    p.add_argument("--sweep", action="store_true", help="bandwidth: also sweep the kernel's launch configurations")
    p.add_argument("--model", default=None,
                   help="model step: an .onnx file exported by rmsnorm-deploy, or 'tiny' to export the tiny preset "
                        "here (default; 'standalone' with --dry-run)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke test of this script: Triton's interpreter, few tests, tiny shapes, no GPU")
    args = p.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        p.error(f"unknown step(s) {unknown or [args.steps]}; choose from {', '.join(STEPS)}")
    args.steps = steps
    if args.budget <= 0:
        p.error("--budget must be positive")
    if args.out_dir is None:
        out = os.environ.get("OUT")
        args.out_dir = Path(out) / "gpu-check" if out else REPO / "benchmarks" / "results" / "gpu"
    if args.model is None:
        args.model = "standalone" if args.dry_run else "tiny"
    args.run, args.subprocess_env = _run, _subprocess_env  # for the ONNX Runtime steps
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu_check needs a CUDA GPU and torch {torch.__version__} sees none "
              f"(CUDA build: {torch.version.cuda or 'no'}); --dry-run runs a CPU smoke test", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(args.dry_run)
    print(f"gpu_check on {env['gpu']}: torch {env['torch']}, triton {env['triton']}, onnxruntime "
          f"{env['onnxruntime']}; results in {args.out_dir}", flush=True)
    deadline = time.monotonic() + args.budget
    results = []
    for i, step in enumerate(args.steps):
        left = deadline - time.monotonic()
        later = sum(SHARES[s] for s in args.steps[i:])
        limit = max(left * SHARES[step] / later, 1.0)
        start = time.monotonic()
        try:
            result = RUNNERS[step](args, limit)
        except Exception as exc:  # noqa: BLE001 - a step that breaks is reported as failed, the others still run
            (args.out_dir / f"{step}.log").write_text(traceback.format_exc())
            result = {"status": "FAIL", "detail": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}
        result = {"step": step, **result, "seconds": round(time.monotonic() - start, 1), "limit_s": round(limit)}
        results.append(result)
        print(f"[{result['status']}] {step} ({result['seconds']} s): {result['detail']}", flush=True)
    summary = {"environment": env, "dry_run": args.dry_run, "steps": results,
               "passed": all(r["status"] == "pass" for r in results), "counts": status_counts(results)}
    write_summary(args, summary)
    return exit_code(results)


def status_counts(results: list[dict[str, Any]]) -> dict[str, int]:
    return {s: sum(r["status"] == s for r in results) for s in ("pass", "FAIL", gpu_check_ort.NOT_RUN)}


def exit_code(results: list[dict[str, Any]]) -> int:
    """1 when a step failed, 3 when none failed but one did not run (nothing verified there), else 0."""
    counts = status_counts(results)
    return 1 if counts["FAIL"] or not results else 3 if counts[gpu_check_ort.NOT_RUN] else 0


# -- environment --------------------------------------------------------------------------------
def environment(dry_run: bool) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "time": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": _version("triton"),
        "onnx": _version("onnx"),
        "onnxscript": _version("onnxscript"),
        "onnxruntime": _version("onnxruntime"),
        "onnxruntime.file": _module_folder("onnxruntime"),
        "gpu bundle": os.environ.get(gpu_check_ort.BUNDLE_ENV, "not sourced"),
        "pytest-xdist": _version("xdist"),
        "hypothesis": _version("hypothesis"),
    }
    if dry_run or not torch.cuda.is_available():
        env.update(gpu=f"CPU dry run ({platform.machine()})", capability="-")
    else:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}")
    return env


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "absent"
    try:
        return str(getattr(__import__(module), "__version__", "present"))
    except Exception as exc:  # noqa: BLE001 - a module that is there but does not import
        return f"broken ({type(exc).__name__})"


def _module_folder(module: str) -> str:
    spec = importlib.util.find_spec(module)
    return str(Path(spec.origin).parent) if spec and spec.origin else "absent"


def _subprocess_env(dry_run: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run(cmd: list[str], log: Path, limit: float, dry_run: bool) -> tuple[int | None, str]:
    """Run ``cmd`` from the repository root into ``log``; ``(None, tail)`` when it ran past ``limit``."""
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            done = subprocess.run(cmd, check=False, cwd=REPO, env=_subprocess_env(dry_run), stdout=f,
                                  stderr=subprocess.STDOUT, timeout=limit)
            code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            code = None
    text = log.read_text(errors="replace")
    return code, text[-3000:]


# -- 1. the kernel tests, compiled ----------------------------------------------------------------
def kernel_tests(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    junit = args.out_dir / "kernel-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS,
           f"--junitxml={junit}", "-o", "junit_family=xunit2"]
    if args.dry_run:
        cmd += ["-k", DRY_RUN_TESTS]
    elif importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    code, tail = _run(cmd, args.out_dir / "kernel-tests.log", limit, args.dry_run)
    counts = junit_counts(junit)
    ran = counts["tests"] - counts["skipped"]
    detail = (f"{ran} ran, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped "
              f"({'TRITON_INTERPRET=1, a subset' if args.dry_run else 'compiled on the GPU'})")
    if code is None:
        return {"status": "FAIL", "detail": f"ran past its {limit:.0f} s; {detail}", **counts}
    if code != 0 or counts["failures"] or counts["errors"]:
        return {"status": "FAIL", "detail": f"pytest exited {code}; {detail}; {_last_line(tail)}", **counts}
    if ran == 0:
        return {"status": "FAIL", "detail": f"no test ran: {detail}", **counts}
    return {"status": "pass", "detail": detail, **counts}


def junit_counts(path: Path) -> dict[str, int]:
    """tests/failures/errors/skipped summed over a JUnit XML's test suites (zeros if there is none)."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if not path.exists():
        return counts
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


# -- 2. bandwidth ------------------------------------------------------------------------------
def bandwidth(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    out = args.out_dir / "bandwidth"
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_kernel.py"), "--out-dir", str(out)]
    if not args.sweep:
        cmd.append("--no-sweep")
    if args.dry_run:
        cmd += ["--interpret", "--no-compile"]
    code, tail = _run(cmd, args.out_dir / "bandwidth.log", limit, args.dry_run)
    files = sorted(p.name for p in out.iterdir())
    csvs = [f for f in files if f.endswith(".csv") and not f.endswith("-correctness.csv")]
    if code is None:
        return {"status": "FAIL", "detail": f"ran past its {limit:.0f} s", "files": files}
    if code != 0 or not csvs:
        return {"status": "FAIL", "detail": f"gpu_kernel.py exited {code}; {_last_line(tail)}", "files": files}
    return {"status": "pass", "detail": f"wrote {', '.join(files)}", "files": files,
            "summary": _bandwidth_summary(tail)}


def _bandwidth_summary(text: str) -> list[str]:
    """The lines of gpu_kernel.py's output that state a target (PASS/MISS) or a ratio."""
    return [line.strip() for line in text.splitlines() if re.search(r"\b(PASS|MISS)\b", line)][-16:]


# -- 3. an exported model: torch on CUDA against ONNX Runtime on the CPU -------------------------------
def model_check(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    paths = _models(args, deadline)
    device = "cpu" if args.dry_run else "cuda"
    rows, failed = [], []
    for dtype, path in paths:
        row = compare_model(path, device)
        row["dtype"] = dtype
        rows.append(row)
        if not row["passed"]:
            failed.append(f"{dtype}: {row['detail']}")
    compared = sum(r["outputs"] for r in rows)
    detail = "; ".join(f"{r['dtype']} {r['model']}: {r['detail']}" for r in rows)
    if failed:
        return {"status": "FAIL", "detail": detail, "rows": rows}
    if compared == 0:
        return {"status": "FAIL", "detail": f"no output was compared: {detail}", "rows": rows}
    return {"status": "pass", "detail": detail, "rows": rows}


def _models(args: argparse.Namespace, deadline: float) -> list[tuple[str, Path]]:
    """(dtype, model path) pairs: ``--model PATH``, the tiny preset exported here, or a standalone norm."""
    if args.model not in ("tiny", "standalone"):
        path = Path(args.model)
        if not path.is_file():
            raise FileNotFoundError(f"--model {path} does not exist")
        return [("as exported", path)]
    folder = args.out_dir / "models"
    folder.mkdir(exist_ok=True)
    found = []
    for dtype in MODEL_DTYPES:
        path = folder / f"{args.model}-{dtype}" / "model.onnx"
        if args.model == "standalone":
            from rmsnorm_deploy.contract.spec import named_specs
            from rmsnorm_deploy.graph.onnx_file import save_onnx
            from rmsnorm_deploy.graph.standalone import rmsnorm_model

            path.parent.mkdir(exist_ok=True)
            save_onnx(rmsnorm_model(named_specs()["llama"], dtype=dtype, shape=(199, 760)), path)
        else:
            cmd = [sys.executable, "-m", "rmsnorm_deploy", "export", "tiny", "--dtype", dtype, "-o", str(path.parent),
                   "--force"]
            code, tail = _run(cmd, args.out_dir / f"export-tiny-{dtype}.log", max(deadline - time.monotonic(), 1.0),
                              args.dry_run)
            if code != 0:
                raise RuntimeError(f"exporting tiny ({dtype}) " + ("ran out of time" if code is None else
                                                                    f"exited {code}: {_last_line(tail)}"))
        found.append((dtype, path))
    return found


def compare_model(path: Path, device: str) -> dict[str, Any]:
    """The model's torch source (rebuilt from its metadata) on ``device`` against ONNX Runtime CPU."""
    from rmsnorm_deploy.contract.compare import compare
    from rmsnorm_deploy.contract.tolerances import tolerance_for
    from rmsnorm_deploy.exporter.rebuild import rebuild_source
    from rmsnorm_deploy.graph.metadata import ModelMetadata
    from rmsnorm_deploy.graph.onnx_file import load_onnx
    from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner
    from rmsnorm_deploy.runners.torch import TorchRunner
    from rmsnorm_deploy.validate.feeds import generate_feed

    model = load_onnx(path)
    meta = ModelMetadata.read(model)
    if meta is None:
        raise ValueError(f"{path} has no rmsnorm_deploy metadata: its PyTorch source cannot be rebuilt")
    feed, _, _ = generate_feed(model, meta, kind="normal", seed=0, dims=None)
    with OnnxRuntimeRunner(path, ["cpu"]) as ort_runner:
        ort_out = ort_runner.infer(feed)
        placement = ort_runner.node_assignment.describe() if ort_runner.node_assignment else "not reported"
    with TorchRunner(rebuild_source(meta), device=device) as torch_runner:
        torch_out = torch_runner.infer(feed)
    parts, passed, outputs = [], True, 0
    for name, got in ort_out.items():
        if name not in torch_out or not _is_floating(got):
            continue
        result = compare(got, torch_out[name], tolerance_for("model", "onnxruntime", meta.dtype), name=name)
        outputs += 1
        passed = passed and bool(result)
        parts.append(f"{name} max abs {result.max_abs:.3g} ({'pass' if result else 'FAIL'}, tolerance "
                     f"{result.tolerance.describe()})")
    return {"model": path.parent.name, "source": meta.source.get("kind", "?"), "torch_device": device,
            "onnxruntime_nodes": placement, "outputs": outputs, "passed": passed and outputs > 0,
            "detail": f"torch[{device}] vs onnxruntime[cpu]: " + ("; ".join(parts) or "no floating output")}


def _is_floating(array: Any) -> bool:
    import numpy as np

    dtype = np.asarray(array).dtype
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


RUNNERS = {**gpu_check_ort.STEPS, "kernel-tests": kernel_tests, "bandwidth": bandwidth, "model": model_check}


# -- results -----------------------------------------------------------------------------------
def write_summary(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    env = summary["environment"]
    lines = [f"# GPU check on {env['gpu']}", "", *[f"- {k}: {v}" for k, v in env.items()],
             f"- dry run: {summary['dry_run']}", "",
             "| step | status | seconds | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']} | {r['detail'].replace('|', '/')} |"
              for r in summary["steps"]]
    for r in summary["steps"]:
        if r.get("summary"):
            lines += ["", f"## {r['step']}: targets", "", "```", *r["summary"], "```"]
    counts = summary["counts"]
    verdict = "FAILED" if counts["FAIL"] else "PASSED" if summary["passed"] else "NOT ALL RUN"
    lines += ["", f"{verdict}: {counts['pass']} passed, {counts['FAIL']} failed, {counts['not run']} not run"]
    (args.out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")
    copied = copy_results(args.out_dir, args.copy_to, env)
    print(f"wrote {args.out_dir / 'gpu_check.md'}" + (f"; copied {len(copied)} file(s) to {args.copy_to}"
                                                       if copied else ""))


def copy_results(out_dir: Path, copy_to: Path, env: dict[str, Any]) -> list[Path]:
    """The summary (named after the GPU and the time) and the bandwidth CSV/PNG/MD, into ``copy_to``."""
    if copy_to.resolve() == out_dir.resolve():
        return []
    copy_to.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", str(env["gpu"])).strip("-").lower()
    stamp = env["time"].replace(":", "").replace("-", "")
    copied = []
    for suffix in ("json", "md"):
        target = copy_to / f"gpu_check-{slug}-{stamp}.{suffix}"
        shutil.copyfile(out_dir / f"gpu_check.{suffix}", target)
        copied.append(target)
    bandwidth_dir = out_dir / "bandwidth"
    if bandwidth_dir.is_dir():
        for path in sorted(bandwidth_dir.iterdir()):
            if path.suffix in (".csv", ".png", ".md"):
                shutil.copyfile(path, copy_to / path.name)
                copied.append(copy_to / path.name)
    return copied


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


if __name__ == "__main__":
    sys.exit(main())
