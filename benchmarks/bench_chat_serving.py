"""Chat serving as people run it, through the generation engine (library level, this process): time to
the first token of each turn of a 4-turn chat with a long system prompt with and without prompt KV
kept across requests, and tokens/s at 1/4/16 concurrent streams with the default KV budget against
the old default (every one of the 16 slots the model's whole length) and llama-server's split, with
prompt KV reuse off in all three (the throughput prompts repeat: reuse would measure the cache).

Not a test. ``--model`` is a ``--kv-cache --target onnxruntime`` export with a chat template (real
SmolLM2-135M-Instruct in the results). Rounds interleave the contenders in a shuffled order (the
machine is shared); each chat runs on a fresh engine so turn 1 is cold for both. Every answer of
the cached chat is checked token for token against the cold chat's, and every throughput stream
against ``generate`` on its prompt alone.

Writes ``benchmarks/results/chat_serving.{json,md}``.

With ``--llama-server GGUF`` it measures instead what a user of either server sees (written to
``chat_serving_served.{json,md}``): ``rmsnorm-deploy serve DIR --openai-port P`` with its defaults
beside ``llama-server -m GGUF -np 16`` (the same weights as a float32 GGUF; otherwise its defaults: the
model's context, unified KV, prompt cache on, its default threads), both in child processes on
loopback, both through ``POST /v1/completions``: 1, 4 and 16 clients at once, each one request of a
32-token prompt (token ids, different in every round so that no server reuses a prompt) for 64 new
tokens (``ignore_eos``, greedy); tokens/s = all new tokens over the wall time of the batch. Rounds
interleave the two servers in a shuffled order; every answer's token count is checked.

    python benchmarks/bench_chat_serving.py --model DIR [--rounds 3] [--new-tokens 48]
    python benchmarks/bench_chat_serving.py --model DIR --llama-server F32.gguf [--rounds 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rmsnorm_deploy.decoder.generate import KVCacheModel, generate  # noqa: E402
from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.serving.engine.engine import Engine, EngineOptions  # noqa: E402
from rmsnorm_deploy.serving.openai.text import ChatTemplate  # noqa: E402
from rmsnorm_deploy.serving.triton.process import free_ports, start_serve_process  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SYSTEM = (
    "You are Ada, the support assistant of Northwind Outfitters, a small company that sells hiking and camping "
    "gear online and in three shops (Leeds, York and Sheffield). Answer in plain, friendly English, in at most "
    "three short sentences unless the customer asks for detail. Rules you always follow: never invent an order "
    "number, a price or a delivery date; if you do not know, say so and offer to pass the question to a person. "
    "Orders ship within two working days; standard delivery takes three to five working days and costs 4.95 "
    "pounds, free above 60 pounds; express delivery takes one working day and costs 9.95 pounds. Returns are "
    "accepted within 30 days of delivery for unused items in their original packaging; the customer pays the "
    "return postage unless the item is faulty. Refunds are paid to the original payment method within five "
    "working days of the return arriving. Tents carry a two-year warranty against manufacturing faults; boots "
    "carry one year; everything else six months. We do not repair items ourselves but we can recommend a local "
    "repairer in each shop's city. Gift cards are valid for two years and cannot be exchanged for cash. Price "
    "matching: we match a UK retailer's advertised price for the same new item in stock, not marketplace sellers. "
    "Opening hours: Monday to Saturday 9:00 to 17:30, Sunday 10:00 to 16:00; closed on 25 and 26 December. The "
    "customer service line is open Monday to Friday 8:00 to 18:00. When a customer is upset, acknowledge it in "
    "one sentence before answering. Do not discuss competitors beyond price matching. Do not give medical or "
    "safety advice beyond pointing to the product's manual. Sizes: boots run half a size small, so suggest half "
    "a size up; jackets follow standard UK sizing. Loyalty scheme: one point per pound spent, 100 points give a "
    "5 pound voucher, points expire after 18 months without a purchase. Student discount: 10 percent with a "
    "valid student card, not combinable with sales. Click and collect is free and ready in two hours during "
    "opening hours. Damaged deliveries: ask for a photo of the item and the box, then offer a replacement or a "
    "full refund including postage, whichever the customer prefers. Orders can be changed or cancelled free of "
    "charge until they ship; after that, the returns policy applies. We deliver to the UK mainland only; the "
    "Highlands, the islands and Northern Ireland take two extra working days. Always end by asking whether "
    "there is anything else you can help with."
)
TURNS = ("Hi! I bought boots last week and they are too tight. Can I send them back?",
         "They were worn once on a short walk. Does that change anything?",
         "OK. And if I exchange them, which size should I pick? I have a 9 now.",
         "Great. How long would the new pair take to arrive with express delivery?")
CONCURRENCY = (1, 4, 16)
OLD_DEFAULT = "before: 16 slots x the model's length, nothing reused"
NEW_DEFAULT = "the default budget"
LLAMA_SPLIT = "256 a slot (llama-server's -c 4096 -np 16)"


def chat(model: KVCacheModel, template: ChatTemplate, *, reuse: bool, new_tokens: int) -> list[dict]:
    """The 4 turns on a fresh engine: per turn the prompt length, seconds to the first token, the tokens."""
    engine = Engine(model, EngineOptions() if reuse else EngineOptions(prefix_cache_mb=0)).start()
    engine.batch.reuse_prefixes = reuse
    messages, turns = [{"role": "system", "content": SYSTEM}], []
    try:
        for text in TURNS:
            messages.append({"role": "user", "content": text})
            ids = list(model.tokenizer.encode(template.render(messages), add_special_tokens=False).ids)
            before = engine.token_stats()
            stream = engine.submit(ids, max_new_tokens=new_tokens)
            tokens = stream.result(600)
            saved = engine.token_stats()["prefix_tokens_saved"] - before["prefix_tokens_saved"]
            turns.append({"prompt_tokens": len(ids), "reused_tokens": saved,
                          "ttft_s": stream.first_token_at - stream.submitted_at, "tokens": tokens})
            messages.append({"role": "assistant", "content": model.decode(tokens)})
    finally:
        engine.drain(0)
    return turns


_ALONE: dict[tuple, list[int]] = {}  # generate's tokens per prompt, computed once


def throughput(model: KVCacheModel, engine: Engine, clients: int, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of ``clients`` streams at once, each ``new_tokens`` long (no end of sequence)."""
    started = time.perf_counter()
    streams = [engine.submit(p, max_new_tokens=new_tokens, eos_token_id=None) for p in prompts[:clients]]
    got = [s.result(600) for s in streams]
    elapsed = time.perf_counter() - started
    for prompt, tokens in zip(prompts, got):
        key = (tuple(prompt), new_tokens)
        if key not in _ALONE:
            _ALONE[key] = generate(model, [prompt], max_new_tokens=new_tokens, eos_token_id=None).tokens[0]
        if tokens != _ALONE[key]:
            raise SystemExit("a throughput stream differs from generate on its prompt alone")
    return clients * new_tokens / elapsed


LLAMA_BIN = Path("/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server")
SERVED_PROMPT, SERVED_NEW = 32, 64


_MODEL_NAMES: dict[int, str] = {}


def _complete(port: int, prompt: list[int], new_tokens: int) -> int:
    """One greedy ``/v1/completions`` request; the new tokens the server reports."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    if port not in _MODEL_NAMES:
        connection.request("GET", "/v1/models")
        _MODEL_NAMES[port] = json.loads(connection.getresponse().read())["data"][0]["id"]
    body = json.dumps({"model": _MODEL_NAMES[port], "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                       "ignore_eos": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    if response.status != 200:
        raise SystemExit(f"port {port} answered {response.status}: {answer}")
    return answer["usage"]["completion_tokens"]


def _served_rate(port: int, prompts: list[list[int]]) -> float:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        counts = list(pool.map(lambda p: _complete(port, p, SERVED_NEW), prompts))
    elapsed = time.perf_counter() - started
    if counts != [SERVED_NEW] * len(prompts):
        raise SystemExit(f"port {port}: new tokens {counts}, expected {SERVED_NEW} each")
    return sum(counts) / elapsed


def _start_llama(gguf: Path, extra: list[str] = ()) -> tuple[subprocess.Popen, int, list[str]]:
    (port,) = free_ports(1)
    command = [str(LLAMA_BIN), "-m", str(gguf), "-np", "16", *extra, "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return process, port, command
        except OSError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"llama-server exited with {process.returncode}")
        time.sleep(0.5)
    process.kill()
    raise SystemExit("llama-server was not ready within 120 s")


def served(args: argparse.Namespace) -> int:
    """``serve`` with its defaults against ``llama-server -np 16`` over HTTP (see the module docstring)."""
    if not LLAMA_BIN.exists() and shutil.which("llama-server") is None:
        raise SystemExit(f"llama-server not found at {LLAMA_BIN}")
    load_before, shuffler = os.getloadavg(), random.Random(0)
    with KVCacheModel(args.model) as model:
        vocab = model.layout.vocab_size
    rng = random.Random(1)
    (openai_port,) = free_ports(1)
    extra = shlex.split(args.serve_args)
    ours = start_serve_process(args.model, timeout_s=300, args=["--openai-port", str(openai_port), *extra])
    llama, llama_port, llama_command = _start_llama(args.llama_server)
    ports = {"serve (defaults)": openai_port, "llama-server -np 16": llama_port}
    rates: dict[str, dict[int, list[float]]] = {k: {c: [] for c in CONCURRENCY} for k in ports}
    try:
        summary = "".join(ours.log)
        for port in ports.values():  # warm both (first runs allocate)
            _served_rate(port, [[rng.randrange(1000, vocab) for _ in range(SERVED_PROMPT)]])
        for round_ in range(args.rounds):
            for clients in CONCURRENCY:
                for name in shuffler.sample(list(ports), len(ports)):
                    prompts = [[rng.randrange(1000, vocab) for _ in range(SERVED_PROMPT)] for _ in range(clients)]
                    rates[name][clients].append(_served_rate(ports[name], prompts))
            print(f"round {round_ + 1} done: " + json.dumps({k: {c: round(v[-1], 1) for c, v in d.items()}
                                                            for k, d in rates.items()}), file=sys.stderr, flush=True)
    finally:
        ours.stop()
        llama.terminate()
        llama.wait(timeout=30)
    med = statistics.median
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "onnxruntime": package_version("onnxruntime")}
    budget = next((line.strip() for line in summary.splitlines() if "continuous batching" in line), "")
    result = {"setup": {"model": str(args.model), "gguf": str(args.llama_server), "rounds": args.rounds,
                        "prompt_tokens": SERVED_PROMPT, "new_tokens": SERVED_NEW,
                        "ours": " ".join(["rmsnorm-deploy serve", args.model.name, "--openai-port P", *extra]), "ours_budget": budget,
                        "llama_server": " ".join(Path(c).name if i == 0 else c for i, c in enumerate(llama_command)),
                        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
              "environment": env,
              "tokens_per_s": {k: {str(c): [round(x, 2) for x in v] for c, v in d.items()} for k, d in rates.items()}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "chat_serving_served.json").write_text(json.dumps(result, indent=1) + "\n")
    ours_name, llama_name = ports
    md = ["# Tokens/s as served: `serve` with its defaults against llama-server "
          "(`bench_chat_serving.py --llama-server`)",
          "", f"{env['cpus']} CPUs (shared: 1-minute load {result['setup']['load_average_before_after'][0]} before, "
          f"{result['setup']['load_average_before_after'][1]} after), onnxruntime {env['onnxruntime']}; "
          f"{args.rounds} interleaved rounds, medians (every round's ratio in brackets). Ours: "
          f"`{result['setup']['ours']}` ({budget}). llama-server: `{result['setup']['llama_server']}`. "
          f"{SERVED_PROMPT}-token prompts (token ids, new in every round), {SERVED_NEW} new tokens "
          "(`ignore_eos`, greedy), `POST /v1/completions`, all clients at once.", "",
          "| clients | llama-server tok/s | ours tok/s | ours / llama-server |", "|---|---|---|---|"]
    for c in CONCURRENCY:
        theirs, mine = med(rates[llama_name][c]), med(rates[ours_name][c])
        each = ", ".join(f"{a / b:.2f}" for a, b in zip(rates[ours_name][c], rates[llama_name][c]))
        md.append(f"| {c} | {theirs:.1f} | {mine:.1f} | {mine / theirs:.2f}x ({each}) |")
    (args.out_dir / "chat_serving_served.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48, help="new tokens of each chat turn")
    parser.add_argument("--stream-tokens", type=int, default=64, help="new tokens of each throughput stream")
    parser.add_argument("--skip", default="", help="chat or throughput: leave that part out")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--serve-args", default="",
                        help="with --llama-server: options for our serve beyond its defaults (e.g. '--max-batch 4')")
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="a GGUF of the same weights: measure serve against llama-server over HTTP instead")
    args = parser.parse_args()
    if args.llama_server is not None:
        return served(args)
    load_before, shuffler = os.getloadavg(), random.Random(0)
    ttft: dict[str, list[list[float]]] = {"cold": [[] for _ in TURNS], "prefix cache": [[] for _ in TURNS]}
    rates: dict[str, dict[int, list[float]]] = {k: {c: [] for c in CONCURRENCY} for k in (OLD_DEFAULT, NEW_DEFAULT, LLAMA_SPLIT)}
    chats, budgets = {}, {}
    with KVCacheModel(args.model) as model:
        template, refusal = ChatTemplate.load(model.folder)
        if template is None:
            raise SystemExit(refusal)
        prompts = [list(model.tokenizer.encode(template.render([{"role": "user", "content": f"Question {i}: {q}"}]),
                                               add_special_tokens=False).ids) for i, q in enumerate(TURNS * 4)]
        engines = {OLD_DEFAULT: Engine(model, EngineOptions(max_tokens_in_flight=16 * model.layout.max_length,
                                                            prefix_cache_mb=0)),
                   NEW_DEFAULT: Engine(model, EngineOptions()),
                   LLAMA_SPLIT: Engine(model, EngineOptions(max_tokens_in_flight=4096))}
        for name, engine in engines.items():  # the budget alone: the prompts repeat, so nothing is reused
            engine.batch.reuse_prefixes = False
            budgets[name] = engine.batching
            engine.start()
        for round_ in range(args.rounds):
            if "chat" not in args.skip:
                for mode in shuffler.sample(list(ttft), 2):
                    chats[mode] = chat(model, template, reuse=mode != "cold", new_tokens=args.new_tokens)
                    for turn, row in enumerate(chats[mode]):
                        ttft[mode][turn].append(row["ttft_s"])
                if [t["tokens"] for t in chats["cold"]] != [t["tokens"] for t in chats["prefix cache"]]:
                    raise SystemExit("the cached chat's tokens differ from the cold chat's")
            if "throughput" not in args.skip:
                for name in shuffler.sample(list(engines), len(engines)):
                    for clients in CONCURRENCY:
                        rates[name][clients].append(throughput(model, engines[name], clients, prompts,
                                                               args.stream_tokens))
            print(f"round {round_ + 1} done", file=sys.stderr, flush=True)
        for engine in engines.values():
            engine.drain(0)
    write(args, ttft, rates, chats, budgets, load_before)
    return 0


def write(args, ttft, rates, chats, budgets, load_before) -> None:
    med = statistics.median
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "onnxruntime": package_version("onnxruntime")}
    result = {"setup": {"model": str(args.model), "rounds": args.rounds, "turn_new_tokens": args.new_tokens,
                        "stream_new_tokens": args.stream_tokens, "system_prompt_chars": len(SYSTEM),
                        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
              "environment": env, "budgets": budgets,
              "ttft_s": {m: [[round(x, 4) for x in turn] for turn in v] for m, v in ttft.items()},
              "tokens_per_s": {k: {str(c): [round(x, 2) for x in v] for c, v in d.items()} for k, d in rates.items()},
              "turns": {m: [{k: v for k, v in t.items() if k != "tokens"} for t in rows] for m, rows in chats.items()}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "chat_serving.json").write_text(json.dumps(result, indent=1) + "\n")
    md = ["# Chat serving through the engine (`bench_chat_serving.py`, CPU)", "",
          f"{env['cpus']} CPUs (shared: 1-minute load {result['setup']['load_average_before_after'][0]} before, "
          f"{result['setup']['load_average_before_after'][1]} after), onnxruntime {env['onnxruntime']}; "
          f"`{args.model.name}`; {args.rounds} interleaved rounds, medians.", ""]
    if chats:
        md += [f"## Time to first token, 4-turn chat, {len(SYSTEM)}-character system prompt, "
               f"{args.new_tokens} new tokens a turn", "",
               "| turn | prompt tokens | reused | cold s | prefix cache s | cold / cached |", "|---|---|---|---|---|---|"]
        for i, row in enumerate(chats["prefix cache"]):
            cold, cached = med(ttft["cold"][i]), med(ttft["prefix cache"][i])
            md.append(f"| {i + 1} | {row['prompt_tokens']} | {row['reused_tokens']} | {cold:.3f} | {cached:.3f} | "
                      f"{cold / cached:.2f}x |")
        md += ["", "The cached chat's tokens equal the cold chat's, turn by turn.", ""]
    if any(v for d in rates.values() for v in d.values()):
        md += [f"## Tokens/s, concurrent streams of {args.stream_tokens} new tokens", "",
               "| streams | before | default | default / before | 256 a slot | 256 a slot / before |",
               "|---|---|---|---|---|---|"]
        for c in CONCURRENCY:
            old, new, split = (med(rates[k][c]) for k in (OLD_DEFAULT, NEW_DEFAULT, LLAMA_SPLIT))
            md.append(f"| {c} | {old:.1f} | {new:.1f} | {new / old:.2f}x | {split:.1f} | {split / old:.2f}x |")
        md += ["", *[f"- {k}: {v}" for k, v in budgets.items()], ""]
    (args.out_dir / "chat_serving.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
