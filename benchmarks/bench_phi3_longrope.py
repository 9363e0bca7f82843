"""LongRoPE at its real switch: a Phi-4-mini-shaped model (head_dim 128, 96 rotary dims, LongRoPE
switching at 4096 of 131072 positions; 2 layers, hidden 512, 4 query heads over 1 KV head, random
weights) exported with ``--target onnxruntime`` and held to transformers across the switch: a
prompt of 4094 tokens, then decode steps through 4096 -> 4097 (where transformers' ``generate``
drops its cache and runs the whole sequence again with the long table). Also times the rows of the
stacked [short; long] tables each run slices. Too slow for the suite (a 4097-token float64 run).

    PYTHONPATH=. python benchmarks/bench_phi3_longrope.py [--out benchmarks/results/phi3_longrope.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def config(half: int = 48) -> dict:
    """``half``: the factors' length, rotary dims / 2 (Phi3Config checks it against hidden // heads)."""
    return {"model_type": "phi3", "vocab_size": 256, "hidden_size": 512, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
            "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.02 * i for i in range(half)],
                             "long_factor": [1.0 + 1.5 * i for i in range(half)]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4094)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "phi3_longrope.json")
    args = parser.parse_args()

    from rmsnorm_deploy.decoder.ort_graph import build_decoder
    from rmsnorm_deploy.decoder.ort_parity import decode_parity
    from rmsnorm_deploy.exporter import hf

    loaded = hf.from_config(config(), "float32", seed=0)
    started = time.perf_counter()
    dec = build_decoder(loaded, max_length=args.prompt + args.steps + 1)
    parity = decode_parity(loaded, dec.model, batch=1, prompt=args.prompt, steps=args.steps)
    result = {
        "model": "phi3 (Phi-4-mini-shaped rotary: 96 of 128 dims, LongRoPE 4096 -> 131072), 2 layers, random",
        "prompt": args.prompt, "steps": args.steps,
        "max_abs_per_step": [float(r.max_abs) for r in parity.results],
        "passed": [bool(r.passed) for r in parity.results], "tokens_equal": bool(parity.tokens_equal),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(parity.table())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
