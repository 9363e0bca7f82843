"""Time to first token over ``serve``'s OpenAI-compatible API against its KServe endpoints, for the
same request, on the same server and engine, in the same run.

Not a test. One ``serve --openai-port`` per model (a tiny Llama and a hidden 768 x 12 layers Llama,
both random weights with the byte-level test tokenizer, exported with ``--kv-cache --target
onnxruntime``; or ``--model DIR``); one client at a time, keep-alive connections, loopback only.
The request is one prompt of ``--prompt`` token ids, greedy (``temperature`` 0):

- streamed: OpenAI ``POST /v1/completions`` with ``"stream": true`` (time to the first server-sent
  event carrying text) against KServe's streaming twin ``model_stream`` over gRPC streaming (time to
  the first response), ``--new-tokens`` new tokens each;
- one token: OpenAI ``/v1/completions`` with ``max_tokens`` 1 against KServe HTTP ``infer`` with
  ``max_new_tokens`` 1 (the whole answer is the first token).

Each round sends ``--requests`` requests on each route in a shuffled order. The prompts are chosen
so that the first new token decodes to whole characters (the OpenAI stream holds back half a
character, which would measure the tokenizer, not the route). Every answer is checked against
``generate`` on the same folder: the OpenAI text is the decode of KServe's tokens.

Writes ``benchmarks/results/openai_ttft.{json,md}``.

    python benchmarks/bench_openai_ttft.py [--rounds 5] [--requests 20] [--prompt 32] [--new-tokens 8]
"""

from __future__ import annotations

import argparse
import http.client
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
sys.path.insert(0, str(ROOT))  # its tiny tokenizer comes from tests/serving/_tokenizer.py

from rmsnorm_deploy.cli import main as cli  # noqa: E402
from rmsnorm_deploy.decoder.generate import KVCacheModel, generate  # noqa: E402
from rmsnorm_deploy.exporter import hf  # noqa: E402
from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.serving.triton.process import free_ports, start_serve_process  # noqa: E402
from tests.serving._tokenizer import write_tokenizer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ROUTES = ("openai stream (http sse)", "kserve stream (grpc)", "openai one token (http)", "kserve one token (http)")
PAIRS = (("openai stream (http sse)", "kserve stream (grpc)"), ("openai one token (http)", "kserve one token (http)"))
MODELS = {
    "tiny (64 x 2)": {},
    "768 x 12": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "num_key_value_heads": 12},
}


def _export(name: str, root: Path) -> Path:
    source, out = root / f"{len(os.listdir(root))}-hf", root / f"{len(os.listdir(root))}-export"
    hf.from_config({**hf.TINY_CONFIGS["llama"], "max_position_embeddings": 512, **MODELS[name],
                    "vocab_size": 292}, "float32", seed=0).module.model.save_pretrained(source)
    write_tokenizer(source)
    if cli(["export", str(source), "--kv-cache", "--target", "onnxruntime", "-o", str(out), "--force"]) != 0:
        raise SystemExit(f"the export of {name} failed")
    return out


def _prompts(model: KVCacheModel, count: int, length: int, new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """``count`` prompts whose first greedy token decodes to whole characters, with their tokens."""
    rng, found = np.random.default_rng(0), []
    while len(found) < count:
        prompt = [1, *rng.integers(3, model.layout.vocab_size, length - 1).tolist()]
        tokens = generate(model, [prompt], max_new_tokens=new_tokens).tokens[0]
        first = model.decode(tokens[:1])
        if first and "\ufffd" not in first:
            found.append((prompt, tokens))
    return found


def _post(connection: http.client.HTTPConnection, path: str, body: str) -> tuple[object, float]:
    """The response to a POST on a keep-alive connection and when the request started; a connection
    the server closed meanwhile (Triton closes idle ones) is opened again, outside the timing."""
    for attempt in (1, 2):
        start = time.perf_counter()
        try:
            connection.request("POST", path, body, {"Content-Type": "application/json"})
            return connection.getresponse(), start
        except (http.client.RemoteDisconnected, ConnectionError):
            connection.close()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _callers(http_port: int, grpc_port: int, openai_port: int, new_tokens: int) -> dict:
    """Each route: ``prompt -> (what it answered, seconds to the first token)``."""
    import tritonclient.grpc as grpc_client

    openai = http.client.HTTPConnection("127.0.0.1", openai_port, timeout=60)
    kserve = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
    # tritonclient's stream stays open across requests (one gRPC stream, as a streaming client keeps it)
    events: queue.Queue = queue.Queue()
    streaming = grpc_client.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    streaming.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))

    def openai_call(prompt, n, stream):
        body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream})
        response, start = _post(openai, "/v1/completions", body)
        if not stream:
            answer = json.loads(response.read())
            return answer["choices"][0]["text"], time.perf_counter() - start
        first, text = None, []
        for line in response:
            if line.startswith(b"data: {"):
                piece = json.loads(line[6:])["choices"][0]["text"]
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece)
        return "".join(text), first

    def kserve_stream(prompt):
        ids = grpc_client.InferInput("input_ids", [len(prompt)], "INT64")
        ids.set_data_from_numpy(np.asarray(prompt, np.int64))
        count = grpc_client.InferInput("max_new_tokens", [1], "INT64")
        count.set_data_from_numpy(np.array([new_tokens], np.int64))
        start, first, tokens = time.perf_counter(), None, []
        streaming.async_stream_infer("model_stream", [ids, count], enable_empty_final_response=True)
        while True:
            result, error, at = events.get(timeout=60)
            if error is not None:
                raise SystemExit(f"the stream answered with an error: {error}")
            if result.get_response().outputs:
                first = at - start if first is None else first
                tokens += result.as_numpy("output_ids").tolist()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return tokens, first

    def kserve_one(prompt):
        body = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [len(prompt)],
                                       "data": prompt},
                                      {"name": "max_new_tokens", "datatype": "INT64", "shape": [1], "data": [1]}]})
        response, start = _post(kserve, "/v2/models/model/infer", body)
        answer = json.loads(response.read())
        return answer["outputs"][0]["data"], time.perf_counter() - start

    return {ROUTES[0]: lambda p: openai_call(p, new_tokens, True), ROUTES[1]: kserve_stream,
            ROUTES[2]: lambda p: openai_call(p, 1, False), ROUTES[3]: kserve_one}, streaming


def measure(folder: Path, args: argparse.Namespace) -> dict:
    with KVCacheModel(folder) as model:
        prompts = _prompts(model, args.requests, args.prompt, args.new_tokens)
        decode = model.decode
    openai_port = free_ports(1)[0]
    served = start_serve_process(folder, args=["--openai-port", str(openai_port)])
    times: dict[str, list[float]] = {r: [] for r in ROUTES}
    wrong = {r: 0 for r in ROUTES}
    try:
        callers, streaming = _callers(served.http, served.grpc, openai_port, args.new_tokens)
        want = {ROUTES[0]: [decode(t) for _, t in prompts], ROUTES[1]: [t for _, t in prompts],
                ROUTES[2]: [decode(t[:1]) for _, t in prompts], ROUTES[3]: [t[:1] for _, t in prompts]}
        for route, call in callers.items():  # warm every path once, outside the timing
            call(prompts[0][0])
        order, shuffler = list(ROUTES), random.Random(0)
        for _ in range(args.rounds):
            shuffler.shuffle(order)
            for route in order:
                for (prompt, _), expected in zip(prompts, want[route]):
                    got, first = callers[route](prompt)
                    wrong[route] += got != expected
                    times[route].append(first * 1000)
        streaming.stop_stream()
    except BaseException:  # SystemExit too: a stream that answered with an error
        print("".join(served.log[-20:]), file=sys.stderr)  # what the server said before it failed
        raise
    finally:
        served.stop()
    result = {}
    for route in ROUTES:
        result[route] = {"ttft_ms_p50": round(statistics.median(times[route]), 2),
                         "ttft_ms_p90": round(float(np.percentile(times[route], 90)), 2),
                         "requests": len(times[route]), "wrong_answers": wrong[route]}
    for openai_route, kserve_route in PAIRS:
        result[openai_route]["ratio_to_kserve_p50"] = round(
            result[openai_route]["ttft_ms_p50"] / result[kserve_route]["ttft_ms_p50"], 3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20, help="requests per route per round")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=8, help="new tokens of a streamed request")
    parser.add_argument("--models", default=",".join(MODELS), help=f"which of {', '.join(MODELS)} (comma-separated)")
    parser.add_argument("--model", type=Path, help="a KV-cache export folder with tokenizer.json (default: both "
                        "models above, exported here)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()

    load_before = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp:
        folders = {str(args.model): args.model} if args.model else {n: _export(n, Path(tmp)) for n in args.models.split(",")}
        for name, folder in folders.items():
            results[name] = measure(folder, args)
    env = {"python": platform.python_version(), "cpus": os.cpu_count(),
           **{p: package_version(p) for p in ("onnxruntime", "nvidia-pytriton", "uvicorn", "starlette", "numpy")}}
    setup = {"rounds": args.rounds, "requests": args.requests, "prompt_tokens": args.prompt,
             "streamed_new_tokens": args.new_tokens,
             "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "openai_ttft.json").write_text(json.dumps(
        {"setup": setup, "environment": env, "results": results}, indent=1) + "\n")
    headers = ["model", "route", "TTFT p50 ms", "TTFT p90 ms", "OpenAI / KServe (p50)", "wrong"]
    md = ["# Time to first token: OpenAI API against KServe (`rmsnorm-deploy serve`, CPU)", "",
          f"`python benchmarks/bench_openai_ttft.py`: {env['cpus']} CPUs, onnxruntime {env['onnxruntime']}, "
          f"nvidia-pytriton {env['nvidia-pytriton']} (Triton 2.51), uvicorn {env['uvicorn']}, starlette "
          f"{env['starlette']}; one `serve --openai-port` per model, prompts of {args.prompt} token ids, greedy, "
          f"{args.rounds} interleaved rounds of {args.requests} requests per route, one request at a time. Every "
          f"answer was checked against `generate` on the same folder (column `wrong`). The machine's 1-minute load "
          f"average was {setup['load_average_before_after'][0]} before and {setup['load_average_before_after'][1]} "
          "after the run (other jobs share it).", "",
          "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for name, routes in results.items():
        for route, row in routes.items():
            md.append(f"| {name} | {route} | {row['ttft_ms_p50']:.2f} | {row['ttft_ms_p90']:.2f} | "
                      f"{row.get('ratio_to_kserve_p50', '')} | {row['wrong_answers']} |")
    (args.out_dir / "openai_ttft.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if not any(r["wrong_answers"] for routes in results.values() for r in routes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
