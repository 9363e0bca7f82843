"""End-to-end export of the hybrid families whose layers use a gated RMS norm, float32.

Each family's tiny random config (2 layers, hidden 64, gated norms over 2 groups where the
family groups) is exported with the default ``function`` lowering and run in ONNX Runtime CPU;
the export-time parity check compares it with transformers' eager logits and with a float64
run. The gated norms are detected by their known class. The families' *plain* norms
(``Mamba2RMSNorm``, ``BambaRMSNorm``, ...) are not known classes: this script declares each one
with the first named spec (llama, olmo2, gemma) that reproduces it bit for bit, the way a user
declares one with an ``rmsnorm_spec`` attribute. Each family runs in its own process with a time
limit; a family that fails records the first line of its error.

    python -m benchmarks.sweeps.gated_families [FAMILY ...]

Writes benchmarks/results/gated_families.json and .md.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
TIME_LIMIT_S = int(os.environ.get("GATED_FAMILY_TIME_LIMIT_S", "900"))

_BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2)
_ATTN = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
CONFIGS: dict[str, dict] = {
    "mamba2": {**_BASE, "model_type": "mamba2", "state_size": 16, "expand": 2, "n_groups": 2, "head_dim": 16,
               "num_heads": 8, "chunk_size": 16, "conv_kernel": 4},
    "bamba": {**_BASE, **_ATTN, "model_type": "bamba", "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2,
              "mamba_d_state": 16, "mamba_chunk_size": 16, "attn_layer_indices": [1]},
    "qwen3_5": {**_BASE, **_ATTN, "model_type": "qwen3_5_text", "head_dim": 16, "linear_num_value_heads": 4,
                "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"]},
    "olmo_hybrid": {**_BASE, **_ATTN, "model_type": "olmo_hybrid", "pad_token_id": 0, "eos_token_id": 1,
                    "linear_num_value_heads": 4,
                    "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                    "layer_types": ["linear_attention", "full_attention"]},
}


def _declare_plain_norms(module) -> list[str]:
    """Give every norm detection does not know the first named spec that reproduces it bit for bit."""
    from rmsnorm_deploy.contract.spec import RMSNormSpec
    from rmsnorm_deploy.exporter.detect import (
        DetectedNorm,
        NormMismatchError,
        class_path,
        confirm_norm,
        spec_of,
    )

    declared = []
    for path, sub in module.named_modules():
        name = type(sub).__name__
        if not name.endswith("RMSNorm") or spec_of(sub) is not None or not hasattr(sub, "weight"):
            continue
        eps = next(getattr(sub, a) for a in ("variance_epsilon", "eps", "epsilon") if hasattr(sub, a))
        for named in ("llama", "olmo2", "gemma"):
            spec = getattr(RMSNormSpec, named)(eps)
            norm = DetectedNorm(path, class_path(type(sub)), spec, sub, sub.weight, tuple(sub.weight.shape),
                                sub.weight.dtype, "script")
            try:
                confirm_norm(norm)
            except NormMismatchError:
                continue
            sub.rmsnorm_spec = spec
            declared.append(f"{name}={named}")
            break
    return sorted(set(declared))


def _run(family: str, queue) -> None:
    warnings.simplefilter("ignore")
    row: dict = {"family": family, "model_type": CONFIGS[family]["model_type"], "dtype": "float32"}
    try:
        from rmsnorm_deploy.exporter import hf
        from rmsnorm_deploy.exporter.pipeline import export_model
        from rmsnorm_deploy.exporter.plan import ExportOptions

        loaded = hf.from_config(CONFIGS[family], "float32", seed=1)
        row["declared_plain_norms"] = _declare_plain_norms(loaded.module)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            result = export_model(loaded, Path(tmp) / "model.onnx", ExportOptions(dtype="float32", batch=2, seq=11))
            row["export_s"] = round(time.perf_counter() - start, 1)
        gated = [n for n in result.detection.norms if n.spec.has_gate]
        row["gated_norms"] = len(gated)
        row["norms"] = len(result.detection.norms)
        row["gated_class"] = sorted({n.class_name.rsplit(".", 1)[-1] for n in gated})
        row["gated_spec"] = sorted({n.spec.describe() for n in gated})
        comps = result.parity.comparisons
        row["max_abs_vs_eager"] = max(c.result.max_abs for c in comps if c.label.startswith("onnxruntime[cpu] vs torch"))
        row["status"] = result.parity.status
    except Exception as exc:  # a benchmark records why a family failed and goes on
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        row["where"] = traceback.format_exc().strip().splitlines()[-3:-1]
    queue.put(row)


def main(argv: list[str]) -> int:
    from rmsnorm_deploy.graph.metadata import tool_versions

    families = argv or list(CONFIGS)
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for family in families:
        queue = ctx.Queue()
        proc = ctx.Process(target=_run, args=(family, queue))
        start = time.perf_counter()
        proc.start()
        proc.join(TIME_LIMIT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join()
            rows.append({"family": family, "status": "timeout", "error": f"no result within {TIME_LIMIT_S} s"})
        else:
            rows.append(queue.get() if not queue.empty() else {"family": family, "status": "error",
                                                                  "error": f"exit code {proc.exitcode}"})
        rows[-1]["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "python": platform.python_version(), "versions": tool_versions()}
    (RESULTS / "gated_families.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Gated-norm families: end-to-end export (float32, ONNX Runtime CPU)", "",
             "Tiny random configs; parity = the export-time check against eager and float64.", "",
             "| family | gated class | gated norms / norms | plain norms declared | max abs vs eager | parity | "
             "export s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") in ("pass", "FAIL"):
            lines.append(f"| {r['family']} | {', '.join(r['gated_class'])} | {r['gated_norms']} / {r['norms']} | "
                         f"{', '.join(r['declared_plain_norms']) or '-'} | {r['max_abs_vs_eager']:.3g} | "
                         f"{r['status']} | {r['export_s']} |")
        else:
            lines.append(f"| {r['family']} | - | - | - | - | {r['status']}: {r.get('error', '')} | - |")
    lines += ["", "Specs of the gated norms:", ""]
    for r in rows:
        for s in r.get("gated_spec", []):
            lines.append(f"- {r['family']}: {s}")
    lines += ["", f"Machine: {meta['machine']}, Python {meta['python']}."]
    (RESULTS / "gated_families.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
