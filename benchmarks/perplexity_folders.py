"""`rmsnorm-deploy perplexity` over the same weights in the three KV-cache folder layouts it reads.

One Hugging Face folder (default: real SmolLM2-135M-Instruct, the folder `real_checkpoints.py`
converts from its Q4_1 GGUF) becomes:

* ours: ``rmsnorm-deploy export HF --kv-cache --target onnxruntime`` (float32);
* onnxruntime-genai's: ``python -m onnxruntime_genai.models.builder -p fp32 -e cpu`` (its own graph:
  GroupQueryAttention, its fused norms);
* optimum's layout: our folder with our metadata and genai_config.json taken out (``model.onnx``
  beside ``config.json``, the names optimum-onnx's ``ORTModelForCausalLM`` export uses; optimum
  itself needs transformers < 4.58 and is not installed beside this package).

Each is scored alone and against the others with ``--kl-divergence`` on the first 4 chunks of 256
tokens of the shipped GNU GPL v3 (its first 5,200 bytes), chunk scheme and ``--stride 128``, one
ONNX Runtime thread. Writes ``results/perplexity_folders.{md,json}``.

    .venv/bin/python benchmarks/perplexity_folders.py [--hf DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SMOLLM2 = Path.home() / ".cache/rmsnorm-deploy/gguf/b179c9523d0e6a0f-SmolLM2-135M-Instruct.Q4_1"
RESULTS = Path(__file__).resolve().parent / "results"
TEXT_BYTES = 5200  # about 1,140 SmolLM2 tokens: 4 chunks of 256


def cli(*argv: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "rmsnorm_deploy", *argv], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"rmsnorm-deploy {' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout) if "--json" in argv else {}


def folders(hf: Path, work: Path) -> dict[str, Path]:
    import onnx

    from rmsnorm_deploy.graph.metadata import PREFIX

    made = {"ours": work / "ours", "genai": work / "genai", "optimum": work / "optimum"}
    if not made["ours"].is_dir():
        cli("export", str(hf), "--kv-cache", "--target", "onnxruntime", "-o", str(made["ours"]))
    if not made["genai"].is_dir():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
                        str(made["genai"]), "-p", "fp32", "-e", "cpu", "-c", str(work / "cache")], check=True,
                       capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if not made["optimum"].is_dir():
        shutil.copytree(made["ours"], made["optimum"])
        (made["optimum"] / "genai_config.json").unlink()
        model = onnx.load(str(made["optimum"] / "model.onnx"), load_external_data=False)
        kept = [p for p in model.metadata_props if not p.key.startswith(PREFIX)]
        del model.metadata_props[:]
        model.metadata_props.extend(kept)
        onnx.save(model, str(made["optimum"] / "model.onnx"))
    return made


def genai_runtime_check(folder: Path, text: Path) -> dict:
    """The first chunk's logits as onnxruntime-genai's own ``Generator`` hands them out against what
    ``perplexity`` reads from the same folder in plain ONNX Runtime."""
    import numpy as np
    import onnxruntime_genai as og

    from rmsnorm_deploy.decoder.kv_folders import open_kv_folder
    from rmsnorm_deploy.decoder.perplexity import DEFAULT_CONTEXT, chunked, read_text, session_logits, text_ids

    with open_kv_folder(folder, intra_op_threads=1) as model:
        ids, bos = text_ids(model, read_text(text))
        window = chunked(ids, DEFAULT_CONTEXT, bos)[0]
        ours = session_logits(model, DEFAULT_CONTEXT)(window)
    runtime = og.Model(str(folder))
    params = og.GeneratorParams(runtime)
    params.set_search_options(max_length=DEFAULT_CONTEXT + 1)
    generator = og.Generator(runtime, params)
    generator.append_tokens(window[None, :].astype(np.int32))
    theirs = np.asarray(generator.get_output("logits"))[0]
    return {"positions": int(theirs.shape[0]), "max_abs_difference": float(np.abs(theirs - ours).max()),
            "largest_logit": float(np.abs(ours).max())}


def write_markdown(rows: list[dict], source: str, runtime: dict | None = None) -> None:
    lines = ["| model (kind) | reference (kind) | scheme | perplexity | reference's | relative difference | KL mean "
             "| KL p99 | KL max | same top token | scored |", "|" + " --- |" * 11]
    for r in rows:
        scheme = f"windows of {r['context']}, stride {r['stride']}" if r["stride"] else \
            f"{r['chunks']} chunks of {r['context']}"
        ref = r.get("reference_perplexity")
        cells = ([f"{ref:.6f}", f"{abs(r['perplexity'] - ref) / ref:.1e}", f"{r['kl_mean']:.1e}",
                  f"{r['kl_p99']:.1e}", f"{r['kl_max']:.1e}", f"{r['same_top']:.0%}"] if ref is not None
                 else ["—"] * 6)
        reference = f"{r['reference']} ({r['reference_kind']})" if r["reference"] else "—"
        lines.append(f"| {r['model']} ({r['model_kind']}) | {reference} | {scheme} | {r['perplexity']:.6f} | "
                     + " | ".join(cells) + f" | {r['scored_tokens']} |")
    (RESULTS / "perplexity_folders.md").write_text(
        "# `perplexity` over our, onnxruntime-genai's and optimum's folders of the same weights\n\n"
        f"Written by `benchmarks/perplexity_folders.py` from {source}: float32, ONNX Runtime CPU, 1 thread, "
        f"the first {TEXT_BYTES} bytes of the shipped GNU GPL v3 (1,139 SmolLM2 tokens). genai: "
        "onnxruntime-genai 0.18's builder `-p fp32 -e cpu` (its own graph: GroupQueryAttention, fused norms); "
        "optimum: our folder in optimum's layout (our metadata and genai_config.json taken out). "
        "Relative difference: |perplexity - reference's| / reference's.\n\n" + "\n".join(lines) + "\n"
        + ("" if runtime is None else
           f"\nThe genai folder's first chunk through onnxruntime-genai's own `Generator` (`append_tokens`, "
           f"`get_output(\"logits\")`, {runtime['positions']} positions) against what `perplexity` reads from it in "
           f"plain ONNX Runtime: largest difference {runtime['max_abs_difference']:.3g} (largest logit "
           f"{runtime['largest_logit']:.3g}).\n"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path, default=SMOLLM2, help="Hugging Face folder (default: real SmolLM2)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/perplexity_folders"), help="where the folders go")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    made = folders(args.hf, args.work)
    text = args.work / "gpl_head.txt"
    shipped = Path(__import__("rmsnorm_deploy.decoder.perplexity", fromlist=["SHIPPED_TEXT"]).SHIPPED_TEXT)
    text.write_bytes(shipped.read_bytes()[:TEXT_BYTES])
    base = ["--text", str(text), "--threads", "1", "--json"]
    rows = []
    for model, reference, stride in (("ours", None, None), ("genai", None, None), ("optimum", None, None),
                                     ("genai", "ours", None), ("optimum", "genai", None), ("ours", "genai", 128)):
        argv = [str(made[model]), *base] + (["--kl-divergence", str(made[reference])] if reference else []) + \
            (["--stride", str(stride)] if stride else [])
        got = cli("perplexity", *argv)
        rows.append({"model": model, "reference": reference, **{k: v for k, v in got.items()
                                                                 if k not in ("model", "reference", "text")}})
        print(json.dumps(rows[-1]), flush=True)
    runtime = genai_runtime_check(made["genai"], text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "perplexity_folders.json").write_text(json.dumps({"hf": args.hf.name, "text_bytes": TEXT_BYTES,
                                                                 "rows": rows, "genai_runtime_first_chunk": runtime},
                                                                indent=1) + "\n")
    write_markdown(rows, args.hf.name, runtime)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
