"""Multi-turn chats as served: 1, 4 and 16 users at once, each a 4-turn conversation after one shared
system prompt, against llama-server on the same weights. Per turn: time to the first token (p50 and
p99 over every user and round) and how much of the prompt was new; per user count: tokens/s.

Both servers run as their users start them, each in a child process on loopback with its defaults:
``rmsnorm-deploy serve DIR --openai-port P`` and ``llama-server -m GGUF -np 16`` (its prompt cache is
on by default). Every request is ``POST /v1/chat/completions`` with ``stream: true``,
``temperature`` 0, ``max_tokens`` ``--new-tokens`` and ``stream_options.include_usage``: the time
to the first token is the time to the first chunk with text (or with the finish reason, for an
answer that ends at once), the tokens are the server's own usage
count. A user's next turn carries the conversation so far: the system prompt
(``bench_chat_serving.SYSTEM``, about 580 tokens), every earlier question and the server's own
answers. The users differ only by the name in their first question, so the system prompt is what
they share. Rounds interleave the two servers in a shuffled order; a fresh set of names each round
keeps a server from reusing one round's conversations in the next.

    python benchmarks/chat_turns_served.py --model DIR --gguf F32.gguf [--rounds 3] [--new-tokens 32]

Writes ``results/chat_turns_served.{json,md}``. Not a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_chat_serving import SYSTEM, TURNS, _start_llama  # noqa: E402

from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.serving.triton.process import free_ports, start_serve_process  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
USERS = (1, 4, 16)
NAMES = ("Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena", "Mateo",
         "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Ximena")


class TurnFailed(Exception):
    """A streamed turn ended without an answer (the server's last line in the message)."""


def _model_name(port: int) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/v1/models")
    return json.loads(connection.getresponse().read())["data"][0]["id"]


def turn(port: int, model: str, messages: list[dict], new_tokens: int) -> dict:
    """One streamed chat turn: seconds to the first text, the text, the usage the server reports."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": new_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"port {port} answered {response.status}: {response.read()[:300]!r}")
    first, text, usage, lines = None, [], None, []
    for raw in response:
        line = raw.decode("utf-8").strip()
        lines.append(line)
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        for choice in event.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if piece or choice.get("finish_reason"):  # (an answer that is its end of sequence at once)
                first = first if first is not None else time.perf_counter() - started
            if piece:
                text.append(piece)
        usage = event.get("usage") or usage
    connection.close()
    if first is None or not usage:
        raise TurnFailed(f"port {port}: a turn without an answer or usage; its last lines: {lines[-3:]!r}")
    return {"ttft_s": first, "text": "".join(text), "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"]}


def conversation(port: int, model: str, name: str, new_tokens: int) -> list[dict]:
    """A user's 4 turns, each after the server's answers to the earlier ones."""
    messages, turns = [{"role": "system", "content": SYSTEM}], []
    for i, question in enumerate(TURNS):
        messages.append({"role": "user", "content": f"I am {name}. {question}" if i == 0 else question})
        got = turn(port, model, messages, new_tokens)
        turns.append(got)
        messages.append({"role": "assistant", "content": got["text"]})
    return turns


def users_at_once(port: int, model: str, names: list[str], new_tokens: int) -> tuple[list[list[dict]], float]:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        chats = list(pool.map(lambda n: conversation(port, model, n, new_tokens), names))
    return chats, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def render(result: dict) -> list[str]:
    """The results' Markdown. Turn 1's p50 includes later rounds and users, whose system prompt a
    server may have kept: the cold first turn is the very first conversation's (1 user, round 1)."""
    med, setup, env = statistics.median, result["setup"], result["environment"]
    ttft, new_share, rates = result["ttft_s"], result["new_share_of_prompt"], result["tokens_per_s"]
    cold = ttft["ours"]["1"][0][0]
    md = ["# Multi-turn chats as served (`chat_turns_served.py`)", "",
          f"{env['cpus']} CPUs (1-minute load {setup['load_average_before_after'][0]} before, "
          f"{setup['load_average_before_after'][1]} after), onnxruntime {env['onnxruntime']}; {setup['rounds']} "
          f"rounds, the servers in a shuffled order within each. Ours: `{setup['ours']}`; llama-server: "
          f"`{setup['llama_server']}` (both with their defaults). Each user: the shared system prompt, then 4 "
          f"questions, each answer streamed (`/v1/chat/completions`, greedy, at most {setup['new_tokens']} tokens) "
          "and carried into the next turn. Time to first token in seconds, p50 / p99 over every user and round; "
          "new: the share of the turn's prompt that is new in this conversation (median). Turn 1 shares the "
          "system prompt with every other conversation, which both servers may keep; our cold first turn (the "
          f"first conversation's, nothing kept) took {cold:.3f} s.", "",
          "| users | turn | new | llama-server p50 / p99 | ours p50 / p99 | ours / llama-server (p50) | "
          "ours / our turn 1 (p50) | ours / our cold turn 1 |", "|---|---|---|---|---|---|---|---|"]
    for users in map(str, USERS):
        first = med(ttft["ours"][users][0])
        for i in range(len(TURNS)):
            theirs, mine = ttft["llama-server"][users][i], ttft["ours"][users][i]
            md.append(f"| {users} | {i + 1} | {med(new_share['ours'][users][i]):.0%} | {med(theirs):.3f} / "
                      f"{percentile(theirs, 0.99):.3f} | {med(mine):.3f} / {percentile(mine, 0.99):.3f} | "
                      f"{med(mine) / med(theirs):.2f}x | {med(mine) / first:.2f}x | {med(mine) / cold:.2f}x |")
    md += ["", "| users | llama-server tok/s | ours tok/s | ours / llama-server (each round) |", "|---|---|---|---|"]
    for users in map(str, USERS):
        theirs, mine = rates["llama-server"][users], rates["ours"][users]
        each = ", ".join(f"{a / b:.2f}" for a, b in zip(mine, theirs))
        md.append(f"| {users} | {med(theirs):.1f} | {med(mine):.1f} | {med(mine) / med(theirs):.2f}x ({each}) |")
    return md


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a --kv-cache --target onnxruntime export")
    parser.add_argument("--gguf", type=Path, required=True, help="the same weights as a float32 GGUF")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--llama-args", default="", help="llama-server options beyond its defaults (e.g. '-c 16384')")
    parser.add_argument("--render", type=Path, help="only write the Markdown of a results JSON again")
    args = parser.parse_args()
    if args.render:
        (args.out_dir / "chat_turns_served.md").write_text("\n".join(render(json.loads(args.render.read_text()))) + "\n")
        return 0
    load_before, shuffler = os.getloadavg(), random.Random(0)
    (openai_port,) = free_ports(1)
    ours = start_serve_process(args.model, timeout_s=300, args=["--openai-port", str(openai_port)])
    llama, llama_port, llama_command = _start_llama(args.gguf, args.llama_args.split())
    ports = {"ours": openai_port, "llama-server": llama_port}
    print(f"ports: {ports}", file=sys.stderr, flush=True)
    ttft = {k: {u: [[] for _ in TURNS] for u in USERS} for k in ports}
    new_share = {k: {u: [[] for _ in TURNS] for u in USERS} for k in ports}
    rates = {k: {u: [] for u in USERS} for k in ports}
    names = iter(f"{a} {b}" for b in NAMES for a in NAMES)
    try:
        models = {k: _model_name(p) for k, p in ports.items()}
        for k, p in ports.items():  # warm both: first runs allocate
            turn(p, models[k], [{"role": "user", "content": "Hello"}], 4)
        for round_ in range(args.rounds):
            for users in USERS:
                group = [next(names) for _ in range(users)]
                for k in shuffler.sample(list(ports), len(ports)):
                    chats, wall = users_at_once(ports[k], models[k], group, args.new_tokens)
                    rates[k][users].append(sum(t["completion_tokens"] for c in chats for t in c) / wall)
                    for chat in chats:
                        for i, t in enumerate(chat):
                            ttft[k][users][i].append(t["ttft_s"])
                            before = chat[i - 1]["prompt_tokens"] + chat[i - 1]["completion_tokens"] if i else 0
                            new_share[k][users][i].append((t["prompt_tokens"] - before) / t["prompt_tokens"])
            print(f"round {round_ + 1}: " + json.dumps({k: {u: round(v[-1], 1) for u, v in d.items()}
                                                       for k, d in rates.items()}), file=sys.stderr, flush=True)
    finally:
        ours.stop()
        llama.terminate()
        llama.wait(timeout=30)
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "onnxruntime": package_version("onnxruntime")}
    setup = {"model": str(args.model), "gguf": str(args.gguf), "rounds": args.rounds, "new_tokens": args.new_tokens,
             "ours": f"rmsnorm-deploy serve {args.model.name} --openai-port P",
             "llama_server": " ".join(Path(c).name if i == 0 else c for i, c in enumerate(llama_command)),
             "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    result = json.loads(json.dumps({"setup": setup, "environment": env, "tokens_per_s": rates,  # keys as strings
                                    "ttft_s": ttft, "new_share_of_prompt": new_share}))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "chat_turns_served.json").write_text(json.dumps(result, indent=1) + "\n")
    md = render(result)
    (args.out_dir / "chat_turns_served.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
