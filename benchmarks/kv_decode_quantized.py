"""``bench_kv_decode.py --quantized``: weight-only int8/int4 decoding on CPU against onnxruntime-genai and llama.cpp.

Not a test. Per model (the tiny Llama, the ~125M Llama, a LLaMA-3.2-1B-shaped model), float32
activations, prompt 128, 64 greedy new tokens, batch 1, 2 threads, in interleaved rounds (the order
rotates each round):

* ``ours int8`` / ``ours int4`` / ``ours int4-mixed`` / ``ours int4-fit`` / ``ours int4-auto-zp`` /
  ``ours int4-gptq``: ``export --kv-cache --target onnxruntime --quantize RECIPE --quantize-lm-head
  --share-buffer`` (block 32, accuracy_level 4: the defaults; the mixed, fitted and measured recipes
  quantize the head at 8 bits whatever the flag, int4-gptq's per channel on int8 rows), decoded by
  our loop (``decoder/loop.py``: IOBinding);
* ``genai int4``: onnxruntime-genai's model builder (``-p int4 -e cpu``) in its own runtime;
* ``llama.cpp F32 / F16 / Q8_0 / Q4_0 / Q4_K_M``: ``convert_hf_to_gguf.py --outtype f32|f16|q8_0`` and
  ``llama-quantize ... Q4_0|Q4_K_M`` from the same Hugging Face folder, timed by ``llama-bench -t 2``:
  ``-p 128 -n 0`` for the prefill and ``-n 64 -d 128`` for decode (64 tokens after a 128-token
  context, as ours). The llama.cpp build this was written against crashes in its repacked CPU
  kernels (ggml's extra buffer types) on any batched prompt of a quantized model, so every run
  passes ``--repack 0``; ``llama.cpp Q4_0 repacked``, ``Q4_K_M repacked`` and ``Q8_0 repacked`` time decode alone at
  depth 0 with them (no prompt to crash on), to show what repacking buys.

llama.cpp comes from ``--llama-cpp DIR`` or ``$LLAMA_CPP_DIR`` (the source tree with
``build/bin/llama-bench``, ``llama-quantize`` and ``convert_hf_to_gguf.py``; the converter needs the
pip packages gguf and sentencepiece); without it those contenders are recorded as not run, and why.
Ratios are paired by round: ours over the fastest other contender at the same bits. ``--only NAMES
--tag TAG`` times a subset (for example the measured recipes at the 1B shape beside Q4_K_M) into
``kv_decode_quantized_cpu_TAG.*``, the whole table kept.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench_kv_decode import (
    NEW_TOKENS,
    PROMPT,
    ROOT,
    THREADS,
    GenaiRuntime,
    build_genai,
    decode_profile,
    log,
    ours_runner,
    runner_call,
)

LLAMA_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=512,
                tie_word_embeddings=True, rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
OURS = {"ours int8": "int8", "ours int4": "int4", "ours int4-mixed": "int4-mixed", "ours int4-fit": "int4-fit",
        "ours int4-auto-zp": "int4-auto-zp", "ours int4-gptq": "int4-gptq"}
GENAI = "genai int4"
LLAMA_CPP = {"llama.cpp F32": "f32", "llama.cpp F16": "f16", "llama.cpp Q8_0": "q8_0", "llama.cpp Q4_0": "q4_0",
             "llama.cpp Q4_K_M": "q4_k_m"}
REPACKED = {"llama.cpp Q8_0 repacked": "q8_0", "llama.cpp Q4_0 repacked": "q4_0", "llama.cpp Q4_K_M repacked": "q4_k_m"}
#: The contenders holding weights of the same width as ours (ours over each, paired by round).
GROUPS = {"ours int8": ("llama.cpp Q8_0", "llama.cpp Q8_0 repacked"),
          "ours int4": (GENAI, "llama.cpp Q4_0", "llama.cpp Q4_0 repacked"),
          "ours int4-mixed": ("llama.cpp Q4_K_M", "llama.cpp Q4_K_M repacked"),
          "ours int4-fit": ("llama.cpp Q4_K_M", "llama.cpp Q4_K_M repacked", "ours int4-mixed"),
          "ours int4-auto-zp": ("llama.cpp Q4_K_M", "llama.cpp Q4_K_M repacked", "ours int4-mixed"),
          "ours int4-gptq": ("llama.cpp Q4_K_M", "llama.cpp Q4_K_M repacked", "ours int4-mixed")}


def llama_cpp_dir(given: str | None) -> tuple[Path | None, str]:
    """The llama.cpp tree (``--llama-cpp`` or ``$LLAMA_CPP_DIR``), or None and why not."""
    where = given or os.environ.get("LLAMA_CPP_DIR")
    if not where:
        return None, "no llama.cpp: give --llama-cpp DIR or set LLAMA_CPP_DIR (a source tree with build/bin/llama-bench)"
    root = Path(where)
    missing = [p for p in ("build/bin/llama-bench", "build/bin/llama-quantize", "convert_hf_to_gguf.py")
               if not (root / p).is_file()]
    if missing:
        return None, f"llama.cpp at {root} has no {', '.join(missing)}: build it (cmake) first"
    return root, ""


def save_hf_bpe(loaded: Any, folder: Path) -> None:
    """The model and a byte-fallback BPE tokenizer of its vocabulary (what llama.cpp's converter reads
    for a Llama; onnxruntime-genai's builder copies it)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    loaded.module.model.save_pretrained(folder)
    special = {0: "<unk>", 1: "<s>", 2: "</s>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(loaded.vocab_size)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<unk>").save_pretrained(folder)


def gguf_files(llama: Path, hf_dir: Path, out: Path) -> dict[str, Path]:
    """GGUF files of ``hf_dir`` at every type (Q4_0 quantized from F32 by llama-quantize)."""
    files = {}
    for kind in ("f32", "f16", "q8_0"):
        files[kind] = out / f"model-{kind}.gguf"
        subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", kind,
                        "--outfile", str(files[kind])], check=True, capture_output=True, text=True)
    for kind in ("q4_0", "q4_k_m"):
        files[kind] = out / f"model-{kind}.gguf"
        subprocess.run([str(llama / "build/bin/llama-quantize"), str(files["f32"]), str(files[kind]), kind.upper()],
                       check=True, capture_output=True, text=True)
    return files


def llama_bench(llama: Path, gguf: Path, args: list[str]) -> float:
    """Tokens per second of one ``llama-bench`` test (one repetition)."""
    proc = subprocess.run([str(llama / "build/bin/llama-bench"), "-m", str(gguf), "-t", str(THREADS), "-r", "1",
                           "-o", "jsonl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench {' '.join(args)} on {gguf.name}: exit {proc.returncode}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["avg_ts"])


def llama_cpp_call(llama: Path, gguf: Path, *, repack: bool) -> Callable[[np.ndarray], tuple[float, float | None]]:
    """(decode ms/token, prefill ms) of llama.cpp on ``gguf`` (prefill None for the repacked decode-only run)."""
    def call(_ids: np.ndarray) -> tuple[float, float | None]:
        if repack:
            return 1e3 / llama_bench(llama, gguf, ["-p", "0", "-n", str(NEW_TOKENS)]), None
        prefill = PROMPT * 1e3 / llama_bench(llama, gguf, ["-p", str(PROMPT), "-n", "0", "--repack", "0"])
        decode = 1e3 / llama_bench(llama, gguf, ["-p", "0", "-n", str(NEW_TOKENS), "-d", str(PROMPT), "--repack", "0"])
        return decode, prefill
    return call


def ours_call(runner_fn: Callable[[np.ndarray], Any]) -> Callable[[np.ndarray], tuple[float, float]]:
    def call(ids: np.ndarray) -> tuple[float, float]:
        _tokens, prefill, steps = runner_fn(ids)
        return 1e3 * sum(steps) / len(steps), 1e3 * prefill
    return call


def export_ours(hf_dir: Path, out: Path, scheme: str) -> Path:
    """``rmsnorm-deploy export`` as a user runs it, its parity check included (its status is recorded)."""
    clock = time.perf_counter()
    command = [sys.executable, "-m", "rmsnorm_deploy", "export", str(hf_dir), "--kv-cache", "--target", "onnxruntime",
               "--quantize", scheme, "--quantize-lm-head", "--share-buffer", "-o", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"export --quantize {scheme} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    log(f"  export --quantize {scheme}: {time.perf_counter() - clock:.1f}s (exit {proc.returncode})")
    return out


def parity_of(out: Path) -> dict[str, Any]:
    report = json.loads((out / "report.json").read_text())["parity"]
    return {k: report.get(k) for k in ("status", "kind", "tokens_equal", "near_ties", "tolerance")} | {
        "vs_unquantized": report.get("vs_unquantized")}


def quantized_matmuls(path: Path) -> list[list[Any]]:
    import onnx

    from rmsnorm_deploy.graph.quantized import matmul_rows, matmul_weights

    return matmul_rows(matmul_weights(onnx.load(str(path), load_external_data=False)))


def bench_quantized_model(key: str, config: dict[str, Any], label: str, rounds: int, tmp: Path,
                          llama: Path | None, only: set[str] | None = None) -> dict[str, Any]:
    """Every contender (or those named in ``only``) on one model, in interleaved rounds: decode
    ms/token and prefill ms."""
    def wanted(name: str) -> bool:
        return only is None or name in only

    from rmsnorm_deploy.decoder.ort_step import CacheLayout
    from rmsnorm_deploy.exporter import hf

    log(f"{key}: {label}")
    loaded = hf.from_config(config, "float32", seed=0)
    hf_dir = tmp / f"{key}-hf"
    save_hf_bpe(loaded, hf_dir)
    vocab, layers = loaded.vocab_size, int(config["num_hidden_layers"])
    kv, head_dim = int(config["num_key_value_heads"]), int(config["hidden_size"]) // int(config["num_attention_heads"])
    del loaded  # the exports read the folder
    layout = CacheLayout(layers=layers, kv_heads=kv, head_dim=head_dim, share_buffer=True,
                         max_length=int(config["max_position_embeddings"]))
    contenders: dict[str, Callable[[np.ndarray], tuple[float, float | None]]] = {}
    result: dict[str, Any] = {"label": label, "config": config, "graphs": {}, "parity": {}, "not_run": {},
                              "decode_profile": {}}
    ids = np.random.default_rng(1).integers(3, vocab, size=(1, PROMPT), dtype=np.int64)
    graphs = {}
    for name, scheme in OURS.items():
        if not wanted(name):
            continue
        out = export_ours(hf_dir, tmp / f"{key}-{scheme}", scheme)
        result["parity"][name] = parity_of(out)
        graphs[name] = out / "model.onnx"
        contenders[name] = ours_call(runner_call(ours_runner(out / "model.onnx", layout)))
    genai_dir = (build_genai(hf_dir, tmp / f"{key}-genai-int4", tmp / "genai-cache", precision="int4")
                 if wanted(GENAI) else None)
    if genai_dir is not None:
        graphs[f"{GENAI} (its graph in our loop)"] = genai_dir / "model.onnx"
    for name, path in graphs.items():  # kernel time per decode step: the graphs alone, less moved by the load
        result["graphs"][name] = quantized_matmuls(path)
        result["decode_profile"][name] = decode_profile(path, layout, ids, tmp)
    runtime = GenaiRuntime(genai_dir) if genai_dir is not None else None
    if runtime is not None:
        contenders[GENAI] = ours_call(runtime.greedy)
    if llama is not None:
        files = gguf_files(llama, hf_dir, tmp)
        for name, kind in LLAMA_CPP.items():
            if wanted(name):
                contenders[name] = llama_cpp_call(llama, files[kind], repack=False)
        for name, kind in REPACKED.items():
            if wanted(name):
                contenders[name] = llama_cpp_call(llama, files[kind], repack=True)
    names = list(contenders)
    times: dict[str, dict[str, list[float]]] = {n: {"decode_ms_per_token": [], "prefill_ms": []} for n in names}
    for name in names:  # warm-up
        contenders[name](ids)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            decode, prefill = contenders[name](ids)
            times[name]["decode_ms_per_token"].append(decode)
            if prefill is not None:
                times[name]["prefill_ms"].append(prefill)
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n]['decode_ms_per_token'][-1]:.2f}" for n in names))
    result["times"] = times
    result["median"] = {n: {m: round(statistics.median(v), 3) for m, v in t.items() if v} for n, t in times.items()}
    result["paired"] = paired_ratios(times)
    del runtime
    for path in tmp.glob(f"{key}-*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in tmp.glob("model-*.gguf"):
        path.unlink()
    return result


def paired_ratios(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per our contender, rival of the same width and metric: ours / theirs, one ratio per round (what
    slows a whole round cancels): the median and the rounds in which ours was the faster."""
    out = {}
    for ours, others in GROUPS.items():
        for theirs in others:
            for metric in ("decode_ms_per_token", "prefill_ms"):
                if ours not in times or theirs not in times or not times[theirs][metric]:
                    continue
                ratios = [a / b for a, b in zip(times[ours][metric], times[theirs][metric])]
                out[f"{ours} / {theirs}: {metric}"] = {"median": round(statistics.median(ratios), 3),
                                                      "ours_faster_rounds": sum(x < 1 for x in ratios),
                                                      "rounds": len(ratios)}
    return out

MODELS_Q = {"tiny": "HF Llama hidden 256, 4 layers, vocab 2048", "125m": "Llama hidden 768, 12 layers, vocab 32000 "
            "(~134M)", "1b": "LLaMA-3.2-1B shape: hidden 2048, 16 layers, GQA 32:8, vocab 128256 tied (1.24B)"}


def run_quantized(models: list[str], rounds: dict[str, int], llama_given: str | None, tmp: Path,
                  write: Callable[[dict[str, Any]], None], only: set[str] | None = None) -> dict[str, Any]:
    """Every model in turn (the contenders in ``only``, if given); the results written after each (a
    long run keeps what it measured)."""
    from bench_kv_decode import MODELS, cpu_times, steal_share

    from rmsnorm_deploy.resources import package_version

    llama, why = llama_cpp_dir(llama_given)
    configs = {"tiny": MODELS["tiny"], "125m": MODELS["125m"], "1b": LLAMA_1B}
    start = cpu_times()
    results: dict[str, Any] = {
        "environment": {"onnxruntime": package_version("onnxruntime"),
                        "onnxruntime_genai": package_version("onnxruntime-genai"), "cpu": f"{os.cpu_count()} CPUs",
                        "llama_cpp": str(llama) if llama else None, "load_before": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"threads": THREADS, "prompt": PROMPT, "new_tokens": NEW_TOKENS, "rounds": rounds,
                     "only": sorted(only) if only else None},
        "not_run": {} if llama else {"llama.cpp": why}, "models": {}}
    if not llama:
        log(f"llama.cpp contenders not run: {why}")
    for key in models:
        results["models"][key] = bench_quantized_model(key, configs[key], MODELS_Q[key], rounds[key], tmp, llama,
                                                       only)
        results["environment"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
        results["environment"]["steal_share"] = steal_share(start, cpu_times())
        write(results)
    return results


def _ms(model: dict[str, Any], name: str, metric: str) -> str:
    """The median over rounds, and the best round in brackets (on a shared machine, the round least
    slowed by other processes)."""
    value = model["median"].get(name, {}).get(metric)
    samples = model.get("times", {}).get(name, {}).get(metric) or []
    return "—" if value is None else f"{value:.2f} ({min(samples):.2f})"


def markdown_quantized(results: dict[str, Any]) -> str:
    env, settings = results["environment"], results["settings"]
    names = [n for n in (*OURS, GENAI, *LLAMA_CPP, *REPACKED)
             if any(n in model.get("median", {}) for model in results["models"].values())]
    lines = [
        "# Weight-only quantized KV-cache decoding on CPU: ours against onnxruntime-genai and llama.cpp",
        "",
        f"{env['cpu']}, {settings['threads']} threads, float32 activations, prompt {settings['prompt']}, "
        f"{settings['new_tokens']} greedy tokens, batch 1; median over interleaved rounds, the best round in "
        "brackets "
        f"({', '.join(f'{k}: {v}' for k, v in settings['rounds'].items() if k in results['models'])}"
        + (f"; only {', '.join(settings['only'])}" if settings.get("only") else "")
        + f"). onnxruntime {env['onnxruntime']}, "
        f"onnxruntime-genai {env['onnxruntime_genai']}. Ours: `export --kv-cache --target onnxruntime --quantize "
        "RECIPE --quantize-lm-head --share-buffer` (block 32, accuracy_level 4; plain int8 and int4 quantize the "
        "head at their width, the mixed and measured recipes at 8 bits, int4-gptq's per channel on int8 rows) in "
        "our loop; genai: its builder "
        "`-p int4 -e cpu` in its runtime; llama.cpp: `llama-bench -t 2`, prefill `-p 128`, decode `-n 64 -d 128`, "
        "`--repack 0` (this build crashes in its repacked kernels on a batched prompt; the `repacked` columns time "
        "decode alone at depth 0 with them). Written by `benchmarks/bench_kv_decode.py --quantized`.",
        "",
        f"Load average before / after: {env['load_before'][0]} / {env.get('load_after', ['?'])[0]}; other jobs "
        "shared the cores, so absolute times are noisy; the interleaved rounds keep the comparison fair.",
        "",
        "| model | metric | " + " | ".join(names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for model in results["models"].values():
        for metric, label in (("decode_ms_per_token", "decode ms/token"), ("prefill_ms", "prefill ms (128 tokens)")):
            lines.append(f"| {model['label']} | {label} | " + " | ".join(_ms(model, n, metric) for n in names) + " |")
    lines += ["", "Paired by round (ours / each contender of the same width; median of the per-round ratios, and "
              "the rounds in which ours was the faster):", ""]
    for model in results["models"].values():
        for what, p in model["paired"].items():
            lines.append(f"- {model['label']}: {what} = {p['median']:.3f}x (ours faster in {p['ours_faster_rounds']} "
                         f"of {p['rounds']} rounds)")
    lines += ["", "Parity of our exports (their own check against the dequantized model; what quantization cost "
              "against the unquantized one):", ""]
    for model in results["models"].values():
        for name, p in model["parity"].items():
            cost = p.get("vs_unquantized") or {}
            lines.append(f"- {model['label']}, {name}: {p['status']} ({p.get('kind') or 'whole model, prefill + 4 steps'}"
                         f", tolerance {p['tolerance']}); vs unquantized: max |logit difference| "
                         f"{max(cost.get('max_abs', [0])):.3g} of largest |logit| {cost.get('logit_scale', 0):.3g}, "
                         f"same greedy token in {cost.get('same_argmax', 0):.0%} of steps")
    lines += ["", "ONNX Runtime's profiler, kernel time per decode step of each graph in our loop (the graphs "
              "compared without either loop; less moved by the machine's load than wall time):", ""]
    for model in results["models"].values():
        for name, prof in model.get("decode_profile", {}).items():
            top = ", ".join(f"{op} {share:.0%}" for op, share in list(prof["share"].items())[:4])
            lines.append(f"- {model['label']}, {name}: {prof['kernel_ms_per_step']:.3f} ms ({top})")
    lines += ["", "MatMuls of each graph (count, op, weights, block size, accuracy_level, compute):", ""]
    for model in results["models"].values():
        for name, rows in model["graphs"].items():
            lines.append(f"- {model['label']}, {name}: " + "; ".join(" ".join(map(str, r)) for r in rows))
    if results.get("not_run"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in results["not_run"].items()) + "."]
    return "\n".join(lines) + "\n"
