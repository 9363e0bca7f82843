"""What ``serve``'s checking fronts cost: one small plain-model request, straight to Triton's own
internal ports against through the fronts on the public ports, in the same run.

Not a test. One ``serve`` of the tiny preset (exported here unless ``--model`` is given); one client
at a time, keep-alive connections, loopback only. Each round sends ``--requests`` requests to each
of the four routes (HTTP direct, HTTP front, gRPC direct, gRPC front) in a shuffled order; every
answer is checked bit for bit against the model run here. A request is ``input_ids`` [1, ``--seq``]
as JSON, the logits asked back as binary data (HTTP) or raw contents (gRPC).

Writes ``benchmarks/results/front_overhead.{json,md}``.

    python benchmarks/bench_front.py [--rounds 5] [--requests 100] [--seq 4] [--model DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402
from rmsnorm_deploy.serving.triton.process import start_serve_process  # noqa: E402
from rmsnorm_deploy.table import format_table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ROUTES = ("http direct", "http front", "grpc direct", "grpc front")


def _http_caller(port: int, ids: np.ndarray, shape: tuple):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": list(ids.shape),
                                   "data": ids.ravel().tolist()}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()

    def call() -> np.ndarray:
        connection.request("POST", "/v2/models/model/infer", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        header = int(response.getheader("Inference-Header-Content-Length"))
        return np.frombuffer(payload[header:], np.float32).reshape(shape)

    return call


def _grpc_caller(port: int, ids: np.ndarray, shape: tuple):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    request = service_pb2.ModelInferRequest(model_name="model")
    request.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
    request.raw_input_contents.append(ids.tobytes())

    def call() -> np.ndarray:
        response = stub.ModelInfer(request, timeout=60)
        return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(shape)

    return call


def measure(model_dir: Path, rounds: int, requests: int, seq: int) -> dict:
    ids = np.random.default_rng(0).integers(0, 512, (1, seq)).astype(np.int64)
    with OnnxRuntimeRunner(model_dir / "model.onnx") as runner:
        want = runner.infer({"input_ids": ids})["logits"]
    served = start_serve_process(model_dir)
    try:
        summary = "".join(served.log)
        internal = re.search(r"Triton on 127\.0\.0\.1:(\d+) \(HTTP\), 127\.0\.0\.1:(\d+) \(gRPC\)", summary)
        ports = {"http direct": int(internal[1]), "http front": served.http,
                 "grpc direct": int(internal[2]), "grpc front": served.grpc}
        callers = {r: (_http_caller if r.startswith("http") else _grpc_caller)(ports[r], ids, want.shape)
                   for r in ROUTES}
        times: dict[str, list[float]] = {r: [] for r in ROUTES}
        for route in ROUTES:  # warm-up
            for _ in range(10):
                assert np.array_equal(callers[route](), want), route
        order = list(ROUTES)
        for _ in range(rounds):
            random.shuffle(order)
            for route in order:
                for _ in range(requests):
                    started = time.perf_counter()
                    got = callers[route]()
                    times[route].append(time.perf_counter() - started)
                    assert np.array_equal(got, want), route
    finally:
        served.stop()
    return {r: {"p50_ms": 1e3 * statistics.median(t), "p99_ms": 1e3 * float(np.percentile(t, 99)),
                "requests": len(t)} for r, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--seq", type=int, default=4)
    parser.add_argument("--model", type=Path, help="an exported tiny-preset folder (default: export one here)")
    args = parser.parse_args()
    if args.model is None:
        from rmsnorm_deploy.cli import main as cli

        args.model = Path(tempfile.mkdtemp(prefix="bench-front-"))
        assert cli(["export", "tiny", "-o", str(args.model / "model.onnx"), "--force"]) == 0
    results = measure(args.model, args.rounds, args.requests, args.seq)
    rows = [[r, f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}", str(v["requests"])] for r, v in results.items()]
    overhead = {p: results[f"{p} front"]["p50_ms"] - results[f"{p} direct"]["p50_ms"] for p in ("http", "grpc")}
    load = os.getloadavg()[0]
    text = (f"# serve's fronts: p50 latency of one small request, direct to Triton vs through the front\n\n"
            f"tiny preset, input_ids [1, {args.seq}], one client, keep-alive, {args.rounds} shuffled rounds of "
            f"{args.requests} requests per route; every answer bit-identical to ONNX Runtime here. "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, 1-minute load {load:.1f}; "
            f"starlette {package_version('starlette')}, uvicorn {package_version('uvicorn')}, "
            f"grpcio {package_version('grpcio')}, nvidia-pytriton {package_version('nvidia-pytriton')}.\n\n"
            + format_table(["route", "p50 ms", "p99 ms", "requests"], rows)
            + f"\n\nfront overhead at p50: HTTP {overhead['http']:+.2f} ms, gRPC {overhead['grpc']:+.2f} ms\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "front_overhead.md").write_text(text)
    (RESULTS / "front_overhead.json").write_text(json.dumps(
        {"seq": args.seq, "rounds": args.rounds, "requests": args.requests, "load_1min": load,
         "results": results, "overhead_p50_ms": overhead}, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
