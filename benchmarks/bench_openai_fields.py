"""What the OpenAI API's sampling fields cost per token on a real vocabulary (SmolLM2-135M-Instruct's
49,152 tokens): constrained decoding through llguidance (what ``serve`` uses,
``serving.engine.constraints``) against xgrammar on the same grammars and the same token choices,
and the per-token cost of logprobs and penalties (``serving.engine.sampling``).

Each constrained run picks 200 tokens (or until the grammar ends) greedily from seeded random
logits under the mask, as the engine does (mask, pick, advance); the time per token is that loop
minus nothing (an unconstrained greedy pick of the same logits is reported beside it). xgrammar is
optional (it needs torch and triton): ``PYTHONPATH=/path/to/xgrammar`` or it is said to be absent.

    python benchmarks/bench_openai_fields.py [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from rmsnorm_deploy.serving.engine.constraints import Grammars
from rmsnorm_deploy.serving.engine.sampling import Chooser, SamplingFields

SMOLLM2 = Path.home() / ".cache/rmsnorm-deploy/gguf/b179c9523d0e6a0f-SmolLM2-135M-Instruct.Q4_1"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                       "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}
CASES = {"json_object": None, "json_schema": SCHEMA, "regex": r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}\."}
TOKENS, RUNS = 200, 5
RESULTS = Path(__file__).parent / "results"


def _logits(vocab: int, steps: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((steps, vocab)).astype(np.float32)


def _run(logits: np.ndarray, mask, advance, eos: set[int]) -> tuple[list[float], list[int]]:
    times, tokens = [], []
    for row in logits:
        start = time.perf_counter()
        scores = row.astype(np.float64)
        scores[~mask()] = -np.inf
        token = int(np.argmax(scores))
        advance(token)
        times.append(time.perf_counter() - start)
        tokens.append(token)
        if token in eos:
            break
    return times, tokens


def bench_llguidance(folder: Path, vocab: int, eos: list[int]) -> dict:
    grammars = Grammars((folder / "tokenizer.json").read_text(), vocab, eos)
    out = {}
    for kind, source in CASES.items():
        per_token, compile_ms, n = [], [], 0
        for seed in range(RUNS):
            start = time.perf_counter()
            constraint = grammars.constraints(kind, source)[0]  # compiled and admitted, as serve does
            compile_ms.append(1e3 * (time.perf_counter() - start))
            times, tokens = _run(_logits(vocab, TOKENS, seed), constraint.allowed, constraint.advance, set(eos))
            per_token += times
            n += len(tokens)
        out[kind] = _summary(per_token, compile_ms, n)
    return out


def bench_xgrammar(folder: Path, vocab: int, eos: list[int]) -> dict | str:
    try:
        import transformers
        import xgrammar as xgr
    except ImportError as exc:
        return f"not installed ({exc})"
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = {}
    for kind, source in CASES.items():
        per_token, compile_ms, n = [], [], 0
        for seed in range(RUNS):
            start = time.perf_counter()
            if kind == "json_object":
                compiled = compiler.compile_json_schema(json.dumps({"type": "object"}))
            elif kind == "json_schema":
                compiled = compiler.compile_json_schema(json.dumps(source))
            else:
                compiled = compiler.compile_regex(source)
            matcher = xgr.GrammarMatcher(compiled)
            bitmask = xgr.allocate_token_bitmask(1, vocab)
            compile_ms.append(1e3 * (time.perf_counter() - start))

            def mask():
                matcher.fill_next_token_bitmask(bitmask)
                bits = bitmask.numpy()[0]
                return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)

            times, tokens = _run(_logits(vocab, TOKENS, seed), mask, matcher.accept_token, set(eos))
            per_token += times
            n += len(tokens)
        out[kind] = _summary(per_token, compile_ms, n)
    return out


def bench_unconstrained(vocab: int) -> dict:
    """Per-token cost of the pickers themselves: greedy, logprobs (top 20), penalties, sampling."""
    out = {}
    logits = _logits(vocab, TOKENS, 0)
    cases = {"greedy": SamplingFields(), "greedy + logprobs top 20": SamplingFields(logprobs=True, top_logprobs=20),
             "penalties (presence, frequency, repetition, logit_bias)":
                 SamplingFields(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                                logit_bias={5: 3.0}),
             "sampling (temperature, top_k, top_p, min_p)":
                 SamplingFields(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1)}
    for name, fields in cases.items():
        chooser = Chooser(fields, prompt=list(range(100)))
        times = []
        for row in logits:
            start = time.perf_counter()
            chooser(row[None, :])
            times.append(time.perf_counter() - start)
        out[name] = _summary(times, [0.0], len(times))
    return out


def _summary(times: list[float], compile_ms: list[float], tokens: int) -> dict:
    us = sorted(1e6 * t for t in times)
    return {"tokens": tokens, "median_us": round(statistics.median(us), 1),
            "p99_us": round(us[min(len(us) - 1, int(0.99 * len(us)))], 1),
            "compile_ms": round(statistics.median(compile_ms), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=SMOLLM2, help="a folder with tokenizer.json")
    args = parser.parse_args()
    config = json.loads((args.tokenizer / "config.json").read_text())
    vocab, eos = int(config["vocab_size"]), [int(config["eos_token_id"])]
    result = {"tokenizer": args.tokenizer.name, "vocab": vocab, "pickers": bench_unconstrained(vocab),
              "llguidance": bench_llguidance(args.tokenizer, vocab, eos),
              "xgrammar": bench_xgrammar(args.tokenizer, vocab, eos)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "openai_fields.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
