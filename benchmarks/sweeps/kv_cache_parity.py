"""Parity of `export --kv-cache` graphs: generation against transformers with its own cache, and onnxruntime-genai.

For each family (tiny random models from their configs, norm gains perturbed): export with
--kv-cache (default graph, and --fuse-attention for Llama), then greedy generation of 32 new
tokens at batch 1 and at batch 3 with left padding, by our loop in ONNX Runtime CPU and by
transformers' generate(do_sample=False); the per-step logits of our loop against transformers
fed the same tokens with its DynamicCache; onnxruntime-genai on the folder, unmodified (batch 1).
float16 for Llama: tokens against torch float16 on the rows where torch float16 and float32
agree. Writes benchmarks/results/kv_cache_parity.{json,md}.

    python -m benchmarks.sweeps.kv_cache_parity [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rmsnorm_deploy.decoder.convention import left_padded
from rmsnorm_deploy.decoder.export import export_decoder
from rmsnorm_deploy.decoder.generate import KVCacheModel, generate
from rmsnorm_deploy.decoder.transformers_step import transformers_generate, transformers_steps
from rmsnorm_deploy.exporter.hf import TINY_CONFIGS, from_config
from rmsnorm_deploy.exporter.plan import ExportOptions

ROOT = Path(__file__).resolve().parents[2]

NEW = 32
PROMPTS = {1: [[5, 17, 99, 3, 250, 41, 7]], 3: [[5, 17, 99, 3, 250, 41, 7], [11, 12, 13], [200, 1, 64, 64, 9]]}
CASES = [("llama", "float32", False), ("llama", "float32", True), ("qwen3", "float32", False),
         ("gemma3", "float32", False), ("olmo2", "float32", False), ("llama", "float16", False)]


def genai_tokens(folder, prompt):
    """onnxruntime-genai's greedy tokens from the folder, or None where it is not installed."""
    from rmsnorm_deploy.errors import MissingDependencyError
    from rmsnorm_deploy.decoder.genai_client import genai_greedy

    try:
        return genai_greedy(folder, prompt, NEW)
    except MissingDependencyError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-parity-") as tmp:
        for family, dtype, fuse in CASES:
            folder = Path(tmp) / f"{family}-{dtype}-{fuse}"
            clock = time.perf_counter()
            result = export_decoder(from_config(TINY_CONFIGS[family], dtype), folder / "model.onnx",
                                  ExportOptions(dtype=dtype, fuse_attention=fuse))
            export_s = time.perf_counter() - clock
            model = from_config(TINY_CONFIGS[family], dtype).module.model
            full = from_config(TINY_CONFIGS[family], "float32").module.model if dtype != "float32" else None
            row = {"family": family, "dtype": dtype, "fuse_attention": fuse, "export_s": round(export_s, 1),
                   "export_parity": result.parity.status, "norm_nodes": len(result.detection.norms)}
            with KVCacheModel(folder) as kv:
                pad = kv.special["pad_token_id"]
                for batch, prompts in PROMPTS.items():
                    ours = generate(kv, prompts, max_new_tokens=NEW, return_logits=True)
                    ids, mask = left_padded(prompts, pad)
                    theirs = transformers_generate(model, ids, mask, max_new_tokens=NEW, pad_token_id=pad).tolist()
                    ref = transformers_steps(model, ids, mask, tokens=ours.tokens).step_logits
                    diff = max(float(np.abs(a - b).max()) for a, b in zip(ours.step_logits, ref))
                    if full is not None:
                        theirs32 = transformers_generate(full, ids, mask, max_new_tokens=NEW, pad_token_id=pad).tolist()
                        agree = [r for r in range(batch) if theirs[r] == theirs32[r]]
                        same = all(ours.tokens[r] == theirs[r] for r in agree)
                        row[f"b{batch}_rows_compared"] = f"{len(agree)}/{batch}"
                    else:
                        same = ours.tokens == theirs
                    row[f"b{batch}_tokens_equal"] = same
                    row[f"b{batch}_max_abs_step_logits"] = diff
                    row[f"b{batch}_decode_ms_per_token"] = round(ours.decode_ms_per_token, 3)
                genai = genai_tokens(folder, PROMPTS[1][0]) if dtype == "float32" else None
                row["genai_tokens_equal"] = (None if genai is None else
                                             genai == generate(kv, PROMPTS[1], max_new_tokens=NEW).tokens[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "onnxruntime": __import__("onnxruntime").__version__, "new_tokens": NEW, "prompts": PROMPTS}
    (args.out_dir / "kv_cache_parity.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["| family | dtype | graph | export parity | tokens = transformers (b1 / b3 left-padded) | "
             "max abs step logits (b1 / b3) | onnxruntime-genai tokens equal |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b3 = "yes" if r["b3_tokens_equal"] else "NO"
        if "b3_rows_compared" in r:
            b3 += f" ({r['b3_rows_compared']} rows where torch fp16 = fp32)"
        genai = {True: "yes", False: "NO", None: "n/a"}[r["genai_tokens_equal"]]
        lines.append(f"| {r['family']} | {r['dtype']} | {'--fuse-attention' if r['fuse_attention'] else 'default'} | "
                     f"{r['export_parity']} | {'yes' if r['b1_tokens_equal'] else 'NO'} / {b3} | "
                     f"{r['b1_max_abs_step_logits']:.2g} / {r['b3_max_abs_step_logits']:.2g} | {genai} |")
    (args.out_dir / "kv_cache_parity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
