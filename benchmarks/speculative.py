"""Speculative decoding on a real checkpoint: decode tokens/s with and without it, and acceptance.

Not a test: it measures ``generate`` (``decoder.generate``, batch 1, greedy, the folder's end of
sequence) on exported SmolLM2-135M-Instruct folders (``export <hf folder> --kv-cache --target
onnxruntime [--share-buffer] [--quantize int4]``), each prompt through the chat template:

* input-grounded prompts (repeat a passage, edit it lightly, extract fields from a document,
  rewrite code), where the answer copies the prompt and prompt lookup can guess it;
* open-ended prompts, where it cannot, and the adaptive k has to keep the cost down.

Modes: ``none`` (one run per token), ``ngram`` (prompt lookup), ``draft`` (a random-weight
2-layer draft with SmolLM2's vocabulary and tokenizer, written here: its proposals are almost
never right, by construction; it shows what a failing draft costs; or, with ``--draft-model DIR``,
a real one: for example the same checkpoint exported ``--quantize int4-fit``, a quantized
self-draft whose proposals are the float model's own most of the time). Rounds are interleaved
(prompt x mode inside each round) and every ratio is taken between runs of the same round, since
the machine is shared: the ratios are the result, the absolute tokens/s are context. Greedy
tokens of every mode are compared with ``none``'s.

llama.cpp's ``llama-server`` (``--spec-type ngram-simple``) beside it when ``--llama-server`` and
``--gguf`` are given: the same prompts through ``/completion`` (greedy), two servers (with and
without speculation) asked in turn; its ``timings`` give the decode tokens/s and draft acceptance.

    python benchmarks/speculative.py --model int4=DIR --model fp32=DIR [--rounds 3] [--new-tokens 160]

``--serve``: the same through ``serve``'s generation engine (``serving.engine``, in this process:
the code every front of ``serve`` submits to; HTTP would add the same cost to both sides) on the
first ``--model`` (a ``--target onnxruntime`` folder: continuous batching), with and without
``--speculative ngram``: one user alone on each prompt (decode tokens/s from the stream's first to
its last token), then ``--users`` concurrent users (the prompts in turn, all submitted at once;
total tokens/s from the first submission to the last token), speculating while at most 1 stream
decodes (the engine's rule) and, to show why it backs off, while up to every stream decodes.
Results in ``results/<out>_serve.json``; the table printed is ``results/<out>.md``'s "serve" section.

    python benchmarks/speculative.py --serve --model fp32=DIR [--rounds 3] [--users 16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

PASSAGE = (
    "The lighthouse at Cape Morrow was built in 1871 from granite quarried on the island itself. Its lamp "
    "was first fuelled by whale oil, then by kerosene, and since 1923 by electricity brought across the bay "
    "in a cable laid by the harbour board. Three keepers lived there until 1968, when the light was automated "
    "and the last keeper, Ellen Marsh, moved to the mainland. Today the tower is a museum, open from April "
    "to October, and its beam can still be seen thirty kilometres out to sea.")
DOCUMENT = (
    "INVOICE No. 2024-0193\nDate: 14 March 2024\nFrom: Harbour Supplies Ltd, 12 Quay Street, Portmore\n"
    "To: Cape Morrow Museum Trust, Lighthouse Road, Cape Morrow\nItems:\n- 4 x brass lamp fittings, 35.00 each\n"
    "- 2 x tins of marine varnish, 18.50 each\n- 1 x replacement window pane, 120.00\nTotal due: 297.00 EUR\n"
    "Payment within 30 days to account IE29 AIBK 9311 5212 3456 78.")
CODE = (
    "def total_price(items, tax):\n    s = 0\n    for it in items:\n        s = s + it.price * it.count\n"
    "    if tax:\n        s = s * 1.2\n    return s\n\n\ndef cheapest(items):\n    best = None\n    for it in items:\n"
    "        if best is None or it.price < best.price:\n            best = it\n    return best\n")
PROMPTS = {
    "repeat": ("grounded", f"Repeat the following passage word for word.\n\n{PASSAGE}"),
    "edit": ("grounded", f"Rewrite this passage, changing only 'Cape Morrow' to 'Point Sable'.\n\n{PASSAGE}"),
    "extract": ("grounded", f"From this invoice, list the invoice number, date, sender, recipient, each item "
                            f"and the total.\n\n{DOCUMENT}"),
    "code": ("grounded", f"Rewrite this Python code with the variable s renamed to subtotal and it renamed to "
                         f"item. Give the whole code.\n\n{CODE}"),
    "story": ("open", "Write a short story about a dog who learns to swim."),
    "explain": ("open", "Why do leaves change colour in autumn? Explain it simply."),
}


def chat_ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return list(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False))


def write_draft(target: Path, out: Path) -> Path:
    """A 2-layer random-weight draft with the target's vocabulary and tokenizer files."""
    import shutil

    from rmsnorm_deploy.decoder.convention import KVCacheLayout
    from rmsnorm_deploy.decoder.genai_config import write_serving_files
    from rmsnorm_deploy.decoder.ort_export import write_ort_decoder
    from rmsnorm_deploy.exporter import hf
    from rmsnorm_deploy.graph.metadata import ModelMetadata

    if (out / "model.onnx").is_file():
        return out
    config = json.loads((target / "config.json").read_text())
    config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    loaded = hf.from_config(config, "float32", seed=0)
    path = out / "model.onnx"
    decoder = write_ort_decoder(loaded, path, force=True, share_buffer=True, max_length=2048)
    write_serving_files(path, KVCacheLayout.from_dict(ModelMetadata.read(decoder.model).kv_cache), loaded.source,
                        force=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, out / name)
    return out


def one_run(model, ids, mode, draft, args) -> dict:
    from rmsnorm_deploy.decoder.generate import SpeculationOptions, generate

    spec = None if mode == "none" else SpeculationOptions("ngram" if mode == "ngram" else draft, args.k)
    result = generate(model, [ids], max_new_tokens=args.new_tokens, speculation=spec)
    tps = 1000.0 / result.decode_ms_per_token if result.steps else 0.0
    return {"tokens": result.tokens[0], "tps": tps, "spec": result.speculation}


def run_model(name: str, folder: Path, draft_dir: Path, args) -> list[dict]:
    from rmsnorm_deploy.decoder.generate import KVCacheModel

    if args.draft_for and name not in args.draft_for.split(","):
        args = argparse.Namespace(**{**vars(args), "modes": [m for m in args.modes if m != "draft"]})
    if args.ids:  # a folder without a tokenizer (the random-weight 1B shape): one prompt of token ids
        prompts = {"ids": [int(t) for t in args.ids.split(",")]}
    else:
        prompts = {p: chat_ids(folder, text) for p, (_, text) in PROMPTS.items() if p in args.prompts}
    runs: dict[tuple[str, str], list[dict]] = {}
    with KVCacheModel(folder, intra_op_threads=args.threads) as model, \
            (KVCacheModel(draft_dir, intra_op_threads=args.threads) if draft_dir else contextlib.nullcontext()) as draft:
        for p, ids in prompts.items():  # warm-up: every mode once, not counted
            for mode in args.modes:
                one_run(model, ids, mode, draft, argparse.Namespace(**{**vars(args), "new_tokens": 8}))
        for r in range(args.rounds):
            for p, ids in prompts.items():
                for mode in args.modes:
                    runs.setdefault((p, mode), []).append(one_run(model, ids, mode, draft, args))
                    print(f"[{name} round {r}] {p:8s} {mode:6s} {runs[(p, mode)][-1]['tps']:.1f} tok/s",
                          file=sys.stderr, flush=True)
    rows = []
    for p in prompts:
        base = runs[(p, "none")]
        for mode in args.modes:
            got = runs[(p, mode)]
            ratios = [g["tps"] / b["tps"] for g, b in zip(got, base) if b["tps"]]
            spec = got[-1]["spec"] or {}
            rows.append({"model": name, "prompt": p, "kind": PROMPTS.get(p, ("grounded",))[0], "mode": mode,
                         "new_tokens": len(got[-1]["tokens"]), "tokens_per_s": statistics.median(g["tps"] for g in got),
                         "ratio": statistics.median(ratios) if ratios else None,
                         "identical": all(g["tokens"] == b["tokens"] for g, b in zip(got, base)),
                         "acceptance": spec.get("acceptance_rate"), "tokens_per_pass": spec.get("tokens_per_pass")})
    return rows


def llama_rows(args) -> tuple[list[dict], str]:
    """llama-server with and without ``--spec-type ngram-simple``, asked in turn (greedy)."""
    import subprocess
    import urllib.request

    if not (args.llama_server and args.gguf):
        return [], "not run: give --llama-server and --gguf"
    servers, rows = {}, []
    flags = {"none": [], "ngram": ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(args.k)]}
    try:
        for i, (mode, extra) in enumerate(flags.items()):
            port = 8790 + i
            servers[mode] = (port, subprocess.Popen(
                [args.llama_server, "-m", args.gguf, "--port", str(port), "-t", str(args.threads), "-np", "1",
                 "-c", "4096", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 120
        for mode, (port, _) in servers.items():
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    if time.time() > deadline:
                        return [], "not run: llama-server did not start within 120 s"
                    time.sleep(1)
        folder = Path(args.model[0].split("=", 1)[1])
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
        results: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.rounds):
            for p in args.prompts:
                text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[p][1]}], tokenize=False,
                                               add_generation_prompt=True)
                for mode, (port, _) in servers.items():
                    body = json.dumps({"prompt": text, "n_predict": args.new_tokens, "temperature": 0, "top_k": 1,
                                       "cache_prompt": False, "seed": 0}).encode()
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                                 {"Content-Type": "application/json"})
                    out = json.loads(urllib.request.urlopen(req, timeout=600).read())
                    results.setdefault((p, mode), []).append(out)
        for p in args.prompts:
            for mode in servers:
                got, base = results[(p, mode)], results[(p, "none")]
                t = got[-1].get("timings", {})
                ratios = [g["timings"]["predicted_per_second"] / b["timings"]["predicted_per_second"]
                          for g, b in zip(got, base)]
                drafted, accepted = t.get("draft_n"), t.get("draft_n_accepted")
                rows.append({"model": "llama.cpp Q4_1", "prompt": p, "kind": PROMPTS[p][0], "mode": mode,
                             "new_tokens": t.get("predicted_n"),
                             "tokens_per_s": statistics.median(g["timings"]["predicted_per_second"] for g in got),
                             "ratio": statistics.median(ratios),
                             "identical": all(g["content"] == b["content"] for g, b in zip(got, base)),
                             "acceptance": (accepted / drafted) if drafted else None, "tokens_per_pass": None})
        return rows, "run"
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(timeout=30)


def serve_engines(model, args) -> dict:
    """One engine per mode on ``model``: ``none`` and ``ngram`` (speculating while at most
    ``up_to`` streams decode; ``ngram-all``: while any do)."""
    from rmsnorm_deploy.decoder.generate import SpeculationOptions
    from rmsnorm_deploy.serving.engine.engine import Engine, EngineOptions

    options = EngineOptions(max_batch=args.users, max_tokens_in_flight=args.users * args.slot_tokens)
    return {mode: Engine(model, options, speculation=None if mode == "none" else SpeculationOptions("ngram", args.k))
            .start() for mode in args.serve_modes}


def serve_one(engine, mode: str, prompts: list[list[int]], args) -> dict:
    """``prompts`` submitted at once: each stream's tokens, the decode tokens/s of the first (alone),
    the total tokens/s and the engine's speculation stats over the run."""
    from rmsnorm_deploy.serving.engine import speculation

    speculation.SPECULATE_UP_TO = args.users if mode == "ngram-all" else 1
    before = engine.speculation_stats()
    started = time.perf_counter()
    streams = [engine.submit(p, max_new_tokens=args.new_tokens) for p in prompts]
    tokens = [s.result(1200) for s in streams]
    ended = max(s.last_token_at for s in streams)
    first = streams[0]
    alone = (len(first.tokens) - 1) / (first.last_token_at - first.first_token_at) if len(first.tokens) > 1 else 0.0
    stats = engine.speculation_stats()
    delta = None
    if stats is not None:
        delta = {k: stats[k] - before[k] for k in ("proposed", "accepted", "target_passes", "tokens")}
    return {"tokens": tokens, "alone_tps": alone, "total_tps": sum(map(len, tokens)) / (ended - started), "spec": delta}


def serve_rows(args) -> list[dict]:
    from rmsnorm_deploy.decoder.generate import KVCacheModel

    name, folder = args.model[0].split("=", 1)
    ids = {p: chat_ids(Path(folder), text) for p, (_, text) in PROMPTS.items() if p in args.prompts}
    crowd = [ids[p] for p in (list(ids) * args.users)[:args.users]]
    runs: dict[tuple[str, str], list[dict]] = {}
    with KVCacheModel(folder, intra_op_threads=args.threads) as model:
        engines = serve_engines(model, args)
        try:
            for mode, engine in engines.items():  # warm-up: not counted
                serve_one(engine, mode, [ids[args.prompts[0]]], argparse.Namespace(**{**vars(args), "new_tokens": 8}))
            for r in range(args.rounds):
                for p, prompt in ids.items():
                    for mode in ("none", "ngram"):
                        runs.setdefault((p, mode), []).append(serve_one(engines[mode], mode, [prompt], args))
                        print(f"[serve round {r}] {p:8s} {mode:9s} {runs[(p, mode)][-1]['alone_tps']:.1f} tok/s",
                              file=sys.stderr, flush=True)
                for mode, engine in engines.items():
                    runs.setdefault((f"{args.users} users", mode), []).append(serve_one(engine, mode, crowd, args))
                    print(f"[serve round {r}] {args.users} users {mode:9s} "
                          f"{runs[(f'{args.users} users', mode)][-1]['total_tps']:.1f} tok/s", file=sys.stderr,
                          flush=True)
        finally:
            for engine in engines.values():
                engine.drain(0)
    rows = []
    for (what, mode), got in runs.items():
        base = runs[(what, "none")]
        key = "alone_tps" if what in ids else "total_tps"
        spec = {k: sum(g["spec"][k] for g in got) for k in got[0]["spec"]} if got[0]["spec"] else None
        rows.append({"model": name, "prompt": what, "kind": PROMPTS[what][0] if what in ids else "concurrent",
                     "mode": mode, "new_tokens": sum(map(len, got[-1]["tokens"])),
                     "tokens_per_s": statistics.median(g[key] for g in got),
                     "ratio": statistics.median(g[key] / b[key] for g, b in zip(got, base)),
                     "identical": all(g["tokens"] == b["tokens"] for g, b in zip(got, base)),
                     "acceptance": spec["accepted"] / spec["proposed"] if spec and spec["proposed"] else None,
                     "tokens_per_pass": spec["tokens"] / spec["target_passes"] if spec and spec["target_passes"]
                     else None})
    return rows


def markdown(rows: list[dict], notes: list[str]) -> str:
    lines = ["# Speculative decoding: decode tokens/s with and without it (SmolLM2-135M-Instruct, batch 1, greedy)",
             "", *notes, "",
             "| model | prompt | kind | mode | new tokens | decode tok/s | ratio to none | same tokens | acceptance "
             "| tokens/run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def f(v, fmt):
            return "" if v is None else format(v, fmt)
        lines.append(f"| {r['model']} | {r['prompt']} | {r['kind']} | {r['mode']} | {f(r['new_tokens'], 'd')} | "
                     f"{r['tokens_per_s']:.1f} | {f(r['ratio'], '.2f')} | {'yes' if r['identical'] else 'NO'} | "
                     f"{f(r['acceptance'], '.2f')} | {f(r['tokens_per_pass'], '.2f')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                        help="an exported --kv-cache folder (repeat: int4=..., fp32=...)")
    parser.add_argument("--draft-dir", type=Path, default=Path("/tmp/spec-draft"), help="where the draft is written")
    parser.add_argument("--draft-model", type=Path, help="a real draft: an exported --kv-cache folder of the same "
                        "vocabulary and tokenizer (default: a random-weight 2-layer draft written to --draft-dir)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=5, help="--speculative-k")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument("--modes", default="none,ngram,draft")
    parser.add_argument("--draft-for", default="", metavar="NAME,...",
                        help="the models the draft mode runs on (default: all)")
    parser.add_argument("--llama-server", help="llama-server binary (llama.cpp's speculation beside ours)")
    parser.add_argument("--gguf", help="the GGUF file for llama-server")
    parser.add_argument("--out", default="speculative", help="results/<out>.{md,json}")
    parser.add_argument("--serve", action="store_true", help="through serve's generation engine (see above)")
    parser.add_argument("--users", type=int, default=16, help="--serve: concurrent users (the engine's slots)")
    parser.add_argument("--slot-tokens", type=int, default=512, help="--serve: KV tokens per slot")
    parser.add_argument("--ids", help="one prompt of comma-separated token ids instead of the chat prompts (a folder "
                        "without a tokenizer); with --modes none,ngram")
    parser.add_argument("--serve-modes", default="none,ngram,ngram-all", help="--serve: the engines compared")
    args = parser.parse_args()
    args.prompts, args.modes = args.prompts.split(","), args.modes.split(",")
    if args.serve:
        args.serve_modes = args.serve_modes.split(",")
        rows = serve_rows(args)
        notes = [f"serve's generation engine in this process, {args.rounds} interleaved rounds, up to "
                 f"{args.new_tokens} new tokens a stream, k <= {args.k}, {args.threads} threads, {args.users} slots "
                 f"of {args.slot_tokens} tokens; one user: decode tokens/s of the stream; {args.users} users: total "
                 "tokens/s from the first submission to the last token. ngram: the engine's rule (speculate while "
                 "one stream decodes); ngram-all: while any number do (each in its own one-slot run). Ratios within "
                 "a round, medians shown; same tokens: greedy streams compared with none's."]
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.out}_serve.json").write_text(json.dumps({"rows": rows, "notes": notes}, indent=1))
        print(markdown(rows, notes))  # the table of results/<out>.md's "serve" section
        return 0
    rows: list[dict] = []
    first = Path(args.model[0].split("=", 1)[1])
    draft_dir = (args.draft_model or write_draft(first, args.draft_dir)) if "draft" in args.modes else None
    for spec in args.model:
        name, folder = spec.split("=", 1)
        rows += run_model(name, Path(folder), draft_dir, args)
    llama, how = llama_rows(args)
    rows += llama
    notes = [f"{args.rounds} interleaved rounds, up to {args.new_tokens} new tokens (the folder's end of sequence "
             f"stops earlier), k <= {args.k}, {args.threads} threads, a shared 2-core machine: ratios are taken "
             "within a round, medians shown.",
             (f"draft: {args.draft_model} (a real draft, checked at start: same vocabulary and tokenizer)."
              if args.draft_model else
              "draft: a random-weight 2-layer model with SmolLM2's vocabulary: its acceptance is near zero by "
              "construction (it shows the cost of a draft that fails, which the adaptive k keeps down)."),
             f"llama.cpp (llama-server --spec-type ngram-simple, same prompts, greedy): {how}."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"rows": rows, "notes": notes}, indent=1))
    (RESULTS / f"{args.out}.md").write_text(markdown(rows, notes))
    print(markdown(rows, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
