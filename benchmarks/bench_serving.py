"""Serving the tiny preset: Triton Inference Server (embedded, `rmsnorm-deploy serve`) over HTTP and
gRPC against the bare ONNX Runtime session, throughput and p50/p99 latency against concurrency.

Not a test. One run, interleaved: for each concurrency (1, 4, 16, 32 clients, each a thread with
its own client) every round runs every contender once in a shuffled order, each for a fixed
number of requests per client (bounded in count; every request goes to 127.0.0.1 only). A
request is one sequence of ``--seq`` token ids (batch 1). Every answer is checked bit for bit
against the bare session's. The server runs in its own process (as a user runs it) with Triton's
dynamic batcher; the bare session runs in this process, called from the same number of threads
(ONNX Runtime sessions are thread-safe). Both use ONNX Runtime's default intra-op threads.

Writes ``benchmarks/results/serving_cpu.{json,md,png}`` (the PNG needs matplotlib: ``make
bench-serving`` installs it).

    python benchmarks/bench_serving.py [--rounds 3] [--requests 16] [--seq 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402
from rmsnorm_deploy.errors import UserError  # noqa: E402
from rmsnorm_deploy.serving.triton.process import start_serve_process  # noqa: E402
from rmsnorm_deploy.table import format_table  # noqa: E402

CONCURRENCY = (1, 4, 16, 32)
CONTENDERS = ("onnxruntime (bare session)", "triton http", "triton grpc")
RESULTS = ROOT / "benchmarks" / "results"


def _make_callers(contender: str, runner, http: int, grpc: int):
    """A factory of per-thread callables ``ids -> logits``."""
    if contender.startswith("onnxruntime"):
        return lambda: (lambda ids: runner.infer({"input_ids": ids})["logits"])
    if contender == "triton http":
        import tritonclient.http as client

        def make():
            c = client.InferenceServerClient(f"127.0.0.1:{http}", network_timeout=60)

            def call(ids):
                inp = client.InferInput("input_ids", list(ids.shape), "INT64")
                inp.set_data_from_numpy(ids, binary_data=True)
                return c.infer("model", [inp]).as_numpy("logits")
            return call
        return make
    import tritonclient.grpc as client

    def make():
        c = client.InferenceServerClient(f"127.0.0.1:{grpc}")

        def call(ids):
            inp = client.InferInput("input_ids", list(ids.shape), "INT64")
            inp.set_data_from_numpy(ids)
            return c.infer("model", [inp], client_timeout=60).as_numpy("logits")
        return call
    return make


def _run_cell(make, concurrency: int, requests: int, pool, want) -> tuple[float, list[float], int]:
    """(wall seconds, per-request latencies, wrong answers) for ``concurrency`` clients x ``requests``."""
    barrier = threading.Barrier(concurrency + 1)

    def client(index: int) -> tuple[list[float], int]:
        # each client is made, connected and warmed in its own thread (the HTTP client is
        # gevent-based and stays in the thread that made it), outside the timing
        call, lat, wrong = make(), [], 0
        call(pool[index % len(pool)])
        barrier.wait()
        for r in range(requests):
            k = (index + r) % len(pool)
            t0 = time.perf_counter()
            got = call(pool[k])
            lat.append(time.perf_counter() - t0)
            wrong += not np.array_equal(got, want[k])
        return lat, wrong

    with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
        futures = [ex.submit(client, i) for i in range(concurrency)]
        barrier.wait(timeout=120)
        t0 = time.perf_counter()
        results = [f.result(timeout=300) for f in futures]
    wall = time.perf_counter() - t0
    return wall, [x for lat, _ in results for x in lat], sum(w for _, w in results)


def _stats(http: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/model/stats", timeout=10) as r:
        s = json.loads(r.read())["model_stats"][0]
    return {"requests": s["inference_stats"]["success"]["count"], "executions": s["execution_count"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16, help="requests per client per round")
    parser.add_argument("--seq", type=int, default=16, help="token ids per request (batch 1)")
    parser.add_argument("--model", type=Path, help="an exported model folder (default: export the tiny preset)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="bench-serving-")
    model = args.model
    if model is None:
        from rmsnorm_deploy.cli import main as cli

        model = Path(tmp.name) / "tiny"
        if cli(["export", "tiny", "-o", str(model / "model.onnx"), "--force"]) != 0:
            return 1
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 512, (1, args.seq)).astype(np.int64) for _ in range(16)]
    try:
        served = start_serve_process(model, timeout_s=120)
    except UserError as exc:
        raise SystemExit(str(exc)) from None
    http, grpc, startup = served.http, served.grpc, served.startup_s
    samples: dict[tuple[str, int], dict[str, list]] = {}
    batching: dict[int, dict[str, int]] = {}
    try:
        with OnnxRuntimeRunner(Path(model) / "model.onnx") as runner:
            want = [runner.infer({"input_ids": ids})["logits"] for ids in pool]
            makers = {c: _make_callers(c, runner, http, grpc) for c in CONTENDERS}
            order = list(CONTENDERS)
            for concurrency in CONCURRENCY:
                before = _stats(http)
                for _ in range(args.rounds):
                    random.shuffle(order)
                    for contender in order:
                        wall, lat, wrong = _run_cell(makers[contender], concurrency, args.requests, pool, want)
                        if wrong:
                            raise SystemExit(f"{contender} at concurrency {concurrency}: {wrong} answers differ from "
                                             "the bare session's")
                        cell = samples.setdefault((contender, concurrency), {"throughput": [], "latency": []})
                        cell["throughput"].append(len(lat) / wall)
                        cell["latency"].extend(lat)
                after = _stats(http)
                batching[concurrency] = {k: after[k] - before[k] for k in after}
                print(f"concurrency {concurrency}: done", flush=True)
    finally:
        served.stop(timeout_s=60)
        tmp.cleanup()

    rows, data = [], []
    for (contender, concurrency), cell in samples.items():
        lat_ms = np.array(cell["latency"]) * 1e3
        entry = {"contender": contender, "concurrency": concurrency,
                 "throughput_rps": statistics.median(cell["throughput"]),
                 "p50_ms": float(np.percentile(lat_ms, 50)), "p99_ms": float(np.percentile(lat_ms, 99)),
                 "requests": int(lat_ms.size)}
        data.append(entry)
    data.sort(key=lambda e: (e["concurrency"], CONTENDERS.index(e["contender"])))
    for e in data:
        b = batching[e["concurrency"]]
        note = (f"{b['requests']} requests in {b['executions']} executions" if e["contender"].startswith("triton")
                else "")
        rows.append([e["concurrency"], e["contender"], f"{e['throughput_rps']:.0f}", f"{e['p50_ms']:.2f}",
                     f"{e['p99_ms']:.2f}", e["requests"], note])
    headers = ["clients", "contender", "requests/s", "p50 ms", "p99 ms", "requests", "server batching (all of Triton)"]
    table = format_table(headers, rows)
    print(table)
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
           **{p: package_version(p) for p in ("onnxruntime", "nvidia-pytriton", "tritonclient", "numpy")}}
    setup = {"seq": args.seq, "batch_per_request": 1, "rounds": args.rounds, "requests_per_client": args.requests,
             "concurrency": list(CONCURRENCY), "server_startup_s": round(startup, 2),
             "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "serving_cpu.json").write_text(json.dumps(
        {"setup": setup, "environment": env, "results": data, "batching": batching}, indent=1) + "\n")
    md = ["# Serving the tiny preset: Triton Inference Server (embedded) vs the bare ONNX Runtime session", "",
          f"`python benchmarks/bench_serving.py`: {env['cpus']} CPUs, onnxruntime {env['onnxruntime']}, "
          f"nvidia-pytriton {env['nvidia-pytriton']} (Triton 2.51), tritonclient {env['tritonclient']}; "
          f"each request one sequence of {args.seq} token ids; {args.rounds} interleaved rounds of "
          f"{args.requests} requests per client; throughput is the median over rounds, latencies pooled over "
          f"rounds. Every answer was bit-identical to the bare session's. Server ready "
          f"{startup:.1f} s after launch. The machine's 1-minute load average was "
          f"{setup['load_average_before_after'][0]} before and {setup['load_average_before_after'][1]} after the run "
          "(other jobs share it): compare contenders within a row group, not across runs.", "", "| " + " | ".join(headers) + " |",
          "|" + "---|" * len(headers)]
    md += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    (args.out_dir / "serving_cpu.md").write_text("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (make bench-serving installs it)")
        return 0
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for contender in CONTENDERS:
        pts = [e for e in data if e["contender"] == contender]
        x = [e["concurrency"] for e in pts]
        axes[0].plot(x, [e["throughput_rps"] for e in pts], marker="o", label=contender)
        line, = axes[1].plot(x, [e["p50_ms"] for e in pts], marker="o", label=f"{contender} p50")
        axes[1].plot(x, [e["p99_ms"] for e in pts], marker="x", linestyle="--", color=line.get_color(),
                     label=f"{contender} p99")
    for ax, title, ylabel in ((axes[0], "throughput", "requests / s"), (axes[1], "latency", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(CONCURRENCY, [str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"tiny preset, 1 x {args.seq} tokens per request, {env['cpus']} CPUs (ONNX Runtime CPU)")
    fig.tight_layout()
    fig.savefig(args.out_dir / "serving_cpu.png", dpi=120)
    print(f"wrote {args.out_dir}/serving_cpu.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
