"""200 ``response_format: json_schema`` chat requests against ``serve`` with its defaults, through the
official ``openai`` client: every answer must parse and validate against the schema (``jsonschema``),
and what constrained decoding costs per token as served.

Not a test. ``--model`` is a ``--kv-cache --target onnxruntime`` export with a chat template (real
SmolLM2-135M-Instruct in the results), served by ``rmsnorm-deploy serve DIR --openai-port P`` in a
child process on loopback. Two parts:

- validity: ``--requests`` requests (default 200), ``--concurrency`` at once, each asking for a
  fictional person as JSON (a different person number and ``seed`` each, ``temperature`` 0.7);
  the answer's ``finish_reason``, whether it parses, whether it validates;
- cost per token: ``--pairs`` pairs of one streamed request at a time, the same prompt constrained
  and not (``ignore_eos``, the same ``max_tokens`` as the constrained answer's length), in a shuffled
  order; milliseconds per token after the first (the decode, as the client sees it).

Writes ``benchmarks/results/json_schema_serving.{json,md}``.

    python benchmarks/bench_json_schema_serving.py --model DIR [--requests 200] [--concurrency 8]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.serving.triton.process import free_ports, start_serve_process  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Leeds", "York", "Sheffield", "Oslo", "Lyon"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    "member": {"type": "boolean"}}, "required": ["name", "age", "city", "hobbies", "member"],
    "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 160


def _messages(number: int) -> list[dict]:
    return [{"role": "user", "content": f"Invent person number {number} for a story: their name, age, city, "
                                        "hobbies, and whether they are a club member. Answer in JSON."}]


def validity(client, model: str, requests: int, concurrency: int) -> list[dict]:
    import jsonschema

    def one(i: int) -> dict:
        started = time.perf_counter()
        answer = client.chat.completions.create(model=model, messages=_messages(i), response_format=FORMAT,
                                                temperature=0.7, seed=i, max_tokens=MAX_TOKENS)
        text = answer.choices[0].message.content
        row = {"i": i, "finish_reason": answer.choices[0].finish_reason, "tokens": answer.usage.completion_tokens,
               "s": round(time.perf_counter() - started, 3), "parses": False, "valid": False, "text": text}
        try:
            value = json.loads(text)
            row["parses"] = True
            jsonschema.validate(value, SCHEMA)
            row["valid"] = True
        except (ValueError, jsonschema.ValidationError) as exc:
            row["error"] = str(exc).splitlines()[0]
        return row

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(requests)))


def per_token(client, model: str, pairs: int) -> dict[str, list[float]]:
    """ms per token after the first, one streamed request at a time, constrained and not."""
    shuffler, out = random.Random(0), {"json_schema": [], "unconstrained": []}

    def streamed(i: int, constrained: bool, max_tokens: int) -> tuple[float, int]:
        extra = {"response_format": FORMAT} if constrained else {"extra_body": {"ignore_eos": True}}
        stream = client.chat.completions.create(model=model, messages=_messages(1000 + i), temperature=0,
                                                max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True}, **extra)
        first = last = None
        tokens = 0
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            elif chunk.choices and chunk.choices[0].delta.content:
                first = first or now
                last = now
        return (last - first) * 1e3 / max(tokens - 1, 1), tokens

    for i in range(pairs):
        _, length = streamed(i, True, MAX_TOKENS)  # the constrained answer's length, for both
        for kind in shuffler.sample(list(out), 2):
            ms, _ = streamed(i, kind == "json_schema", max(length, 2))
            out[kind].append(ms)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    import openai

    load_before = os.getloadavg()
    (port,) = free_ports(1)
    served = start_serve_process(args.model, timeout_s=300, args=["--openai-port", str(port)])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        started = time.perf_counter()
        rows = validity(client, model, args.requests, args.concurrency)
        wall = time.perf_counter() - started
        costs = per_token(client, model, args.pairs)
    finally:
        served.stop()
    med = statistics.median
    valid = sum(r["valid"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "onnxruntime": package_version("onnxruntime"),
           "llguidance": package_version("llguidance"), "openai": package_version("openai")}
    load = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    result = {"setup": {"model": str(args.model), "requests": args.requests, "concurrency": args.concurrency,
                        "max_tokens": MAX_TOKENS, "schema": SCHEMA, "load_average_before_after": load},
              "environment": env, "valid": valid, "parsed": sum(r["parses"] for r in rows),
              "finish_reasons": {k: sum(r["finish_reason"] == k for r in rows)
                                 for k in {r["finish_reason"] for r in rows}},
              "wall_s": round(wall, 1), "tokens": tokens,
              "ms_per_token": {k: [round(x, 2) for x in v] for k, v in costs.items()},
              "answers": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "json_schema_serving.json").write_text(json.dumps(result, indent=1) + "\n")
    constrained, free = med(costs["json_schema"]), med(costs["unconstrained"])
    lengths = sorted(r["tokens"] for r in rows)
    md = ["# 200 JSON-schema requests through the openai client (`bench_json_schema_serving.py`)", "",
          f"{env['cpus']} CPUs (shared: 1-minute load {load[0]} before, {load[1]} after), onnxruntime "
          f"{env['onnxruntime']}, llguidance {env['llguidance']}, openai {env['openai']}; `{args.model.name}` served "
          f"by `rmsnorm-deploy serve DIR --openai-port P` (its defaults). Chat requests with `response_format` "
          f"`json_schema` (5 required fields: a string of 2-24 characters, an integer 0-120, an enum, an array of "
          f"1-3 short strings, a boolean; `additionalProperties: false`), `temperature` 0.7, a seed each, "
          f"`max_tokens` {MAX_TOKENS}, {args.concurrency} at once.", "",
          "| requests | parse | validate (jsonschema) | finish reasons | new tokens (min / median / max) | wall s "
          "| tok/s |",
          "|---|---|---|---|---|---|---|",
          f"| {args.requests} | {result['parsed']} | **{valid}** | "
          f"{', '.join(f'{k} {v}' for k, v in sorted(result['finish_reasons'].items()))} | "
          f"{lengths[0]} / {med(lengths):.0f} / {lengths[-1]} | {wall:.0f} | {tokens / wall:.1f} |", "",
          f"## Cost per token as served ({args.pairs} pairs, one streamed request at a time, same prompt and length)",
          "", "| | ms per token after the first (median) | each pair |", "|---|---|---|",
          f"| json_schema | {constrained:.1f} | {', '.join(f'{x:.0f}' for x in costs['json_schema'])} |",
          f"| unconstrained (`ignore_eos`) | {free:.1f} | {', '.join(f'{x:.0f}' for x in costs['unconstrained'])} |",
          f"| constrained / unconstrained | {constrained / free:.2f}x | |", ""]
    failures = [r for r in rows if not r["valid"]]
    if failures:
        md += ["Answers that failed:", "", *[f"- #{r['i']} ({r['finish_reason']}): {r.get('error', '')}: "
                                            f"`{r['text'][:120]}`" for r in failures[:10]], ""]
    (args.out_dir / "json_schema_serving.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if valid == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
