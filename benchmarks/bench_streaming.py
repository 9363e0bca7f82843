"""Streaming generation against whole answers: the tiny preset's KV-cache export behind
``rmsnorm-deploy serve``, time to the first new token and to the last.

Not a test. One run, interleaved: every round runs every contender once, in a shuffled order, for
``--requests`` requests of ``--new-tokens`` new tokens after a ``--prompt``-token prompt (one
client, one request at a time, 127.0.0.1 only). Contenders: ``generate`` called in this process
(no server), the generation model over HTTP and over gRPC (one response holding every token), and
its streaming twin ``model_stream`` over gRPC streaming (one response per token). For a whole
answer the first token arrives with the last. Every answer is checked token for token against
``generate`` called directly.

Writes ``benchmarks/results/streaming_cpu.{json,md}``.

    python benchmarks/bench_streaming.py [--rounds 5] [--requests 8] [--prompt 7] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from rmsnorm_deploy.decoder.generate import KVCacheModel, generate  # noqa: E402
from rmsnorm_deploy.errors import UserError  # noqa: E402
from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.serving.triton.process import start_serve_process  # noqa: E402

CONTENDERS = ("generate in process", "whole answer, http", "whole answer, grpc", "stream, grpc")
RESULTS = ROOT / "benchmarks" / "results"


def _inputs(module, prompt: np.ndarray, new_tokens: int) -> list:
    ids = module.InferInput("input_ids", list(prompt.shape), "INT64")
    ids.set_data_from_numpy(prompt)
    count = module.InferInput("max_new_tokens", [1], "INT64")
    count.set_data_from_numpy(np.array([new_tokens], np.int64))
    return [ids, count]


def _callers(model: KVCacheModel, http: int, grpc: int, new_tokens: int) -> dict:
    """Each contender: ``prompt -> (tokens, seconds to the first token, seconds to the last)``."""
    import tritonclient.grpc as grpc_client
    import tritonclient.http as http_client

    h = http_client.InferenceServerClient(f"127.0.0.1:{http}", network_timeout=60)
    g = grpc_client.InferenceServerClient(f"127.0.0.1:{grpc}")
    events: queue.Queue = queue.Queue()
    streaming = grpc_client.InferenceServerClient(f"127.0.0.1:{grpc}")
    streaming.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))

    def direct(prompt):
        start = time.perf_counter()
        tokens = generate(model, [prompt.tolist()], max_new_tokens=new_tokens).tokens[0]
        took = time.perf_counter() - start
        return tokens, took, took

    def whole_http(prompt):
        start = time.perf_counter()
        tokens = h.infer("model", _inputs(http_client, prompt, new_tokens)).as_numpy("output_ids").tolist()
        took = time.perf_counter() - start
        return tokens, took, took

    def whole_grpc(prompt):
        start = time.perf_counter()
        tokens = g.infer("model", _inputs(grpc_client, prompt, new_tokens), client_timeout=60)
        took = time.perf_counter() - start
        return tokens.as_numpy("output_ids").tolist(), took, took

    def stream(prompt):
        tokens: list[int] = []
        first = None
        start = time.perf_counter()
        streaming.async_stream_infer("model_stream", _inputs(grpc_client, prompt, new_tokens),
                                     enable_empty_final_response=True)
        while True:
            result, error, at = events.get(timeout=60)
            if error is not None:
                raise SystemExit(f"the stream answered with an error: {error}")
            response = result.get_response()
            if response.outputs:
                tokens.extend(result.as_numpy("output_ids").tolist())
                first = at if first is None else first
            if response.parameters["triton_final_response"].bool_param:
                return tokens, first - start, at - start

    return dict(zip(CONTENDERS, (direct, whole_http, whole_grpc, stream))), streaming


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8, help="requests per contender per round")
    parser.add_argument("--prompt", type=int, default=7, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="a KV-cache export folder (default: export tiny --kv-cache)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as tmp:
        folder = args.model
        if folder is None:
            from rmsnorm_deploy.cli import main as cli

            folder = Path(tmp) / "tiny-kv"
            if cli(["export", "tiny", "--kv-cache", "-o", str(folder), "--force"]) != 0:
                return 1
        try:
            served = start_serve_process(folder, timeout_s=120)
        except UserError as exc:
            raise SystemExit(str(exc)) from None
        http, grpc, startup = served.http, served.grpc, served.startup_s
        load_before = os.getloadavg()
        rng = np.random.default_rng(0)
        times = {c: {"first": [], "last": []} for c in CONTENDERS}
        wrong = {c: 0 for c in CONTENDERS}
        try:
            with KVCacheModel(folder) as model:
                vocab = model.layout.vocab_size
                callers, streaming = _callers(model, http, grpc, args.new_tokens)
                prompts = [rng.integers(0, vocab, args.prompt).astype(np.int64) for _ in range(args.requests)]
                want = [generate(model, [p.tolist()], max_new_tokens=args.new_tokens).tokens[0] for p in prompts]
                for call in callers.values():  # warm every path once, outside the timing
                    call(prompts[0])
                order, shuffler = list(CONTENDERS), random.Random(0)
                for _ in range(args.rounds):
                    shuffler.shuffle(order)
                    for contender in order:
                        for prompt, expected in zip(prompts, want):
                            tokens, first, last = callers[contender](prompt)
                            wrong[contender] += tokens != expected
                            times[contender]["first"].append(first * 1000)
                            times[contender]["last"].append(last * 1000)
                streaming.stop_stream()
        finally:
            served.stop(timeout_s=60)

    new = round(statistics.mean(len(w) for w in want), 1)  # fewer where a row ended at its end-of-sequence token
    rows, data = [], {}
    for c in CONTENDERS:
        first, last = statistics.median(times[c]["first"]), statistics.median(times[c]["last"])
        data[c] = {"first_token_ms_p50": round(first, 2), "last_token_ms_p50": round(last, 2),
                   "first_token_ms_p99": round(float(np.percentile(times[c]["first"], 99)), 2),
                   "tokens_per_s": round(new * 1000 / last, 1), "requests": len(times[c]["last"]),
                   "wrong_answers": wrong[c]}
        rows.append([c, f"{first:.2f}", f"{data[c]['first_token_ms_p99']:.2f}", f"{last:.2f}",
                     f"{data[c]['tokens_per_s']:.0f}", wrong[c]])
    env = {"python": platform.python_version(), "cpus": os.cpu_count(),
           **{p: package_version(p) for p in ("onnxruntime", "nvidia-pytriton", "tritonclient", "numpy")}}
    setup = {"rounds": args.rounds, "requests": args.requests, "prompt_tokens": args.prompt,
             "max_new_tokens": args.new_tokens, "new_tokens_made": new, "server_startup_s": round(startup, 1),
             "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "streaming_cpu.json").write_text(json.dumps(
        {"setup": setup, "environment": env, "results": data}, indent=1) + "\n")
    headers = ["contender", "first token p50 ms", "first token p99 ms", "last token p50 ms", "tokens/s", "wrong"]
    intro = (f"`python benchmarks/bench_streaming.py`: {env['cpus']} CPUs, onnxruntime {env['onnxruntime']}, "
             f"nvidia-pytriton {env['nvidia-pytriton']} (Triton 2.51), tritonclient {env['tritonclient']}; the tiny "
             f"preset's KV-cache export, prompts of {args.prompt} tokens, {new} new tokens per request (greedy), "
             f"{args.rounds} interleaved rounds of {args.requests} requests per contender, one request at a time. "
             f"Every answer was checked against `generate` called directly (column `wrong`). The machine's 1-minute "
             f"load average was {setup['load_average_before_after'][0]} before and "
             f"{setup['load_average_before_after'][1]} after the run (other jobs share it).")
    md = ["# Streaming generation vs whole answers (`rmsnorm-deploy serve`, CPU)", "", intro, "",
          "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    md += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    (args.out_dir / "streaming_cpu.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if not any(wrong.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
