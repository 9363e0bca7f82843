"""Generation serving with many users at once: ``rmsnorm-deploy serve`` (the continuous-batching
engine) against llama.cpp's ``llama-server --parallel N`` on the same weights, and
onnxruntime-genai's batched ``Generator`` as a static-batch reference.

Not a test. For each model (a tiny Hugging Face Llama, hidden 256 x 4 layers, vocabulary 2048, and
the ~125M Llama, hidden 768 x 12 layers, vocabulary 32000: ``bench_kv_decode.MODELS``, random
weights, float32) and each number of clients N (1, 4, 16, 64), every client sends ``--requests``
requests one after the other, each a ``--prompt``-token prompt and ``--new-tokens`` new tokens,
streamed, all on 127.0.0.1. Per contender and N: aggregate tokens/s (all tokens over the wall
time from the first request to the last token), time to first token and inter-token latency
p50/p99 over every request and token gap.

* ``ours``: ``export --kv-cache --target onnxruntime`` served by ``rmsnorm-deploy serve
  --max-batch 64`` (one server per model for every N), the streaming model ``model_stream`` over
  gRPC (tritonclient), greedy. Every stream is checked token for token against ``generate`` on
  its prompt alone (in this process, before the servers start).
* ``llama-server``: the same Hugging Face folder converted to GGUF float32 by llama.cpp's own
  ``convert_hf_to_gguf.py`` (its vocabulary from a SentencePiece model written here, as the folder
  has only a word-level tokenizer), ``llama-server --parallel N -c N x (prompt + new tokens) -t 2``
  started per N (continuous batching is its default), ``POST /completion`` with the prompt as token
  ids, ``stream``, ``temperature`` 0, ``ignore_eos``, ``cache_prompt`` false (no prefix reuse). Its
  tokens are compared with ours (agreement, not asserted: another runtime's float32 kernels).
  Needs ``--llama-cpp DIR`` (or ``LLAMA_CPP_DIR``): a llama.cpp checkout with ``build/bin/llama-server``
  and ``convert_hf_to_gguf.py`` (whose Python needs ``gguf``'s dependencies and ``sentencepiece``);
  without it that contender is recorded as not run, with the reason.
* ``genai static batch``: onnxruntime-genai's builder output for the same folder, one batched
  ``Generator`` of N rows (N prompts at once, no arrivals): first token = the prefill, inter-token
  latency = each step.

All three run 2 intra-op threads; each contender runs while the others are idle. Writes
``benchmarks/results/generation_serving.{json,md,png}``.

    nice python benchmarks/bench_generation_serving.py [--models tiny,125m] [--clients 1,4,16,64]
        [--requests 2] [--prompt 32] [--new-tokens 64] [--llama-cpp DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import platform
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from bench_kv_decode import MODELS, THREADS, build_genai, export_folder, log, save_hf  # noqa: E402

from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.serving.triton.process import free_ports, start_serve_process  # noqa: E402

OURS, LLAMA, GENAI = "ours", "llama-server", "genai static batch"
CONTENDERS = (OURS, LLAMA, GENAI)
RESULTS = ROOT / "benchmarks" / "results"
LABELS = {"tiny": "Llama hidden 256 x 4 layers, vocab 2048", "125m": "Llama hidden 768 x 12 layers, vocab 32000 (~134M)"}
LLAMA_CPP_ENV = "LLAMA_CPP_DIR"

#: One request as a client saw it: the tokens, seconds to the first token, the gaps between tokens.
Request = tuple[list[int], float, list[float]]


# -- the clients ------------------------------------------------------------------------------------
def run_clients(call: Callable[[list[int]], Request], prompts: list[list[int]], clients: int,
                requests: int) -> tuple[float, list[tuple[int, Request]]]:
    """``clients`` threads, each sending ``requests`` requests back to back: (wall seconds, [(prompt
    index, request)]). One request first, untimed: a server's first request pays for its warm-up
    (llama-server's first took 2.6 s where the next took 0.05 s)."""
    call(prompts[0])
    barrier = threading.Barrier(clients + 1)

    def client(index: int) -> list[tuple[int, Request]]:
        barrier.wait()
        done = []
        for r in range(requests):
            k = (index * requests + r) % len(prompts)
            done.append((k, call(prompts[k])))
        return done

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, i) for i in range(clients)]
        barrier.wait(timeout=600)
        started = time.perf_counter()
        results = [item for f in futures for item in f.result(timeout=1800)]
    return time.perf_counter() - started, results


def grpc_stream_call(grpc: int, new_tokens: int) -> Callable[[list[int]], Request]:
    """One streaming request to ``model_stream`` (a client per request, as a user's would be)."""
    import tritonclient.grpc as client

    def call(prompt: list[int]) -> Request:
        events: queue.Queue = queue.Queue()
        c = client.InferenceServerClient(f"127.0.0.1:{grpc}")
        c.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
        inputs = [client.InferInput("input_ids", [len(prompt)], "INT64"), client.InferInput("max_new_tokens", [1], "INT64")]
        inputs[0].set_data_from_numpy(np.array(prompt, np.int64))
        inputs[1].set_data_from_numpy(np.array([new_tokens], np.int64))
        tokens, times = [], []
        sent = time.perf_counter()
        c.async_stream_infer("model_stream", inputs, enable_empty_final_response=True)
        while True:
            result, error, at = events.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"ours: {error.message()}")
            if result.get_response().outputs:
                tokens.append(int(result.as_numpy("output_ids")[0]))
                times.append(at)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        c.stop_stream()
        c.close()
        return tokens, times[0] - sent, list(np.diff(times))
    return call


def llama_stream_call(port: int, new_tokens: int) -> Callable[[list[int]], Request]:
    """One streaming ``POST /completion`` to llama-server (server-sent events, one per token)."""
    def call(prompt: list[int]) -> Request:
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "stream": True, "temperature": 0.0,
                           "top_k": 1, "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        sent = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"llama-server: HTTP {response.status} {response.read()[:200]!r}")
        tokens, times = [], []
        for line in response:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("stop"):
                break
            times.append(time.perf_counter())
            tokens.extend(event.get("tokens") or [-1])
        conn.close()
        return tokens, times[0] - sent, list(np.diff(times))
    return call


def summary(wall: float, results: list[tuple[int, Request]]) -> dict[str, Any]:
    tokens = sum(len(r[0]) for _, r in results)
    ttft = np.array([r[1] for _, r in results]) * 1e3
    gaps = np.array([g for _, r in results for g in r[2]]) * 1e3
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "requests": len(results), "wall_s": wall,
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "itl_p50_ms": float(np.percentile(gaps, 50)) if gaps.size else 0.0,
            "itl_p99_ms": float(np.percentile(gaps, 99)) if gaps.size else 0.0}


# -- the models -----------------------------------------------------------------------------------------
def write_sentencepiece(folder: Path, vocab_size: int) -> None:
    """A SentencePiece ``tokenizer.model`` with one piece per id (``<unk>``, ``<s>``, ``</s>``, then
    ``t3`` ...): what llama.cpp's converter reads the vocabulary from. Prompts go as ids, so only its
    size matters. Written as the protobuf bytes themselves (``ModelProto.pieces``: piece, score,
    type), since sentencepiece's generated module wants a newer protobuf than this environment's."""
    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            byte, value = value & 0x7F, value >> 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                return bytes(out)

    def field(number: int, payload: bytes) -> bytes:  # length-delimited
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    normal, unknown, control = 1, 2, 3  # SentencePiece.Type
    pieces = bytearray()
    for i in range(vocab_size):
        text = {0: "<unk>", 1: "<s>", 2: "</s>"}.get(i, f"\u2581t{i}").encode()
        kind = {0: unknown, 1: control, 2: control}.get(i, normal)
        body = field(1, text) + varint(2 << 3 | 5) + np.float32(-i).tobytes() + varint(3 << 3) + varint(kind)
        pieces += field(1, body)
    (folder / "tokenizer.model").write_bytes(bytes(pieces))


def llama_cpp_dir(given: Path | None) -> tuple[Path | None, str | None]:
    """The llama.cpp checkout to use, or the reason there is none."""
    folder = given or (Path(os.environ[LLAMA_CPP_ENV]) if os.environ.get(LLAMA_CPP_ENV) else None)
    if folder is None:
        return None, f"no llama.cpp given (--llama-cpp DIR or {LLAMA_CPP_ENV}): llama-server not run"
    missing = [p for p in ("build/bin/llama-server", "convert_hf_to_gguf.py") if not (folder / p).is_file()]
    if missing:
        return None, f"{folder} has no {', '.join(missing)}: llama-server not run"
    return folder, None


def to_gguf(llama_cpp: Path, hf_dir: Path, out: Path) -> Path:
    """The Hugging Face folder as GGUF float32, by llama.cpp's own converter."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f32",
                           "--outfile", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    log(f"  GGUF float32: {time.perf_counter() - started:.1f}s")
    return out


def prepare(key: str, args: argparse.Namespace, tmp: Path, llama_cpp: Path | None) -> dict[str, Any]:
    """The Hugging Face folder, our export, genai's, the GGUF file, and prompts with their reference
    tokens (``generate`` alone; prompts whose greedy tokens end early are skipped, so every request
    asks for and gets the same number of tokens from every contender)."""
    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate
    from rmsnorm_deploy.exporter.hf import from_config

    loaded = from_config(MODELS[key], "float32", seed=0)
    hf_dir = tmp / f"{key}-hf"
    save_hf(loaded, hf_dir)
    write_sentencepiece(hf_dir, loaded.vocab_size)
    made = {"hf": hf_dir, "ours": export_folder(hf_dir, tmp / f"{key}-ours", "--target", "onnxruntime")}
    made["genai"] = build_genai(hf_dir, tmp / f"{key}-genai", tmp / f"{key}-genai-cache")
    made["gguf"] = to_gguf(llama_cpp, hf_dir, tmp / f"{key}.gguf") if llama_cpp else None
    rng = np.random.default_rng(0)
    prompts, want = [], []
    with KVCacheModel(made["ours"], intra_op_threads=THREADS) as model:
        while len(prompts) < 8:
            prompt = rng.integers(3, loaded.vocab_size, args.prompt).tolist()
            tokens = generate(model, [prompt], max_new_tokens=args.new_tokens).tokens[0]
            if len(tokens) == args.new_tokens:
                prompts.append(prompt)
                want.append(tokens)
    made["prompts"], made["want"] = prompts, want
    return made


# -- the contenders: one cell (one N) each ------------------------------------------------------------
def start_ours(made: dict[str, Any], args: argparse.Namespace) -> Any:
    """Our server for every N of a model: as many slots as the most clients, each of prompt + new tokens."""
    slot = args.prompt + args.new_tokens
    served = start_serve_process(made["ours"], timeout_s=300, args=[
        "--max-batch", str(max(args.clients)), "--max-queue", "0",
        "--max-tokens-in-flight", str(max(args.clients) * slot), "--prefill-chunk", str(args.prefill_chunk)])
    log("  " + next(line.strip() for line in served.log if "continuous batching" in line or "one stream" in line))
    return served


def cell_ours(served: Any, made: dict[str, Any], args: argparse.Namespace, n: int) -> dict[str, Any]:
    wall, results = run_clients(grpc_stream_call(served.grpc, args.new_tokens), made["prompts"], n, args.requests)
    wrong = sum(tokens != made["want"][k] for k, (tokens, _, _) in results)
    return {**summary(wall, results), "wrong_streams": wrong, "results": results}


def cell_llama(made: dict[str, Any], args: argparse.Namespace, n: int, llama_cpp: Path) -> dict[str, Any]:
    """llama-server started for this N (``--parallel`` is a start option), then stopped."""
    port = free_ports(1)[0]
    server = subprocess.Popen(
        [str(llama_cpp / "build/bin/llama-server"), "-m", str(made["gguf"]), "--host", "127.0.0.1", "--port",
         str(port), "-t", str(THREADS), "-tb", str(THREADS), "--parallel", str(n),
         "-c", str(n * (args.prompt + args.new_tokens)), "-ngl", "0", "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_http(port, server)
        wall, results = run_clients(llama_stream_call(port, args.new_tokens), made["prompts"], n, args.requests)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
    return {**summary(wall, results), "results": results}


def wait_http(port: int, server: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode}: {server.stderr.read()[-500:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("llama-server was not ready in time")


def cell_genai(model: Any, made: dict[str, Any], args: argparse.Namespace, n: int) -> dict[str, Any]:
    """One batched Generator of N rows per request round: every row's first token after the
    prefill, then one token per step."""
    import onnxruntime_genai as og

    results, wall = [], 0.0
    warm = og.GeneratorParams(model)  # one untimed run at this batch size first (its buffers)
    warm.set_search_options(do_sample=False, max_length=args.prompt + 2, min_length=args.prompt + 2, batch_size=n)
    generator = og.Generator(model, warm)
    generator.append_tokens(np.array([made["prompts"][0]] * n, dtype=np.int32))
    generator.generate_next_token()
    del generator
    for r in range(args.requests):
        rows = [(i * args.requests + r) % len(made["prompts"]) for i in range(n)]
        params = og.GeneratorParams(model)
        total = args.prompt + args.new_tokens
        params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=n)
        generator = og.Generator(model, params)
        started = time.perf_counter()
        generator.append_tokens(np.array([made["prompts"][k] for k in rows], dtype=np.int32))
        times, tokens = [], []
        for _ in range(args.new_tokens):
            generator.generate_next_token()  # the first: the prefill's logits picked; then one step each
            times.append(time.perf_counter())
            tokens.append(np.array(generator.get_next_tokens()))
        wall += times[-1] - started
        columns = np.stack(tokens, axis=1)
        results += [(k, (columns[i].tolist(), times[0] - started, list(np.diff(times)))) for i, k in enumerate(rows)]
        del generator
    return {**summary(wall, results), "results": results}


def agreement(made: dict[str, Any], results: list[tuple[int, Request]], new_tokens: int) -> float | None:
    """The share of tokens equal to ours at the same place (full-length streams only)."""
    same = [np.mean(np.array(tokens) == np.array(made["want"][k])) for k, (tokens, _, _) in results
            if len(tokens) == new_tokens]
    return float(np.mean(same)) if same else None


def pooled(cells: list[dict[str, Any]], made: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A contender's rounds at one N: the median tokens/s, latencies over every round's requests."""
    results = [item for cell in cells for item in cell.pop("results")]
    out = summary(sum(c["wall_s"] for c in cells), results)
    out["tokens_per_s"] = float(np.median([c["tokens_per_s"] for c in cells]))
    out["tokens_per_s_rounds"] = [round(c["tokens_per_s"], 1) for c in cells]
    if "wrong_streams" in cells[0]:
        out["wrong_streams"] = sum(c["wrong_streams"] for c in cells)
    else:
        out["token_agreement_with_ours"] = agreement(made, results, args.new_tokens)
    return out


def bench_model(key: str, args: argparse.Namespace, tmp: Path, llama_cpp: Path | None) -> dict[str, Any]:
    """Every round runs every N, and at each N every contender in a shuffled order."""
    import onnxruntime_genai as og

    log(f"{key}: preparing")
    made = prepare(key, args, tmp, llama_cpp)
    genai = og.Model(str(made["genai"]))
    served = start_ours(made, args)
    cells: dict[str, dict[int, list]] = {c: {n: [] for n in args.clients} for c in CONTENDERS}
    not_run: dict[str, str] = {}
    order = [OURS, GENAI] + ([LLAMA] if llama_cpp else [])
    shuffle = random.Random(0)
    try:
        for round_ in range(args.rounds):
            for n in args.clients:
                shuffle.shuffle(order)
                for contender in order:
                    try:
                        cell = (cell_ours(served, made, args, n) if contender == OURS else
                                cell_genai(genai, made, args, n) if contender == GENAI else
                                cell_llama(made, args, n, llama_cpp))
                    except RuntimeError as exc:
                        if contender == OURS:
                            raise
                        not_run[f"{contender} N={n}"] = str(exc).splitlines()[0]  # e.g. genai's batch limit
                        log(f"  round {round_ + 1} N={n} {contender}: not run ({not_run[f'{contender} N={n}']})")
                        continue
                    cells[contender][n].append(cell)
                    log(f"  round {round_ + 1} N={n} {contender}: {cell['tokens_per_s']:.0f} tokens/s")
    finally:
        served.stop(timeout_s=120)
    result: dict[str, Any] = {c: {n: pooled(cs, made, args) for n, cs in by_n.items() if cs}
                              for c, by_n in cells.items() if any(by_n.values())}
    result["not_run"] = not_run
    return result


# -- the run ----------------------------------------------------------------------------------------
def targets(result: dict[str, Any]) -> list[str]:
    """The issue's targets for one model, as measured (each line says met or missed)."""
    ours, llama = result[OURS], result.get(LLAMA) or {}
    lines = []
    if 1 in ours and 16 in ours:
        ratio = ours[16]["tokens_per_s"] / ours[1]["tokens_per_s"]
        lines.append(f"tokens/s at N=16 over N=1: {ratio:.2f}x (target >= 5.5x): {'met' if ratio >= 5.5 else 'missed'}")
        itl = ours[16]["itl_p99_ms"] / ours[1]["itl_p99_ms"]
        lines.append(f"inter-token p99 at N=16 over N=1: {itl:.2f}x (target <= 3x): {'met' if itl <= 3 else 'missed'}")
        bound = 2 * (ours[1]["ttft_p50_ms"] + 15 * ours[16]["itl_p50_ms"])
        lines.append(f"first-token p99 at N=16: {ours[16]['ttft_p99_ms']:.0f} ms (target <= 2 x (one prefill "
                     f"{ours[1]['ttft_p50_ms']:.0f} ms + 15 steps of {ours[16]['itl_p50_ms']:.1f} ms) = {bound:.0f} ms): "
                     f"{'met' if ours[16]['ttft_p99_ms'] <= bound else 'missed'}")
    for n, cell in sorted(ours.items()):
        if n in llama:
            ratio = cell["tokens_per_s"] / llama[n]["tokens_per_s"]
            lines.append(f"N={n}: ours / llama-server tokens/s {ratio:.2f}x (target >= 1): {'met' if ratio >= 1 else 'missed'}")
    wrong = sum(cell["wrong_streams"] for cell in ours.values())
    lines.append(f"wrong or lost streams: {wrong} of {sum(cell['requests'] for cell in ours.values())}")
    return lines


def markdown(results: dict[str, Any], setup: dict[str, Any]) -> str:
    md = ["# Generation serving: continuous batching against llama-server and a static batch", "",
          f"`python benchmarks/bench_generation_serving.py`: {setup['cpus']} CPUs, 2 threads per contender, "
          f"prompt {setup['prompt']} tokens, {setup['new_tokens']} new tokens, {setup['requests']} requests per "
          f"client back to back, streamed over loopback; {setup['rounds']} rounds, each running every N and at each N "
          f"every contender in a shuffled order: tokens/s is the median over rounds, latencies pooled. Load "
          f"average before/after: {setup['load']} (other jobs share the machine).", ""]
    if setup.get("llama_not_run"):
        md += [f"llama-server: {setup['llama_not_run']}.", ""]
    headers = ["clients", "contender", "tokens/s (each round)", "x N=1", "first token p50 / p99 ms", "inter-token p50 / p99 ms",
               "requests", "note"]
    for key, result in results.items():
        md += [f"## {LABELS[key]}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for n in setup["clients"]:
            for contender in CONTENDERS:
                cell = (result.get(contender) or {}).get(n)
                if cell is None:
                    continue
                base = result[contender].get(1, {}).get("tokens_per_s")
                note = (f"{cell['wrong_streams']} wrong streams" if "wrong_streams" in cell else
                        f"tokens agree with ours {100 * cell['token_agreement_with_ours']:.0f} %"
                        if cell.get("token_agreement_with_ours") is not None else "")
                rounds = " / ".join(f"{t:.0f}" for t in cell.get("tokens_per_s_rounds", []))
                md.append(f"| {n} | {contender} | {cell['tokens_per_s']:.0f} ({rounds}) | "
                          f"{cell['tokens_per_s'] / base:.1f} | ")
                md[-1] += (f"{cell['ttft_p50_ms']:.0f} / {cell['ttft_p99_ms']:.0f} | {cell['itl_p50_ms']:.1f} / "
                           f"{cell['itl_p99_ms']:.1f} | {cell['requests']} | {note} |")
        md += [""] + [f"Not run: {what}: {why}." for what, why in result.get("not_run", {}).items()]
        md += ["", "Targets (issue 23):", ""] + [f"- {line}" for line in targets(result)] + [""]
    return "\n".join(md) + "\n"


def plot(results: dict[str, Any], setup: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no PNG (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, (key, result) in zip(axes[0], results.items()):
        for contender in CONTENDERS:  # (result["not_run"] holds the reasons of missing points)
            cells = result.get(contender) or {}
            if cells:
                ns = sorted(cells)
                ax.plot(ns, [cells[n]["tokens_per_s"] for n in ns], marker="o", label=contender)
        ax.set_xscale("log", base=2)
        ax.set_xticks(setup["clients"], [str(n) for n in setup["clients"]])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("aggregate tokens / s")
        ax.set_title(LABELS[key], fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render(path: Path) -> str:
    """The Markdown of a run's JSON again (``--render``: after a change to the table's layout)."""
    data = json.loads(path.read_text())
    results = {key: {c: ({int(n): cell for n, cell in cells.items()} if c in CONTENDERS else cells)
                     for c, cells in r.items()} for key, r in data["results"].items()}
    return markdown(results, data["setup"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,125m")
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, back to back")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs every N and every contender")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=32, help="our serve's --prefill-chunk")
    parser.add_argument("--llama-cpp", type=Path, help=f"a llama.cpp checkout with build/bin/llama-server (or "
                        f"{LLAMA_CPP_ENV})")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--render", type=Path, metavar="JSON", help="only write the Markdown of a run's JSON again")
    args = parser.parse_args(argv)
    if args.render:
        (args.out_dir / "generation_serving.md").write_text(render(args.render))
        return 0
    args.clients = [int(n) for n in args.clients.split(",")]
    llama_cpp, llama_not_run = llama_cpp_dir(args.llama_cpp)
    if llama_not_run:
        log(llama_not_run)
    load_before = os.getloadavg()[0]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-generation-serving-") as tmp:
        for key in args.models.split(","):
            results[key] = bench_model(key, args, Path(tmp), llama_cpp)
    setup = {"clients": args.clients, "requests": args.requests, "rounds": args.rounds, "prompt": args.prompt, "new_tokens": args.new_tokens,
             "prefill_chunk": args.prefill_chunk, "cpus": os.cpu_count(), "threads": THREADS,
             "load": f"{load_before:.2f} / {os.getloadavg()[0]:.2f}", "llama_not_run": llama_not_run,
             "llama_cpp": str(llama_cpp) if llama_cpp else None}
    env = {"python": platform.python_version(), "machine": platform.machine(),
           **{p: package_version(p) for p in ("onnxruntime", "onnxruntime-genai", "nvidia-pytriton", "tritonclient")}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data = {"setup": setup, "environment": env,
            "results": {k: {c: ({str(n): cell for n, cell in cells.items()} if c in CONTENDERS else cells)
                            for c, cells in r.items()} for k, r in results.items()},
            "targets": {k: targets(r) for k, r in results.items()}}
    (args.out_dir / "generation_serving.json").write_text(json.dumps(data, indent=1) + "\n")
    text = markdown(results, setup)
    (args.out_dir / "generation_serving.md").write_text(text)
    plot(results, setup, args.out_dir / "generation_serving.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
