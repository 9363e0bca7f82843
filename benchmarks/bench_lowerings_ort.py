"""Each lowering of the standalone RMSNorm in ONNX Runtime CPU, against torch eager and a memory copy.

Not a test: it measures, in one run and side by side, the median time of every lowering on
[8, 512, 4096] in float32 and float16 (ORT_ENABLE_ALL, 2 intra-op threads, inputs and outputs
bound once through IOBinding so that no allocation or copy is timed; all variants timed
round-robin so that load or clock drift hits them alike), torch eager on the same
tensors, and a copy of the same bytes (``dst.copy_(src)`` with 2 threads). Bandwidth counts the
bytes a fused kernel must move: the input read once, the output written once (the weight is
negligible). It prints a table and writes ``benchmarks/results/lowerings_ort_cpu.{json,md}``.

Targets (issue: the function lowering reaches at least 0.9x the fastest ORT lowering and 0.8x the
copy bandwidth).

    python benchmarks/bench_lowerings_ort.py [--rounds 15] [--shape 8x512x4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from rmsnorm_deploy.contract.dtypes import to_torch  # noqa: E402
from rmsnorm_deploy.contract.inputs import activations, gain_weights  # noqa: E402
from rmsnorm_deploy.contract.reference import reference  # noqa: E402
from rmsnorm_deploy.contract.spec import named_specs  # noqa: E402
from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.errors import LoweringError  # noqa: E402
from rmsnorm_deploy.graph.lowerings import LOWERINGS  # noqa: E402
from rmsnorm_deploy.graph.standalone import rmsnorm_model  # noqa: E402
from rmsnorm_deploy.table import format_table  # noqa: E402

THREADS = 2


def _interleaved_medians(timers: dict[str, object], rounds: int, slice_seconds: float = 0.05,
                         warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each timer, measured round-robin so that drift hits all alike.

    Each round gives every timer a slice of about ``slice_seconds`` of back-to-back calls (a
    slow variant gets fewer calls, so it does not dominate a round); the result is the median
    over rounds of each timer's mean call time.
    """
    calls: dict[str, int] = {}
    for name, fn in timers.items():
        for _ in range(warmup):
            fn()
        start = time.perf_counter()
        fn()
        calls[name] = max(1, round(slice_seconds / max(time.perf_counter() - start, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, fn in timers.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def _ort_timer(model, x: np.ndarray, w: np.ndarray | None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Idle ORT threads spin for a while after each run; with several sessions timed in turn,
    # one session's spinning threads would steal the cores of the next one's timing.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    keep = []
    for name, array in (("x", x), ("weight", w)):
        if array is None:
            continue
        value = ort.OrtValue.ortvalue_from_numpy(array)
        keep.append(value)
        binding.bind_ortvalue_input(name, value)
    out = ort.OrtValue.ortvalue_from_numpy(np.empty_like(x))
    keep.append(out)
    binding.bind_ortvalue_output("y", out)

    def run() -> None:
        session.run_with_iobinding(binding)

    return run, keep


def bench(shape: tuple[int, ...], rounds: int) -> list[dict]:
    torch.set_num_threads(THREADS)
    rows = []
    for dtype in ("float32", "float16"):
        x = activations(shape, dtype, seed=0)
        nbytes = 2 * x.nbytes  # read x once, write y once
        src = to_torch(x)
        dst = torch.empty_like(src)
        for spec_name in ("torch", "llama"):
            spec = named_specs()[spec_name]
            w = gain_weights(shape[-1:], dtype, spec.gain, seed=1)
            w_t = to_torch(w)
            timers: dict[str, object] = {"memory copy": lambda: dst.copy_(src),
                                         "torch eager": lambda: reference(spec, src, w_t)}
            keep = []
            for lowering in LOWERINGS:
                try:
                    model = rmsnorm_model(spec, dtype=dtype, shape=shape, lowering=lowering)
                except LoweringError as exc:
                    rows.append(_row(dtype, spec_name, lowering, None, nbytes, note=str(exc).split(": ", 1)[-1]))
                    continue
                run, held = _ort_timer(model, x, w)
                keep.append(held)
                timers[lowering] = run
            seconds = _interleaved_medians(timers, rounds)
            fastest = min(v for k, v in seconds.items() if k in LOWERINGS)
            for what in [*[lw for lw in LOWERINGS if lw in seconds], "torch eager", "memory copy"]:
                rows.append(_row(dtype, spec_name, what, seconds[what], nbytes, fastest=fastest,
                                 copy=seconds["memory copy"]))
    return rows


def _row(dtype, spec, what, seconds, nbytes, *, fastest=None, copy=None, note=""):
    row = {"dtype": dtype, "spec": spec, "lowering": what, "ms": None, "GB/s": None,
           "vs fastest ORT": None, "vs copy": None, "note": note}
    if seconds is not None:
        row.update({"ms": seconds * 1e3, "GB/s": nbytes / seconds / 1e9, "vs fastest ORT": fastest / seconds,
                    "vs copy": copy / seconds})
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8x512x4096")
    parser.add_argument("--rounds", type=int, default=21, help="round-robin rounds (~50 ms of calls of each per round)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lowerings_ort_cpu"))
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split("x"))
    rows = bench(shape, args.rounds)
    headers = ["dtype", "spec", "lowering", "ms", "GB/s", "vs fastest ORT", "vs copy", "note"]
    table = format_table(headers, [[_fmt(r[h]) for h in headers] for r in rows])
    print(table)
    verdicts = []
    for dtype in ("float32", "float16"):
        for spec in ("torch", "llama"):
            fn = next(r for r in rows if (r["dtype"], r["spec"], r["lowering"]) == (dtype, spec, "function"))
            ok_fast = fn["vs fastest ORT"] >= 0.9
            ok_copy = fn["vs copy"] >= 0.8
            verdicts.append(f"{dtype} {spec}: function = {fn['vs fastest ORT']:.2f}x fastest ORT lowering "
                            f"({'PASS' if ok_fast else 'MISS'} >= 0.9), {fn['vs copy']:.2f}x copy "
                            f"({'PASS' if ok_copy else 'MISS'} >= 0.8)")
    print("\n" + "\n".join(verdicts))
    meta = {
        "shape": list(shape), "threads": THREADS, "rounds": args.rounds, "machine": platform.machine(),
        "processor": _cpu_name(), "cores": torch.get_num_threads(),
        "versions": {d: package_version(d) for d in ("onnxruntime", "torch", "onnx", "onnxscript")},
        "date": time.strftime("%Y-%m-%d"), "load": " ".join(f"{v:.2f}" for v in os.getloadavg()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "verdicts": verdicts}, indent=1))
    out.with_suffix(".md").write_text(
        f"# Lowerings in ONNX Runtime CPU, {args.shape}\n\n"
        f"{meta['date']}, {meta['processor']}, {THREADS} threads, median over {args.rounds} round-robin rounds "
        f"(load average {meta['load']}); "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + "\n\n```\n" + table + "\n```\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n"
    )
    return 0


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.2f}"
    return "" if value is None else value


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
