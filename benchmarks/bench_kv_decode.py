"""KV-cache decoding in ONNX Runtime CPU: prefill ms and decode ms per token, contenders side by side.

Not a test: it measures, in one run, for a tiny Hugging Face Llama (hidden 256, 4 layers) and a
Llama-shaped ~125M model (hidden 768, 12 layers, vocabulary 32000), float32, prompt 128, 64 new
greedy tokens, batch 1 and 4:

* ``ours onnxruntime``: ``export --kv-cache --target onnxruntime`` (``decoder/ort_graph.py``),
  separate past/present, decoded by ``decoder/loop.py`` (IOBinding, caches stay OrtValues);
* ``ours onnxruntime shared``: the same graph with ``--share-buffer`` (one max-length buffer);
* ``ours onnxruntime shared, ort lowering``: ``--share-buffer --lowering ort``: the norms are ONNX
  Runtime's ops, the residual ``Add`` folded into ``SkipSimplifiedLayerNormalization``;
* ``genai builder, genai runtime``: onnxruntime-genai's model builder output (``python -m
  onnxruntime_genai.models.builder -p fp32 -e cpu``, run here into a temporary folder from the saved
  Hugging Face folder), decoded by onnxruntime-genai's own ``Generator``;
* ``genai builder, our loop``: the same graph decoded by our loop (the graph alone compared);
* ``ours onnxruntime shared, ort lowering, genai runtime``: ``rmsnorm-deploy export HF_FOLDER
  --kv-cache --target onnxruntime --share-buffer --lowering ort`` (the folder as a user gets it, its
  ``genai_config.json`` included) decoded by onnxruntime-genai's own ``Generator``: the two graphs
  under one runtime, and what a genai user who switches to our export runs;
* ``torch eager``: transformers with its ``DynamicCache``, 2 threads;
* ``ours portable``: ``rmsnorm-deploy export HF_FOLDER --kv-cache`` (the plain-ops graph, with its
  ``config.json``, tokenizer and ``genai_config.json`` beside it), decoded by our loop;
* ``ours portable --fuse-attention``: the same with opset-23 ``Attention`` taking the past and
  returning the present, and ``RotaryEmbedding``;
* with ``--optimum-python PY`` (a Python with optimum-onnx, which needs transformers < 4.58 and so
  its own environment; docs/kv-cache.md), through ``benchmarks/optimum_client.py serve`` workers
  run by PY: ``optimum generate, our portable graph`` (``ORTModelForCausalLM.from_pretrained`` on
  the folder ``ours portable`` uses, optimum's own ``generate``) and ``optimum generate, optimum
  graph`` (optimum's exporter on the Hugging Face folder, then the same). Without it they are
  recorded as not run, with the reason. A worker times its own steps (prefill: to the first
  token; decode: from there to the last), so the pipe to it is not counted.

Every ONNX Runtime session: 2 intra-op threads, ORT_ENABLE_ALL (genai's are set through its
``genai_config.json``). Rounds interleave the contenders (the order rotates each round); a
contender's prefill is its first step and its decode ms/token the mean of the 63 later steps;
the reported value is the median over rounds, with the 25th-75th percentiles; each decode step is
also timed alone, and the median step over all rounds is reported beside the mean. Every
contender must give torch's tokens (asserted; end-of-sequence ignored). ONNX Runtime's profiler then gives the op-type share of decode time.

    python benchmarks/bench_kv_decode.py [--rounds 5] [--models tiny,125m] [--batches 1,4]

Writes ``benchmarks/results/kv_decode_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from rmsnorm_deploy.resources import package_version  # noqa: E402

THREADS = 2
PROMPT, NEW_TOKENS = 128, 64
MODELS = {
    "tiny": dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "125m": dict(model_type="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12, vocab_size=32000, max_position_embeddings=512,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0),
}
LABELS = {"tiny": "HF Llama hidden 256, 4 layers, vocab 2048", "125m": "Llama hidden 768, 12 layers, vocab 32000 (~134M)"}
OURS, OURS_SHARED, PORTABLE = "ours onnxruntime", "ours onnxruntime shared", "ours portable"
PORTABLE_FUSED = "ours portable --fuse-attention"
OURS_SHARED_ORT = "ours onnxruntime shared, ort lowering"
#: Our onnxruntime-target contenders: name -> (share_buffer, lowering).
OURS_BUILDS = {OURS: (False, "function"), OURS_SHARED: (True, "function"), OURS_SHARED_ORT: (True, "ort")}
GENAI, GENAI_OURLOOP, TORCH = "genai builder, genai runtime", "genai builder, our loop", "torch eager"
#: Our export folder (``--share-buffer --lowering ort``) served by onnxruntime-genai's own runtime: the
#: graphs compared under one runtime, and what a genai user who switches to our export runs.
OURS_GENAI = "ours onnxruntime shared, ort lowering, genai runtime"
#: Every contender whose graph is ours (the "ours" side of the ratios; the portable graph included).
OURS_ALL = (*OURS_BUILDS, OURS_GENAI, PORTABLE, PORTABLE_FUSED)
OPTIMUM_OURS, OPTIMUM_OWN = "optimum generate, our portable graph", "optimum generate, optimum graph"
#: What a user runs today and would switch from (the issue's contenders): onnxruntime-genai's builder
#: output in its own runtime, optimum-onnx's export in its own generate, torch eager. "genai builder, our
#: loop" is not among them: it is our loop on genai's graph, there to compare the graphs alone.
RUN_BY_USERS = (GENAI, OPTIMUM_OWN, TORCH)
OPTIMUM_NOT_RUN = ("optimum-onnx 0.1 needs transformers < 4.58, not installable beside this package's transformers; "
                   "give --optimum-python")


#: What a contender's greedy run gives: its tokens, the prefill's seconds, each decode step's seconds.
Timed = tuple[np.ndarray, float, list[float]]


def cpu_times() -> list[int] | None:
    """The machine's CPU time counters (/proc/stat: user, nice, system, idle, iowait, irq, softirq,
    steal), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of CPU time the hypervisor gave to other machines between two readings: time no
    contender could use. (Neighbours sharing the host's memory bandwidth slow a memory-bound decode
    step too, and that no counter here shows.)"""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    total = sum(after) - sum(before)
    return round((after[7] - before[7]) / total, 3) if total > 0 else None


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ort_options(profile_prefix: str | None = None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


# -- the contenders -----------------------------------------------------------------------
def save_hf(loaded: Any, folder: Path) -> None:
    """The model and a word-level tokenizer (genai's builder needs one) as a Hugging Face folder."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    loaded.module.model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(loaded.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                         pad_token="t0").save_pretrained(folder)


def build_genai(hf_dir: Path, out: Path, cache: Path, precision: str = "fp32") -> Path:
    clock = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                           "-p", precision, "-e", "cpu", "-c", str(cache)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai's builder failed: {proc.stderr.strip().splitlines()[-1:]}")
    genai_session_options(out)
    log(f"  genai builder ({precision}): {time.perf_counter() - clock:.1f}s")
    return out


def genai_session_options(folder: Path) -> None:
    """The benchmark's ONNX Runtime settings (2 intra-op threads, ORT_ENABLE_ALL) in a folder's genai_config.json."""
    config_path = folder / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"].update(intra_op_num_threads=THREADS, graph_optimization_level="ORT_ENABLE_ALL")
    config_path.write_text(json.dumps(config, indent=1))


class GenaiRuntime:
    """onnxruntime-genai's own Generator: prefill = append_tokens + the first token."""

    def __init__(self, folder: Path):
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(str(folder))

    def greedy(self, ids: np.ndarray) -> Timed:
        og = self.og
        batch, prompt = ids.shape
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=prompt + NEW_TOKENS, min_length=prompt + NEW_TOKENS,
                                  batch_size=batch)
        gen = og.Generator(self.model, params)
        tokens = np.zeros((batch, NEW_TOKENS), np.int64)
        clock = time.perf_counter()
        gen.append_tokens(ids.astype(np.int32))
        gen.generate_next_token()
        prefill = time.perf_counter() - clock
        tokens[:, 0] = gen.get_next_tokens()
        steps = []
        for step in range(1, NEW_TOKENS):
            clock = time.perf_counter()
            gen.generate_next_token()
            tokens[:, step] = gen.get_next_tokens()
            steps.append(time.perf_counter() - clock)
        del gen
        return tokens, prefill, steps


def torch_greedy(lm: torch.nn.Module, ids: np.ndarray) -> Timed:
    """transformers with its own cache, through the decode loop every ONNX contender runs (same clock)."""
    from rmsnorm_deploy.decoder.transformers_step import transformers_steps

    run = transformers_steps(lm, ids, new_tokens=NEW_TOKENS, keep_logits=False)
    return run.tokens, run.prefill_s, run.step_s


def ours_runner(path: Path, layout: Any = None, profile_prefix: str | None = None) -> Any:
    from rmsnorm_deploy.decoder.ort_step import KVDecoderRunner

    return KVDecoderRunner(str(path), layout, threads=THREADS, session_options=ort_options(profile_prefix))


def runner_call(runner: Any) -> Callable[[np.ndarray], Timed]:
    def call(ids: np.ndarray) -> Timed:
        gen = runner.greedy(ids, new_tokens=NEW_TOKENS)
        return gen.tokens, gen.prefill_s, gen.step_s
    return call


def export_folder(hf_dir: Path, out: Path, *options: str) -> Path:
    """``rmsnorm-deploy export HF_DIR --kv-cache [OPTIONS]``: the graph and the files beside it
    (``config.json``, tokenizer, ``genai_config.json``), as a user gets them."""
    clock = time.perf_counter()
    command = [sys.executable, "-m", "rmsnorm_deploy", "export", str(hf_dir), "--kv-cache", *options, "-o", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"export --kv-cache {' '.join(options)} failed: "
                           f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    log(f"  export --kv-cache {' '.join(options)}: {time.perf_counter() - clock:.1f}s")
    return out


class OptimumWorker:
    """``benchmarks/optimum_client.py serve`` run by another Python: one greedy generation per request."""

    def __init__(self, python: str, folder: Path, *, export: bool = False):
        command = [python, str(ROOT / "benchmarks" / "optimum_client.py"), "serve", str(folder)]
        self.proc = subprocess.Popen(command + (["--export"] if export else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.model_path = Path(self._answer()["model"])

    def _answer(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the optimum worker ({self.proc.args[0]}) ended (exit {self.proc.wait()}); "
                               "see its error above")
        return json.loads(line)

    def greedy(self, ids: np.ndarray) -> Timed:
        self.proc.stdin.write(json.dumps({"ids": ids.tolist(), "new_tokens": NEW_TOKENS}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        return np.asarray(answer["tokens"], dtype=np.int64), answer["prefill_s"], answer["step_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def genai_layout(dims: Any, max_length: int) -> Any:
    from rmsnorm_deploy.decoder.ort_step import CacheLayout

    return CacheLayout(layers=dims.layers, kv_heads=dims.kv_heads, head_dim=dims.head_dim, share_buffer=True,
                       max_length=max_length)


# -- profile ------------------------------------------------------------------------------
def decode_profile(path: Path, layout: Any, ids: np.ndarray, tmp: Path) -> dict[str, Any]:
    """Kernel time of the decode steps (every run after the prefill) by op type, from ORT's profiler."""
    runner = ours_runner(path, layout, profile_prefix=str(tmp / "profile"))
    runner.greedy(ids, new_tokens=NEW_TOKENS)
    profile_file = runner.session.end_profiling()
    events = json.load(open(profile_file))
    os.remove(profile_file)
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"])
    after_prefill = runs[0]["ts"] + runs[0]["dur"] if runs else 0
    by_op: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= after_prefill:
            by_op[e["args"]["op_name"]] += e["dur"]
    total = sum(by_op.values()) or 1
    steps = max(1, len(runs) - 1)
    return {"kernel_ms_per_step": round(total / steps / 1e3, 4),
            "share": {op: round(us / total, 4) for op, us in by_op.most_common()}}


def graph_ops(path: Path) -> dict[str, Any]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {"nodes": len(model.graph.node),
            "op_types": dict(collections.Counter(n.op_type for n in model.graph.node).most_common())}


# -- one model ----------------------------------------------------------------------------
def bench_model(key: str, args: argparse.Namespace, tmp: Path, checkpoint: Callable[[dict[str, Any]], None],
                workers: list[OptimumWorker]) -> dict[str, Any]:
    from rmsnorm_deploy.exporter import hf
    from rmsnorm_deploy.decoder.ort_graph import build_decoder
    from rmsnorm_deploy.decoder.ort_parity import audit_norms
    from rmsnorm_deploy.graph.onnx_file import save_onnx

    log(f"{key}: {LABELS[key]}")
    loaded = hf.from_config(MODELS[key], "float32", seed=0)
    lm = loaded.module.model
    hf_dir, folder = tmp / f"{key}-hf", tmp / key
    folder.mkdir()
    save_hf(loaded, hf_dir)
    max_length = PROMPT + NEW_TOKENS
    paths, decoders = {}, {}
    for name, (share, lowering) in OURS_BUILDS.items():
        dec = build_decoder(loaded, share_buffer=share, lowering=lowering,
                            max_length=MODELS[key]["max_position_embeddings"])
        audit_norms(dec.model, dec.norm_nodes)
        paths[name] = save_onnx(dec.model, folder / f"{'shared' if share else 'separate'}-{lowering}.onnx")
        decoders[name] = dec
    dims = decoders[OURS].dims
    genai_dir = build_genai(hf_dir, tmp / f"{key}-genai", tmp / "genai-cache")
    portable_dir = export_folder(hf_dir, tmp / f"{key}-portable")
    fused_dir = export_folder(hf_dir, tmp / f"{key}-portable-fused", "--fuse-attention")
    ours_genai_dir = export_folder(hf_dir, tmp / f"{key}-ours-genai", "--target", "onnxruntime", "--share-buffer",
                                   "--lowering", "ort")
    genai_session_options(ours_genai_dir)
    shared_layout = genai_layout(dims, max_length)
    from rmsnorm_deploy.decoder.ort_step import CacheLayout

    ours_shared_layout = CacheLayout(layers=dims.layers, kv_heads=dims.kv_heads, head_dim=dims.head_dim,
                                     share_buffer=True, max_length=max_length)
    contenders: dict[str, Callable[[np.ndarray], Timed]] = {
        OURS: runner_call(ours_runner(paths[OURS])),
        OURS_SHARED: runner_call(ours_runner(paths[OURS_SHARED], ours_shared_layout)),
        OURS_SHARED_ORT: runner_call(ours_runner(paths[OURS_SHARED_ORT], ours_shared_layout)),
        GENAI: GenaiRuntime(genai_dir).greedy,
        OURS_GENAI: GenaiRuntime(ours_genai_dir).greedy,
        GENAI_OURLOOP: runner_call(ours_runner(genai_dir / "model.onnx", shared_layout)),
        PORTABLE: runner_call(ours_runner(portable_dir / "model.onnx")),
        PORTABLE_FUSED: runner_call(ours_runner(fused_dir / "model.onnx")),
        TORCH: lambda ids: torch_greedy(lm, ids),
    }
    graphs = {OURS: graph_ops(paths[OURS]), OURS_SHARED_ORT: graph_ops(paths[OURS_SHARED_ORT]),
              PORTABLE: graph_ops(portable_dir / "model.onnx"),
              PORTABLE_FUSED: graph_ops(fused_dir / "model.onnx"), GENAI: graph_ops(genai_dir / "model.onnx")}
    if args.optimum_python:
        for name, folder, export in ((OPTIMUM_OURS, portable_dir, False), (OPTIMUM_OWN, hf_dir, True)):
            worker = OptimumWorker(args.optimum_python, folder, export=export)
            workers.append(worker)
            contenders[name] = worker.greedy
        graphs[OPTIMUM_OWN] = graph_ops(workers[-1].model_path)
    result: dict[str, Any] = {"label": LABELS[key], "config": MODELS[key], "graphs": graphs,
                              "lm_head": decoders[OURS].lm_head, "batches": {}}
    rounds = args.rounds if key == "tiny" else args.rounds_125m
    for batch in args.batches:
        ids = np.random.default_rng(batch).integers(3, loaded.vocab_size, size=(batch, PROMPT), dtype=np.int64)
        names = list(contenders)
        times: dict[str, dict[str, list[float]]] = {n: {"prefill_ms": [], "decode_ms_per_token": []} for n in names}
        step_ms: dict[str, list[float]] = {n: [] for n in names}  # every decode step of every round
        warm = {n: contenders[n](ids)[0] for n in names}  # warm-up, and the tokens every contender must give
        reference = warm[TORCH]
        same = {}
        for n in names:
            same[n] = bool(np.array_equal(warm[n], reference))
            assert same[n], f"{key} batch {batch}: {n} gave other tokens than torch eager"
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                if n == TORCH and r >= args.torch_rounds:
                    continue
                tokens, prefill, steps = contenders[n](ids)
                assert np.array_equal(tokens, reference), f"{key} batch {batch}: {n} changed its tokens"
                assert len(steps) == NEW_TOKENS - 1, f"{key} batch {batch}: {n} timed {len(steps)} decode steps"
                times[n]["prefill_ms"].append(1e3 * prefill)
                times[n]["decode_ms_per_token"].append(1e3 * sum(steps) / len(steps))
                step_ms[n].extend(1e3 * t for t in steps)
            log(f"  batch {batch} round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {times[n]['decode_ms_per_token'][-1]:.3f}" for n in names if times[n]["decode_ms_per_token"]))
        for n, t in times.items():  # the typical step, which a preempted step does not move
            t["decode_median_step_ms"] = [statistics.median(step_ms[n])] if step_ms[n] else []
        med = {n: {k: round(statistics.median(v), 4) for k, v in t.items() if v} for n, t in times.items()}
        # The spread over rounds (25th and 75th percentiles): how far the machine's noise moves a median.
        quartiles = {n: {k: [round(float(q), 4) for q in np.percentile(v, [25, 75])] for k, v in t.items() if v}
                     for n, t in times.items()}
        for n in names:  # for the median step: the quartiles of all steps
            if step_ms[n]:
                quartiles[n]["decode_median_step_ms"] = [round(float(q), 4) for q in np.percentile(step_ms[n], [25, 75])]
        def ratio(metric: str, others: tuple[str, ...] | None = None,
                  med: dict[str, dict[str, float]] = med) -> float:
            """Our best graph over the fastest other contender (of ``others``; None: every one not
            ours), on ``metric``'s medians."""
            theirs = min(m[metric] for n, m in med.items()
                         if n not in OURS_ALL and (others is None or n in others) and metric in m)
            return round(min(m[metric] for n, m in med.items() if n in OURS_ALL) / theirs, 3)

        fastest_other_decode = min(med[n]["decode_ms_per_token"] for n in names
                                   if n not in OURS_ALL and "decode_ms_per_token" in med[n])
        # Paired by round: our fastest graph over the fastest other one (each chosen by its median), one
        # ratio per round, so that whatever slows a whole round cancels out; their median and quartiles,
        # and in how many rounds ours was the faster. Against every other contender, and against the
        # tools a user would switch from (RUN_BY_USERS).
        paired: dict[str, dict[str, Any]] = {}
        for label, others in (("any", None), ("users", RUN_BY_USERS)):
            for metric in ("decode_ms_per_token", "prefill_ms"):
                mine = min((n for n in names if n in OURS_ALL), key=lambda n, m=metric: med[n][m])
                rivals = [n for n in names if n not in OURS_ALL and (others is None or n in others)
                          and len(times[n][metric]) == rounds]
                if not rivals:
                    continue
                theirs = min(rivals, key=lambda n, m=metric: med[n][m])
                ratios = [a / b for a, b in zip(times[mine][metric], times[theirs][metric])]
                paired[f"{metric}/{label}"] = {
                    "ours": mine, "other": theirs, "median": round(statistics.median(ratios), 3),
                    "quartiles": [round(float(q), 3) for q in np.percentile(ratios, [25, 75])],
                    "ours_faster_rounds": sum(r < 1 for r in ratios), "rounds": len(ratios)}
        result["batches"][str(batch)] = {
            "median": med, "quartiles": quartiles, "samples": {n: len(t["prefill_ms"]) for n, t in times.items()}, "same_tokens": same,
            "ours_best_decode_vs_fastest_other": ratio("decode_ms_per_token"), "paired_by_round": paired,
            "ours_best_median_step_vs_fastest_other": ratio("decode_median_step_ms"),
            "ours_best_prefill_vs_fastest_other": ratio("prefill_ms"),
            "ours_best_decode_vs_users": ratio("decode_ms_per_token", RUN_BY_USERS),
            "ours_best_median_step_vs_users": ratio("decode_median_step_ms", RUN_BY_USERS),
            "ours_best_prefill_vs_users": ratio("prefill_ms", RUN_BY_USERS),
            "ours_default_lowering_decode_vs_fastest_other": round(
                min(med[OURS]["decode_ms_per_token"], med[OURS_SHARED]["decode_ms_per_token"]) / fastest_other_decode, 3),
        }
        if args.profile:
            result["batches"][str(batch)]["decode_profile"] = {
                OURS: decode_profile(paths[OURS], None, ids, tmp),
                OURS_SHARED: decode_profile(paths[OURS_SHARED], ours_shared_layout, ids, tmp),
                OURS_SHARED_ORT: decode_profile(paths[OURS_SHARED_ORT], ours_shared_layout, ids, tmp),
                GENAI: decode_profile(genai_dir / "model.onnx", shared_layout, ids, tmp),
            }
        checkpoint(result)
    return result


# -- report -------------------------------------------------------------------------------
def _cell(batch: dict[str, Any], name: str, metric: str) -> str:
    """The median, and beside it the 25th–75th percentile range."""
    if metric not in batch["median"].get(name, {}):
        return "—"
    low, high = batch.get("quartiles", {}).get(name, {}).get(metric, [None, None])
    spread = f" ({low:.2f}–{high:.2f})" if low is not None and high is not None and low != high else ""
    return f"{batch['median'][name][metric]:.3f}{spread}"


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# KV-cache decoding, ONNX Runtime CPU",
        "",
        f"{env['cpu']}, {THREADS} threads, float32, prompt {PROMPT}, {NEW_TOKENS} greedy tokens; median of "
        f"interleaved rounds ({results['settings']['rounds']} for the tiny model, {results['settings']['rounds_125m']} "
        f"for 125M; torch eager {results['settings']['torch_rounds']}), with the 25th–75th percentile range over "
        f"rounds in brackets. onnxruntime {env['onnxruntime']}, "
        f"onnxruntime-genai {env['onnxruntime_genai']}, torch {env['torch']}, transformers {env['transformers']}. "
        "Every contender gave torch eager's tokens. Ratios: ours (the best of our graphs, in our loop or in "
        "onnxruntime-genai's runtime) / the fastest other contender of all (\"any\"; \"genai builder, our loop\" "
        "included, which compares the graphs alone), and / the fastest of what users run today and would switch "
        "from (\"users\": onnxruntime-genai's builder output in its own runtime, optimum's generate on its own "
        "export, torch eager). \"decode ms/token\" is the mean over a "
        "generation's 63 decode steps (median over rounds); \"decode, median step\" the median of every "
        "decode step of every round, which a step preempted by another process on the machine does not move.",
        "",
        f"Machine load (1-minute load average on {env['cpu']}) before / after the run: {env['load_before'][0]} / "
        f"{env.get('load_after', ['?'])[0]}"
        + (f"; the hypervisor took {env['steal_share']:.0%} of the CPU time (steal)" if env.get("steal_share") is not None
           else "")
        + ": with other jobs sharing the cores, absolute times are inflated "
        "and noisy; the interleaved rounds keep the contenders' comparison fair, not the absolute values.",
        "",
        "| model | batch | " + " | ".join(results["contenders"]) + " | ours / any | ours / users |",
        "|---|---|" + "---|" * (len(results["contenders"]) + 2),
    ]
    for key, data in results["models"].items():
        for batch, b in data["batches"].items():
            for metric, label, ratio_key in (
                    ("decode_ms_per_token", "decode ms/token", "decode"),
                    ("decode_median_step_ms", "decode, median step ms", "median_step"),
                    ("prefill_ms", "prefill ms", "prefill")):
                if f"ours_best_{ratio_key}_vs_fastest_other" not in b:
                    continue
                cells = [_cell(b, n, metric) for n in results["contenders"]]
                users = b.get(f"ours_best_{ratio_key}_vs_users")
                lines.append(f"| {data['label']}: {label} | {batch} | " + " | ".join(cells)
                             + f" | {b[f'ours_best_{ratio_key}_vs_fastest_other']:.2f}× | "
                             + (f"{users:.2f}× |" if users is not None else "— |"))
    lines += ["", "Paired by round (our fastest graph and the fastest other one, each chosen by its median; one "
              "ratio per round, so that what slows a whole round cancels; median, 25th–75th percentiles, and "
              "the rounds in which ours was the faster):", ""]
    for key, data in results["models"].items():
        for batch, b in data["batches"].items():
            for metric, p in b.get("paired_by_round", {}).items():
                what = "decode" if metric.startswith("decode") else "prefill"
                against = "users" if metric.endswith("/users") else "any"
                faster = (f"; ours faster in {p['ours_faster_rounds']} of {p['rounds']} rounds"
                          if "rounds" in p else "")
                lines.append(f"- {data['label']}, batch {batch}, {what} ({against}): {p['ours']} / {p['other']} = "
                             f"{p['median']:.3f}× ({p['quartiles'][0]:.3f}–{p['quartiles'][1]:.3f}){faster}")
    if results.get("not_run"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in results["not_run"].items()) + "."]
    if results.get("optimum"):
        lines += ["", "optimum contenders: " + ", ".join(f"{k} {v}" for k, v in results["optimum"].items()) + "."]
    lines += ["", "## Where decode time goes (ONNX Runtime profiler, share of kernel time in decode steps)", ""]
    for key, data in results["models"].items():
        for batch, b in data["batches"].items():
            for name, prof in b.get("decode_profile", {}).items():
                top = ", ".join(f"{op} {share:.0%}" for op, share in list(prof["share"].items())[:6])
                lines.append(f"- {data['label']}, batch {batch}, {name}: {prof['kernel_ms_per_step']:.3f} ms kernel "
                             f"time per step; {top}")
    lines += ["", "## Graphs", ""]
    for key, data in results["models"].items():
        for name, g in data["graphs"].items():
            ops = ", ".join(f"{op} {n}" for op, n in g["op_types"].items())
            lines.append(f"- {data['label']}, {name}: {g['nodes']} nodes ({ops})")
        lines.append(f"- LM head taken from the model structure: `{data['lm_head']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31, help="interleaved rounds, tiny model (default 31)")
    parser.add_argument("--rounds-125m", type=int, default=9, help="interleaved rounds, 125M model (default 9)")
    parser.add_argument("--torch-rounds", type=int, default=2, help="rounds that also time torch eager (default 2)")
    parser.add_argument("--models", default="tiny,125m")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--optimum-python",
                        help="a Python with optimum-onnx (its own environment, transformers < 4.58): adds optimum's "
                             "generate on our portable folder and on optimum's own graph")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quantized", action="store_true",
                        help="weight-only int8/int4: our exports against onnxruntime-genai's int4 and llama.cpp "
                             "(kv_decode_quantized.py); --models tiny,125m,1b")
    parser.add_argument("--llama-cpp", metavar="DIR", help="--quantized: the llama.cpp source tree with build/bin/"
                        "llama-bench and llama-quantize (default $LLAMA_CPP_DIR)")
    parser.add_argument("--rounds-1b", type=int, default=2, help="--quantized: interleaved rounds, 1B model")
    parser.add_argument("--only", help="--quantized: only these contenders (comma-separated names, e.g. 'ours "
                        "int4-gptq,llama.cpp Q4_K_M'); the results go to kv_decode_quantized_cpu_TAG.* (--tag)")
    parser.add_argument("--tag", help="--quantized: write kv_decode_quantized_cpu_TAG.{json,md} instead")
    args = parser.parse_args(argv)
    if args.quantized:
        return main_quantized(args)
    args.batches = [int(b) for b in args.batches.split(",")]
    optimum_versions = {}
    if args.optimum_python:
        proc = subprocess.run([args.optimum_python, "-c", "import json, optimum.version, transformers, onnxruntime; "
                               "print(json.dumps({'optimum': optimum.version.__version__, 'transformers': "
                               "transformers.__version__, 'onnxruntime': onnxruntime.__version__}))"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            parser.error(f"--optimum-python {args.optimum_python}: no optimum-onnx there "
                         f"({(proc.stderr.strip().splitlines() or ['it does not run'])[-1]})")
        optimum_versions = json.loads(proc.stdout)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    import onnxruntime

    torch.set_num_threads(THREADS)
    env = {"onnxruntime": onnxruntime.__version__, "onnxruntime_genai": package_version("onnxruntime-genai"),
           "torch": torch.__version__, "transformers": package_version("transformers"),
           "python": platform.python_version(), "cpu": f"{os.cpu_count()} CPUs ({platform.machine()})",
           "load_before": [round(x, 2) for x in os.getloadavg()]}
    results: dict[str, Any] = {"environment": env, "settings": {
        "threads": THREADS, "prompt": PROMPT, "new_tokens": NEW_TOKENS, "rounds": args.rounds,
        "rounds_125m": args.rounds_125m, "torch_rounds": args.torch_rounds, "batches": args.batches},
        "contenders": [*OURS_ALL, GENAI, GENAI_OURLOOP, TORCH]
        + ([OPTIMUM_OURS, OPTIMUM_OWN] if args.optimum_python else []), "models": {},
        "not_run": {} if args.optimum_python else {"optimum-onnx": OPTIMUM_NOT_RUN}, "optimum": optimum_versions}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    start_times = cpu_times()
    with tempfile.TemporaryDirectory(prefix="bench-kv-") as tmp:
        for key in args.models.split(","):
            def checkpoint(result: dict[str, Any], key: str = key) -> None:
                results["models"][key] = result  # after each batch: a long run keeps what it measured
                env["load_after"] = [round(x, 2) for x in os.getloadavg()]
                env["steal_share"] = steal_share(start_times, cpu_times())
                write(results, args.out_dir)

            workers: list[OptimumWorker] = []
            try:
                results["models"][key] = bench_model(key, args, Path(tmp), checkpoint, workers)
            finally:
                for worker in workers:
                    worker.close()
    print(markdown(results))
    return 0


def main_quantized(args: argparse.Namespace) -> int:
    from kv_decode_quantized import GENAI, LLAMA_CPP, OURS, REPACKED, markdown_quantized, run_quantized

    warnings.filterwarnings("ignore")
    torch.set_num_threads(THREADS)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    only = {name.strip() for name in args.only.split(",")} if args.only else None
    unknown = sorted((only or set()) - {*OURS, GENAI, *LLAMA_CPP, *REPACKED})
    if unknown:
        raise SystemExit(f"--only: no contender named {unknown[0]!r}; choose from "
                         + ", ".join([*OURS, GENAI, *LLAMA_CPP, *REPACKED]))
    if only and not args.tag:
        raise SystemExit("--only writes a partial table: give it a --tag, so the whole one is kept")
    stem = "kv_decode_quantized_cpu" + (f"_{args.tag}" if args.tag else "")

    def write_quantized(results: dict[str, Any]) -> None:
        (args.out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out_dir / f"{stem}.md").write_text(markdown_quantized(results))

    rounds = {"tiny": args.rounds, "125m": args.rounds_125m, "1b": args.rounds_1b}
    with tempfile.TemporaryDirectory(prefix="bench-kv-quantized-") as tmp:
        results = run_quantized(args.models.split(","), rounds, args.llama_cpp, Path(tmp), write_quantized, only)
    print(markdown_quantized(results))
    return 0


def write(results: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "kv_decode_cpu.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "kv_decode_cpu.md").write_text(markdown(results))


if __name__ == "__main__":
    sys.exit(main())
