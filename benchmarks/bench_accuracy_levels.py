"""MatMulNBits' accuracy_level 0, 1 and 4 at int8 and int4: decode speed, and how close each stays to its reference.

Not a test: it measures what ``--accuracy-level``'s default rests on. The ~125M Llama (hidden 768,
12 layers, vocabulary 32000), float32 activations, ``--quantize int8|int4 --quantize-lm-head``
(block 32), shared past/present, prompt 128, 32 greedy tokens, batch 1, 2 threads; the six graphs
in interleaved rounds (the order rotates). Beside each: its parity against the dequantized
model (``decoder/ort_parity.py``): the row of the tolerance table it is held to and the largest
logit difference, and what quantization cost against the unquantized model.

    python benchmarks/bench_accuracy_levels.py [--rounds 3]

Writes ``benchmarks/results/quant_accuracy_levels.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results"
CONFIG = dict(model_type="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=12, vocab_size=32000, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
PROMPT, NEW_TOKENS, THREADS = 128, 32, 2
LEVELS = (0, 1, 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import onnxruntime as ort
    import torch

    from rmsnorm_deploy.decoder.ort_step import KVDecoderRunner
    from rmsnorm_deploy.decoder.ort_export import write_ort_decoder
    from rmsnorm_deploy.decoder.ort_parity import decode_parity
    from rmsnorm_deploy.decoder.quantize import Quantization
    from rmsnorm_deploy.exporter import hf

    torch.set_num_threads(THREADS)
    loaded = hf.from_config(CONFIG, "float32", seed=0)
    ids = np.random.default_rng(1).integers(3, CONFIG["vocab_size"], size=(1, PROMPT), dtype=np.int64)
    runners, parity = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-levels-") as tmp:
        for scheme in ("int8", "int4"):
            for level in LEVELS:
                name = f"{scheme} accuracy_level {level}"
                path = Path(tmp) / f"{scheme}-{level}" / "model.onnx"
                write_ort_decoder(loaded, path, force=False, share_buffer=True, max_length=PROMPT + NEW_TOKENS,
                                  quantization=Quantization(scheme, 32, level, lm_head=True))
                p = decode_parity(loaded, str(path), batch=2, prompt=16, steps=4)
                steps = [r for r in p.results if hasattr(r, "max_abs")]
                parity[name] = {"status": p.status, "tolerance": list(p.tolerance_key),
                                "max_abs": max(r.max_abs for r in steps), "tokens_equal": p.tokens_equal,
                                "near_ties": p.near_ties, "vs_unquantized_max_abs": max(p.cost.max_abs),
                                "logit_scale": p.cost.logit_scale}
                options = ort.SessionOptions()
                options.intra_op_num_threads = THREADS
                runners[name] = KVDecoderRunner(str(path), threads=THREADS, session_options=options)
        names = list(runners)
        times: dict[str, list[float]] = {n: [] for n in names}
        for name in names:
            runners[name].greedy(ids, new_tokens=4)  # warm-up
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                gen = runners[name].greedy(ids, new_tokens=NEW_TOKENS)
                times[name].append(1e3 * sum(gen.step_s) / len(gen.step_s))
            print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f}" for n in names), file=sys.stderr, flush=True)
    result = {"config": CONFIG, "prompt": PROMPT, "new_tokens": NEW_TOKENS, "rounds": args.rounds,
              "load": [round(x, 2) for x in os.getloadavg()],
              "decode_ms_per_token": {n: round(statistics.median(t), 3) for n, t in times.items()},
              "samples": times, "parity": parity}
    write(result)
    print(json.dumps(result["decode_ms_per_token"], indent=1))
    return 0


def write(result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quant_accuracy_levels.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# MatMulNBits accuracy_level on CPU: speed and accuracy",
        "",
        f"The ~125M Llama (hidden 768, 12 layers, vocabulary 32000), `--quantize S --quantize-lm-head` (block 32), "
        f"shared past/present, prompt {result['prompt']}, {result['new_tokens']} greedy tokens, batch 1, 2 threads; "
        f"median decode ms/token over {result['rounds']} interleaved rounds (load average {result['load'][0]} at the "
        "end). Parity: prefill + 4 steps of 2 left-padded rows against the model holding the dequantized weights "
        "(at level 4 with int8-rounded inputs), under the tolerance table's row. Written by "
        "`benchmarks/bench_accuracy_levels.py`.",
        "",
        "| graph | decode ms/token | x level 4 | parity | tolerance row | max logit difference vs its reference | "
        "vs the unquantized model |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    ms = result["decode_ms_per_token"]
    for name, value in ms.items():
        p = result["parity"][name]
        base = ms[name.rsplit(" ", 1)[0] + " 4"]
        lines.append(f"| {name} | {value:.2f} | {value / base:.2f} | {p['status']} | {p['tolerance'][0]} | "
                     f"{p['max_abs']:.2g} | {p['vs_unquantized_max_abs']:.3g} (largest logit {p['logit_scale']:.3g}) |")
    (RESULTS / "quant_accuracy_levels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
