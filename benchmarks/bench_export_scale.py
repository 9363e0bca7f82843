"""Export a LLaMA-architecture model of about 1B parameters and record wall time and peak memory.

The model has the shape of LLaMA-3.2-1B (16 layers, hidden 2048, GQA 32:8, SwiGLU 8192, a
128256-token embedding tied to the head), random weights, float16: 1.24B parameters, 2.47 GB
of weights, so the ONNX weights go to external data. The export runs as the user runs it,
``rmsnorm-deploy export <preset> --dtype float16`` in a subprocess (parity check included),
while this script samples the child's resident memory every 0.1 s and attributes the peak to
the stage the child's progress lines say it is in; then it measures ONNX Runtime alone on the
exported file in a fresh process. Target: peak RSS under 3x the weight bytes.

    python benchmarks/bench_export_scale.py [--layers 16] [--keep]

Writes benchmarks/results/export_scale.json and .md. ``--model 8b`` measures the streamed,
quantized export of a model of Llama-3-8B's shape instead (``export_scale_8b.py``; results in
``export_scale_8b.{json,md}``). ``--model folder --folder DIR`` measures the export of a real
checkpoint's Hugging Face folder in its own dtype (``--kv-cache`` too), the same way; ``--code DIR``
runs another checkout's package (the code before a change), ``--label`` names the run. Each such run
is kept in ``export_scale_real.json`` and the table of all of them is the "Real checkpoints"
section of ``export_scale.md``.

    python benchmarks/bench_export_scale.py --model folder --folder DIR [--kv-cache] [--code DIR --label before]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TARGET_RATIO = 3.0
#: A real checkpoint's float32 export: peak RSS at most this many times its weights.
REAL_TARGET_RATIO = 4.0

PRESET = """\
description = "LLaMA-3.2-1B-shaped decoder (benchmark)"
[model]
vocab_size = 128256
dim = 2048
n_layers = {layers}
n_heads = 32
n_kv_heads = 8
intermediate_size = 8192
rope_theta = 500000.0
max_seq_len = 131072
tie_embeddings = true
[norm]
epsilon = 1e-5
gain = "weight"
order = "cast_then_scale"
accumulation = "float32"
[weights]
seed = 0
"""

_STAGE = re.compile(r"^export \[(\d+)\] (.*?)(?: \.\.\.|: (done|failed) in ([\d.]+)s.*)$")


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


_ORT_ALONE = """
import resource, sys, numpy as np, onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
session.run(None, {"input_ids": np.zeros((2, 16), dtype=np.int64)})
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def onnxruntime_alone(model: Path, env: dict) -> int | None:
    """Peak RSS of a fresh process that only opens the exported model in ONNX Runtime CPU (default
    optimizations, as the parity check does) and runs it once: what ONNX Runtime itself needs."""
    done = subprocess.run([sys.executable, "-c", _ORT_ALONE, str(model)], env=env, capture_output=True, text=True)
    return int(done.stdout.split()[-1]) * 1024 if done.returncode == 0 and done.stdout.strip() else None


def measure(cmd: list[str], env: dict, cwd: str | Path) -> dict:
    """Run ``cmd`` (an ``rmsnorm-deploy`` command) as a child, sampling its resident memory every 0.1 s
    and attributing each sample to the stage its progress lines say it is in: wall time, exit code,
    peak RSS (the larger of the samples and the kernel's high-water mark), stages, output."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stages: list[dict] = []
    current = {"name": "python start-up and imports", "peak_kib": 0, "start_s": 0.0}
    stages.append(current)
    lock = threading.Lock()
    stderr_lines: list[str] = []

    def read_stderr() -> None:
        nonlocal current
        assert child.stderr is not None
        for line in child.stderr:
            stderr_lines.append(line.rstrip())
            m = _STAGE.match(line.rstrip())
            if m and not m.group(3):
                with lock:
                    current = {"name": m.group(2), "peak_kib": 0, "start_s": time.perf_counter() - start}
                    stages.append(current)
            elif m:
                with lock:
                    current["seconds"] = float(m.group(4))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    peak = 0
    while child.poll() is None:
        value = rss_kib(child.pid)
        if value:
            peak = max(peak, value)
            with lock:
                current["peak_kib"] = max(current["peak_kib"], value)
        time.sleep(0.1)
    stdout = child.stdout.read() if child.stdout else ""
    reader.join()
    # ru_maxrss of the waited-for children: the kernel's own high-water mark, in KiB on Linux (of any
    # child so far: it counts only when it is above what the children before reached).
    kernel_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    kernel_peak = kernel_peak if kernel_peak > before else 0
    return {"exit_code": child.returncode, "wall_s": time.perf_counter() - start, "peak_kib": max(peak, kernel_peak),
            "stages": stages, "stdout": stdout, "stderr": stderr_lines}


def run(layers: int, keep: bool) -> dict:
    from rmsnorm_deploy.exporter.presets import parse_preset

    text = PRESET.format(layers=layers)
    args = parse_preset(text, name="llama-1b").args
    weight_bytes = args.parameter_count() * 2
    with tempfile.TemporaryDirectory(prefix="bench-export-scale-") as tmp:
        preset_path = Path(tmp) / "llama-1b.toml"
        preset_path.write_text(text)
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "rmsnorm_deploy", "export", str(preset_path), "-o", str(out),
               "--dtype", "float16", "--force"]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        run_ = measure(cmd, env, tmp)
        stages, stdout, stderr_lines, wall = run_["stages"], run_["stdout"], run_["stderr"], run_["wall_s"]
        peak, kernel_peak = run_["peak_kib"], 0
        files = {p.name: p.stat().st_size for p in out.glob("*")} if out.exists() else {}
        report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
        ort_alone = onnxruntime_alone(out / "model.onnx", env) if (out / "model.onnx").exists() else None
        if keep:
            keep_dir = ROOT / "export" / "bench-llama-1b"
            keep_dir.mkdir(parents=True, exist_ok=True)
            for p in out.glob("*"):
                os.replace(p, keep_dir / p.name)
    peak_bytes = max(peak, kernel_peak) * 1024
    export_stages = [s for s in stages if not s["name"].startswith("parity: ONNX Runtime")]
    export_peak = max(s["peak_kib"] for s in export_stages) * 1024
    return {
        "benchmark": "export_scale",
        "command": " ".join(["rmsnorm-deploy"] + cmd[3:4] + ["<llama-1b.toml>"] + cmd[5:6] + ["<out>"] + cmd[7:]),
        "model": {"shape": "LLaMA-3.2-1B", "layers": layers, "parameters": args.parameter_count(), "dtype": "float16",
                  "weight_bytes": weight_bytes},
        "exit_code": run_["exit_code"],
        "wall_s": round(wall, 1),
        "peak_rss_bytes": peak_bytes,
        "peak_rss_over_weights": round(peak_bytes / weight_bytes, 3),
        "export_peak_rss_bytes": export_peak,
        "export_peak_rss_over_weights": round(export_peak / weight_bytes, 3),
        "target_ratio": TARGET_RATIO,
        "target_met_by_export": export_peak < TARGET_RATIO * weight_bytes,
        "target_met_by_whole_command": peak_bytes < TARGET_RATIO * weight_bytes,
        "onnxruntime_alone_peak_rss_bytes": ort_alone,
        "stages": [{"stage": s["name"].replace(str(preset_path), "<llama-1b.toml>").replace(str(out), "<out>"),
                    "seconds": s.get("seconds"), "peak_rss_gib": round(s["peak_kib"] / 2**20, 2)}
                   for s in stages],
        "files": files,
        "parity": {k: report.get("parity", {}).get(k) for k in ("status", "reason")},
        "parity_rows": [{"label": c["label"], "shape": c["shape"], "max_abs": c["max_abs"],
                         "status": ("pass" if c["passed"] else "FAIL") if c["checked"] else "context"}
                        for c in report.get("parity", {}).get("comparisons", [])],
        "stdout": stdout.splitlines()[-12:],
        "stderr_tail": stderr_lines[-5:],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "versions": report.get("versions", {}),
    }


def run_folder(folder: Path, kv_cache: bool, code: Path, label: str) -> dict:
    """The export of a Hugging Face folder as the user runs it (``--kv-cache`` or not), measured by
    :func:`measure` with ``code`` first on ``PYTHONPATH``."""
    with tempfile.TemporaryDirectory(prefix="bench-export-scale-") as tmp:
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "rmsnorm_deploy", "export", str(folder), "-o", str(out), "--force"]
        cmd += ["--kv-cache"] if kv_cache else []
        env = dict(os.environ, PYTHONPATH=str(code))
        run_ = measure(cmd, env, tmp)
        return folder_record(folder, kv_cache, label, run_, out)


def folder_record(folder: Path, kv_cache: bool, label: str, run_: dict, out: Path) -> dict:
    """What :func:`run_folder` keeps of a measured export (``run_``: :func:`measure`'s) into ``out``."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    files = {p.name: p.stat().st_size for p in out.glob("*") if p.suffix in (".onnx", ".data")}
    weight_bytes = report.get("weight_bytes") or sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    stages = [{"stage": s["name"].replace(str(folder), "<folder>").replace(str(out), "<out>"),
               "seconds": s.get("seconds"), "peak_rss_gib": round(s["peak_kib"] / 2**20, 2)} for s in run_["stages"]]
    return {
        "checkpoint": folder.name, "label": label, "kv_cache": kv_cache,
        "command": "rmsnorm-deploy export <folder>" + (" --kv-cache" if kv_cache else ""),
        "model": {"type": config.get("model_type"), "layers": config.get("num_hidden_layers"),
                  "hidden": config.get("hidden_size"), "vocab": config.get("vocab_size"),
                  "parameters": report.get("parameters"), "dtype": report.get("dtype", "float32"),
                  "weight_bytes": weight_bytes},
        "exit_code": run_["exit_code"], "wall_s": round(run_["wall_s"], 1),
        "peak_rss_bytes": run_["peak_kib"] * 1024,
        "peak_rss_over_weights": round(run_["peak_kib"] * 1024 / weight_bytes, 2),
        "stages": stages, "files": files,
        "parity": report.get("parity", {}).get("status"),
        "stderr_tail": run_["stderr"][-3:],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "versions": report.get("versions", {}),
    }


_REAL_HEADING = "## Real checkpoints"


def _real_section(runs: list[dict]) -> str:
    """The "Real checkpoints" section of export_scale.md: every kept run, then each run's stages."""
    gib = 2**30
    lines = [
        _REAL_HEADING, "",
        "Real pretrained checkpoints, float32, exported as users run them (`rmsnorm-deploy export <folder>`, "
        "with and without `--kv-cache`, portable target), written by "
        "`benchmarks/bench_export_scale.py --model folder`: "
        "the child's resident memory is sampled every 0.1 s from /proc and each sample attributed to the stage its "
        "`export [N] ...` progress line says it is in; the peak is the larger of the samples and the kernel's "
        "high-water mark (`ru_maxrss`, what `/usr/bin/time -v` reports). `before` ran the previous code "
        "(`--code` a copy of it). A parity FAIL here is the parity rule's, not the memory's. Wall times are "
        "those of a shared 2-core machine under a load average near 10: compare the memory, not the seconds.", "",
        "Where the memory went before: in every run the peak was the save. Under 2 GB the graph was built as one "
        "`ModelProto` holding every weight (beside the PyTorch module's own, in the writing stage), serialized by "
        "`onnx.save_model` (at least one more copy, as bytes) and read back by `onnx.checker` in the same process "
        "(the file's bytes and the parsed message: two more; measured alone, 2.0x the file). Not the logits: the largest, [3, 21, 262144] in float64, is 132 MiB. "
        "Not torch.onnx.export: "
        "its graph shares the module's tensors. Now the weights are appended to the file one tensor at a time from the "
        "exporter's tensors (protobuf merges a message field that occurs twice, so `graph { initializer }` fragments "
        "after the model parse as its initializers) and the module is freed before the checker reads the file. What "
        "remains: the module and the float64 parity run (Gemma's scaled embedding is an `nn.Embedding` subclass whose "
        "whole table was widened to float64, 1.3 GB; now only the rows it gathers are), `compare()` on the logits (its "
        "float64 temporaries: 1.5 GB more on [3, 21, 262144], measured alone: the peak of Gemma's plain export now), "
        "the checker's two copies, and ONNX Runtime's session (the parsed model, its own copies of the initializers "
        "and prepacked MatMul weights; the optimized model it writes for the audit of a model under 1 GB now keeps "
        "its weights in a file beside it: 2.07 to 1.67 GB for SmolLM2's, measured alone). A 0.5 GB model also pays "
        "the interpreter, torch and ONNX Runtime themselves (about 0.45 GB), nearly one more times its weights.", "",
        "| checkpoint | model | export | code | weights (GiB) | peak RSS (GiB) | x weights | wall (s) | peak stage "
        "| parity |",
        "|---|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in runs:
        peak = max(r["stages"], key=lambda s: s["peak_rss_gib"])
        m = r["model"]
        model = f"{m['type']}, {(m['parameters'] or 0) / 1e6:.1f}M, {m['layers']} layers, vocab {m['vocab']}"
        lines.append(f"| {r['checkpoint']} | {model} | {'--kv-cache' if r['kv_cache'] else 'plain'} | {r['label']} | "
                     f"{r['model']['weight_bytes'] / gib:.2f} | {r['peak_rss_bytes'] / gib:.2f} | "
                     f"{r['peak_rss_over_weights']:.1f} | {r['wall_s']:.0f} | {peak['stage']} | {r['parity']} |")
    groups: dict[tuple[str, bool], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["checkpoint"], r["kv_cache"]), []).append(r)
    for (checkpoint, kv_cache), group in groups.items():
        export = "--kv-cache" if kv_cache else "plain"
        lines += ["", f"**{checkpoint}, {export}**: seconds / peak RSS (GiB) per stage", "",
                  "| stage | " + " | ".join(r["label"] for r in group) + " |",
                  "|---|" + "---:|" * len(group)]
        names = list(dict.fromkeys(st["stage"] for r in group for st in r["stages"]))
        for name in names:
            cells = []
            for r in group:
                st = next((x for x in r["stages"] if x["stage"] == name), None)
                secs = "-" if st is None or st["seconds"] is None else f"{st['seconds']:.1f}"
                cells.append("" if st is None else f"{secs} / {st['peak_rss_gib']:.2f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _with_real_section(text: str) -> str:
    """``text`` (export_scale.md up to its real-checkpoint section) followed by that section as kept."""
    head = text.split(_REAL_HEADING)[0].rstrip("\n") + "\n"
    kept = RESULTS / "export_scale_real.json"
    if not kept.exists():
        return head
    return head + "\n" + _real_section(json.loads(kept.read_text()))


def write_real(result: dict) -> None:
    """Keep ``result`` in export_scale_real.json (replacing the run of the same checkpoint, export and
    label) and rewrite the real-checkpoint section of export_scale.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    kept_path = RESULTS / "export_scale_real.json"
    kept = json.loads(kept_path.read_text()) if kept_path.exists() else []
    key = (result["checkpoint"], result["kv_cache"], result["label"])
    kept = [r for r in kept if (r["checkpoint"], r["kv_cache"], r["label"]) != key] + [result]
    kept.sort(key=lambda r: (r["checkpoint"], r["kv_cache"], r["label"] != "before", r["label"]))
    kept_path.write_text(json.dumps(kept, indent=1) + "\n")
    md = RESULTS / "export_scale.md"
    md.write_text(_with_real_section(md.read_text() if md.exists() else ""))


def write(result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "export_scale.json").write_text(json.dumps(result, indent=1) + "\n")
    gib = 2**30
    m = result["model"]
    w = m["weight_bytes"]
    ort_alone = result.get("onnxruntime_alone_peak_rss_bytes")
    lines = [
        "# Export at scale: a 1.24B-parameter LLaMA-architecture model, float16",
        "",
        f"`{result['command']}` on {result['machine']['cpus']} CPUs "
        f"(torch {result['versions'].get('torch', '?')}, onnx {result['versions'].get('onnx', '?')}, "
        f"onnxscript {result['versions'].get('onnxscript', '?')}). Written by `benchmarks/bench_export_scale.py`.",
        "",
        f"- parameters: {m['parameters'] / 1e9:.3f}B ({m['layers']} layers), weights {w / gib:.2f} GiB",
        f"- wall time: {result['wall_s']:.0f} s for the whole command, parity check included (exit code {result['exit_code']})",
        f"- peak RSS of the whole command: {result['peak_rss_bytes'] / gib:.2f} GiB = "
        f"{result['peak_rss_over_weights']:.2f}x the weights (target < {result['target_ratio']:g}x: "
        f"{'met' if result['target_met_by_whole_command'] else 'MISSED'})",
        f"- peak RSS up to the saved model (every stage but ONNX Runtime's): {result['export_peak_rss_bytes'] / gib:.2f} GiB "
        f"= {result['export_peak_rss_over_weights']:.2f}x ({'met' if result['target_met_by_export'] else 'MISSED'})",
    ]
    if ort_alone:
        lines.append(f"- ONNX Runtime alone, in a fresh process, opening the same file and running it once: "
                     f"{ort_alone / gib:.2f} GiB = {ort_alone / w:.2f}x the weights (ONNX Runtime CPU has no float16 "
                     "MatMul: it keeps float32 copies of the weights)")
    lines += [
        "- files: " + ", ".join(f"{k} {v / gib:.2f} GiB" if v > 2**24 else f"{k} {v / 2**10:.0f} KiB"
                                for k, v in sorted(result["files"].items())),
        f"- parity: {result['parity'].get('status')}",
        "",
        "Where the memory goes: the float16 weights themselves; the float64 run of the parity check widens at most "
        "64 MiB of a weight at a time; the ONNX graph is serialized without its weights and the weights are streamed "
        "from torch into `model.onnx.data`, so the export never holds a second copy; the PyTorch weights are freed "
        "before ONNX Runtime loads its own.",
        "",
        "| stage | seconds | peak RSS (GiB) |",
        "|---|---:|---:|",
    ]
    for s in result["stages"]:
        secs = "-" if s["seconds"] is None else f"{s['seconds']:.1f}"
        lines.append(f"| {s['stage']} | {secs} | {s['peak_rss_gib']:.2f} |")
    if result["parity_rows"]:
        lines += ["", "| parity comparison | shape | max abs | status |", "|---|---|---:|---|"]
        for r in result["parity_rows"]:
            lines.append(f"| {r['label']} | {r['shape']} | {r['max_abs']:.3g} | {r['status']} |")
    (RESULTS / "export_scale.md").write_text(_with_real_section("\n".join(lines) + "\n"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("1b", "8b", "folder"), default="1b",
                        help="1b: the traced float16 export of a 1.24B model (default); 8b: Llama-3-8B's shape "
                             "streamed and quantized (export_scale_8b.py); folder: a real checkpoint (--folder)")
    parser.add_argument("--folder", type=Path, default=None, help="folder: the checkpoint's Hugging Face folder")
    parser.add_argument("--kv-cache", action="store_true", help="folder: export with --kv-cache")
    parser.add_argument("--code", type=Path, default=ROOT, help="folder: the checkout whose package runs "
                        "(default this one; another one measures the code before a change)")
    parser.add_argument("--label", default="after", help="folder: the run's name in the results (default after)")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 16 for 1b, 32 for 8b)")
    parser.add_argument("--keep", action="store_true", help="keep the exported model (1b: under export/bench-llama-1b/)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update benchmarks/results")
    parser.add_argument("--work", type=Path, default=None, help="8b: folder for the checkpoint and exports "
                        "(about 36 GB; default a temporary folder)")
    parser.add_argument("--schemes", default="int4,int8", help="8b: --quantize schemes, comma-separated")
    ns = parser.parse_args()
    if ns.model == "8b":
        from export_scale_8b import run_8b

        work = ns.work or Path(tempfile.mkdtemp(prefix="bench-export-8b-"))
        result = run_8b(work, ns.schemes.split(","), ns.keep, ns.layers, write=not ns.no_write)
        print(json.dumps({k: {kk: v[kk] for kk in ("exit_code", "wall_s", "export_peak_rss_gib", "target_met")}
                          for k, v in result["schemes"].items()}, indent=1))
        return 0 if all(v["exit_code"] == 0 and v["target_met"] for v in result["schemes"].values()) else 1
    if ns.model == "folder":
        if ns.folder is None or not (ns.folder / "config.json").is_file():
            parser.error("--model folder needs --folder, a Hugging Face folder with a config.json")
        result = run_folder(ns.folder.resolve(), ns.kv_cache, ns.code.resolve(), ns.label)
        print(json.dumps({k: result[k] for k in ("checkpoint", "label", "kv_cache", "exit_code", "wall_s",
                                                 "peak_rss_bytes", "peak_rss_over_weights", "stages", "parity",
                                                 "stderr_tail")}, indent=1))
        if not ns.no_write:
            write_real(result)
        return 0 if result["peak_rss_over_weights"] <= REAL_TARGET_RATIO else 1
    ns.layers = ns.layers or 16
    result = run(ns.layers, ns.keep)
    print(json.dumps({k: result[k] for k in ("wall_s", "peak_rss_bytes", "peak_rss_over_weights",
                                             "export_peak_rss_over_weights", "target_met_by_export",
                                             "target_met_by_whole_command", "onnxruntime_alone_peak_rss_bytes",
                                             "exit_code", "stages", "parity", "stdout", "stderr_tail")}, indent=1))
    if not ns.no_write:
        write(result)
    return 0 if result["exit_code"] == 0 and result["target_met_by_whole_command"] else 1


if __name__ == "__main__":
    sys.exit(main())
