"""The 8B row of ``bench_export_scale.py``: Llama-3-8B's shape, streamed, quantized, generated, checked.

``python benchmarks/bench_export_scale.py --model 8b [--work DIR] [--schemes int4,int8] [--keep]``:

1. writes a checkpoint of Llama-3-8B's exact config (hidden 4096, 32 layers, 32 heads over 8 KV
   heads, intermediate 14336, vocabulary 128256, untied head) with random bfloat16 weights, sharded
   at 5 GB as the published one (``random_checkpoint.py``: tensor by tensor, never whole in memory);
2. per scheme, ``rmsnorm-deploy export DIR --kv-cache --target onnxruntime --quantize SCHEME`` in a
   child whose resident memory is sampled every 0.1 s per progress stage: time, peak RSS up to the
   saved model and for the whole command, file sizes; the export's own parity check, which runs
   layer by layer on a 16-token prompt because the whole model does not fit beside ONNX Runtime;
3. ``rmsnorm-deploy generate OUT --max-new-tokens 32``: prefill, decode ms/token, peak RSS;
4. deletes what it wrote (unless ``--keep``); a run that stops leaves its checkpoint in ``--work``,
   and the next run with the same ``--work`` uses it again.

Writes ``benchmarks/results/export_scale_8b.{json,md}``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench_export_scale import RESULTS, ROOT, measure
from random_checkpoint import LLAMA3_8B, write_checkpoint

#: The export's memory target, whatever the model's size.
TARGET_BYTES = 3 * 2**30
NEW_TOKENS = 32
PROMPT = [128000, 791, 4062, 14198, 39935, 35308, 927, 279]  # 8 token ids
_EXPORT_END = "saving"  # stages up to and including writing the graph count as the export


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _gib(kib: float) -> float:
    return round(kib / 2**20, 2)


def _export(folder: Path, out: Path, scheme: str, env: dict) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rmsnorm_deploy", "export", str(folder), "--kv-cache", "--target", "onnxruntime",
           "--quantize", scheme, "-o", str(out), "--force"]
    run = measure(cmd, env, ROOT)
    writing = [s for s in run["stages"] if not s["name"].startswith(("parity", "loading the PyTorch"))]
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    parity = report.get("parity", {})
    return {
        "command": f"rmsnorm-deploy export <llama3-8b> --kv-cache --target onnxruntime --quantize {scheme}",
        "exit_code": run["exit_code"], "wall_s": round(run["wall_s"], 1),
        "export_peak_rss_gib": _gib(max(s["peak_kib"] for s in writing)),
        "whole_command_peak_rss_gib": _gib(run["peak_kib"]),
        "target_met": max(s["peak_kib"] for s in writing) * 1024 < TARGET_BYTES,
        "stages": [{"stage": s["name"].replace(str(folder), "<llama3-8b>"), "seconds": s.get("seconds"),
                    "peak_rss_gib": _gib(s["peak_kib"])} for s in run["stages"]],
        "files": {p.name: p.stat().st_size for p in out.glob("*")} if out.exists() else {},
        "parity": {"status": parity.get("status"), "kind": parity.get("kind"), "why": parity.get("why"),
                   "reference": parity.get("reference"), "tolerance": parity.get("tolerance"),
                   "tokens_equal": parity.get("tokens_equal"),
                   "rows": [{"name": r["name"], "max_abs": r.get("max_abs"), "max_steps": r.get("max_steps"),
                             "passed": r["passed"]} for r in parity.get("steps", [])]},
        "stderr_tail": run["stderr"][-4:],
    }


def _generate(out: Path, env: dict) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rmsnorm_deploy", "generate", str(out), "--input-ids", ",".join(map(str, PROMPT)),
           "--max-new-tokens", str(NEW_TOKENS), "--threads", "2", "--json"]
    run = measure(cmd, env, ROOT)
    answer = json.loads(run["stdout"]) if run["exit_code"] == 0 else {}
    return {"exit_code": run["exit_code"], "wall_s": round(run["wall_s"], 1), "peak_rss_gib": _gib(run["peak_kib"]),
            "prefill_ms": answer.get("prefill_ms"), "decode_ms_per_token": answer.get("decode_ms_per_token"),
            "tokens": answer.get("tokens"), "stderr_tail": run["stderr"][-3:]}


def run_8b(work: Path, schemes: list[str], keep: bool, layers: int | None = None, write: bool = True) -> dict[str, Any]:
    config = dict(LLAMA3_8B, **({"num_hidden_layers": layers} if layers else {}))
    folder = work / "llama3-8b-hf"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result: dict[str, Any] = {"benchmark": "export_scale_8b", "config": config, "schemes": {},
                              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                          "platform": platform.platform()}}
    made = work / "checkpoint.json"  # a checkpoint made by an earlier run that stopped is used again
    if made.is_file() and (folder / "model.safetensors.index.json").is_file():
        result["checkpoint"] = json.loads(made.read_text())
    else:
        start = time.perf_counter()
        total = write_checkpoint(folder, config)
        result["checkpoint"] = {"bytes": total, "files": sorted(p.name for p in folder.iterdir()),
                                "seconds": round(time.perf_counter() - start, 1),
                                "writer_peak_rss_gib": _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)}
        made.write_text(json.dumps(result["checkpoint"]))
    print(json.dumps(result["checkpoint"]), file=sys.stderr, flush=True)
    for scheme in schemes:
        out = work / f"out-{scheme}"
        entry = _export(folder, out, scheme, env)
        print(json.dumps({k: entry[k] for k in ("exit_code", "wall_s", "export_peak_rss_gib",
                                                "whole_command_peak_rss_gib")}), file=sys.stderr, flush=True)
        if entry["exit_code"] in (0, 1):
            entry["generate"] = _generate(out, env)
        result["schemes"][scheme] = entry
        if write:
            write_8b(result)
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    if not keep:  # kept when a run stops before here, for the next one (about 16 GB: delete it by hand)
        shutil.rmtree(work, ignore_errors=True)
    return result


def write_8b(result: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "export_scale_8b.json").write_text(json.dumps(result, indent=1) + "\n")
    c = result["config"]
    lines = [
        "# Export at scale: Llama-3-8B's shape, streamed and quantized",
        "",
        f"A checkpoint of Llama-3-8B's config (hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} heads over {c['num_key_value_heads']} KV heads, intermediate "
        f"{c['intermediate_size']}, vocabulary {c['vocab_size']}) with random bfloat16 weights, "
        f"{result['checkpoint']['bytes'] / 2**30:.1f} GiB in {len(result['checkpoint']['files']) - 2} shards, written "
        f"tensor by tensor in {result['checkpoint']['seconds']:.0f} s (peak RSS of the writer "
        f"{result['checkpoint']['writer_peak_rss_gib']:.2f} GiB), then exported on {result['machine']['cpus']} CPUs "
        "(24 GiB of memory) by `rmsnorm-deploy export <llama3-8b> --kv-cache --target onnxruntime --quantize S`, "
        "float32 activations, the LM head and embedding in float32, and run by `rmsnorm-deploy generate` "
        f"({NEW_TOKENS} new tokens, 2 threads). Written by `benchmarks/bench_export_scale.py --model 8b`.",
        "",
        "| scheme | export time | peak RSS, writing the graph | peak RSS, whole export (parity included) | "
        "model.onnx.data | parity | generate: prefill (8 tokens) | decode ms/token | generate peak RSS |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for scheme, e in result["schemes"].items():
        g = e.get("generate", {})
        data = e["files"].get("model.onnx.data", 0) / 2**30
        lines.append(f"| {scheme} | {e['wall_s']:.0f} s | {e['export_peak_rss_gib']:.2f} GiB "
                     f"({'met' if e['target_met'] else 'MISSED'} < 3 GiB) | {e['whole_command_peak_rss_gib']:.2f} GiB | "
                     f"{data:.2f} GiB | {e['parity']['status']} ({e['parity']['kind'] or 'whole model'}) | "
                     f"{g.get('prefill_ms', '-')} ms | {g.get('decode_ms_per_token', '-')} | "
                     f"{g.get('peak_rss_gib', '-')} GiB |")
    for scheme, e in result["schemes"].items():
        lines += ["", f"## {scheme}", "", f"Parity: {e['parity']['reference']}; tolerance {e['parity']['tolerance']}; "
                  f"{e['parity']['why'] or ''}", "", "| compared | max abs | passed |", "|---|---:|---|"]
        lines += [f"| {r['name']} | " + (f"{r['max_abs']:.3g}" if r["max_abs"] is not None else
                                          f"within {r['max_steps']:.3g} quantization steps")
                  + f" | {r['passed']} |" for r in e["parity"]["rows"]]
        lines += ["", "| stage | seconds | peak RSS (GiB) |", "|---|---:|---:|"]
        lines += [f"| {s['stage']} | {_seconds(s['seconds'])} | {s['peak_rss_gib']:.2f} |" for s in e["stages"]]
    (RESULTS / "export_scale_8b.md").write_text("\n".join(lines) + "\n")
