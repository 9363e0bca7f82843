"""Parity and export time of every supported Hugging Face family, float32 and float16.

Each tiny random config of ``hf.TINY_CONFIGS`` (2 layers, hidden 64) is exported with the
default ``function`` lowering and run in ONNX Runtime CPU; the export-time parity check compares
it with transformers' eager logits in the same dtype and with a float64 run. Records, per family
and dtype, the max abs error of the logits on both parity shapes, the float64 distances, and the
time of ``torch.onnx.export`` and of the whole export.

    python -m benchmarks.sweeps.hf_family_parity

Writes benchmarks/results/hf_family_parity.json and .md.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def main() -> int:
    warnings.simplefilter("ignore")
    from rmsnorm_deploy.exporter import hf
    from rmsnorm_deploy.exporter.pipeline import export_model
    from rmsnorm_deploy.exporter.plan import ExportOptions
    from rmsnorm_deploy.graph.metadata import tool_versions

    rows = []
    for family in hf.TINY_CONFIGS:
        for dtype in ("float32", "float16"):
            loaded = hf.from_config(hf.TINY_CONFIGS[family], dtype, seed=1)
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                result = export_model(loaded, Path(tmp) / "model.onnx", ExportOptions(dtype=dtype))
                total = time.perf_counter() - start
            comps = result.parity.comparisons
            vs_torch = [c.result for c in comps if c.label.startswith("onnxruntime[cpu] vs torch")]
            vs_f64 = [c.result for c in comps if c.label == "onnxruntime[cpu] vs float64"]
            torch_f64 = [c.result for c in comps if c.label.startswith("torch")]
            rows.append({
                "family": family, "model_type": hf.TINY_CONFIGS[family]["model_type"], "dtype": dtype,
                "norms": len(result.detection.norms), "status": result.parity.status,
                "shapes": [list(r.shape) for r in vs_torch],
                "max_abs_vs_eager": max(r.max_abs for r in vs_torch),
                "max_abs_vs_float64": max(r.max_abs for r in vs_f64),
                "torch_max_abs_vs_float64": max(r.max_abs for r in torch_f64),
                "tolerance_vs_eager": vs_torch[0].tolerance.describe(),
                "torch_onnx_export_s": round(result.timings["torch_onnx_export_s"], 2),
                "export_total_s": round(total, 2),
            })
            print(json.dumps(rows[-1]), flush=True)
    out = {"benchmark": "hf_family_parity", "rows": rows, "versions": tool_versions(),
           "machine": {"python": platform.python_version(), "platform": platform.platform()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hf_family_parity.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [
        "# Hugging Face families: ONNX Runtime CPU against transformers' eager logits",
        "",
        "Tiny random configs (`rmsnorm_deploy.exporter.hf.TINY_CONFIGS`: 2 layers, hidden 64), `function` lowering, opset 18; "
        "logits on input_ids of shapes 2x16 and 3x21. "
        f"torch {out['versions'].get('torch')}, transformers {out['versions'].get('transformers')}, "
        f"onnxscript {out['versions'].get('onnxscript')}.",
        "",
        "| family | dtype | norms | parity | max abs vs eager | max abs vs float64 | torch vs float64 | "
        "torch.onnx.export (s) | whole export (s) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['family']} | {r['dtype']} | {r['norms']} | {r['status']} | {r['max_abs_vs_eager']:.3g} | "
                     f"{r['max_abs_vs_float64']:.3g} | {r['torch_max_abs_vs_float64']:.3g} | "
                     f"{r['torch_onnx_export_s']:.1f} | {r['export_total_s']:.1f} |")
    (RESULTS / "hf_family_parity.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["status"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
