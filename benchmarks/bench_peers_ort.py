"""Our exports against the peer exports of the same models in ONNX Runtime CPU: latency, ratio, error.

Not a test: it measures, in one run and side by side, for each model

* ``ours``: ``rmsnorm-deploy export`` (function lowering, opset 18: the portable default);
* ``ours --fuse-attention``: the same with opset-23 ``Attention`` and ``RotaryEmbedding``;
* ``torch.onnx opset 18`` and ``torch.onnx opset 23``: ``torch.onnx.export(dynamo=True)`` with its
  default optimizations (at opset 23 they fuse attention, rotary embeddings and norms);
* ``torch.onnx 18 + ORT optimizer``: ``onnxruntime.transformers.optimizer.optimize_model`` on the
  opset-18 export (``model_type="gpt2"``; for these models it fuses only the norms, as ``bert``
  and ``qwen3`` do);
* ``optimum-onnx`` (Hugging Face models only): ``optimum-cli export onnx --task text-generation``,
  run by ``--optimum-python`` (optimum-onnx 0.1 needs transformers < 4.58, so it usually lives in
  its own environment; the model is handed over as a saved folder); why it did not run otherwise;

at input shapes [1, 512], [2, 64] and [4, 128] (and [1, max] for a model shorter than 512), in
ONNX Runtime CPU with 2 intra-op threads, ORT_ENABLE_ALL, inputs and outputs bound once through
IOBinding. Timing runs in rounds; each round times every export in turn (the order rotates from
round to round, so drift does not favour one side); the latency is the median of all timed calls.
Each output is compared with the model run in float64 (``upcast.float64_outputs``: transformers'
own forward, or the preset's, with every weight in float64 and every norm its float64 oracle).
ONNX Runtime's profiler gives, per export and shape, the kernel time by op type and by kind
(matmul, attention, rotary, norm, cast, other).

    python benchmarks/bench_peers_ort.py [--rounds 7] [--optimum-python /path/to/venv/bin/python]

Writes ``benchmarks/results/peers_ort_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from rmsnorm_deploy.contract.inputs import token_ids  # noqa: E402
from rmsnorm_deploy.resources import package_version  # noqa: E402
from rmsnorm_deploy.exporter.surgery import quiet_exporter  # noqa: E402
from rmsnorm_deploy.table import format_table  # noqa: E402

THREADS = 2
SHAPES = [(1, 512), (2, 64), (4, 128)]
#: The issue's model: a tiny random Hugging Face Llama.
HF_LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)
OURS, OURS_FUSED = "ours", "ours --fuse-attention"
#: op type -> kind, for the profile breakdown (anything else is "other")
KINDS = {
    "matmul": {"MatMul", "FusedMatMul", "Gemm", "MatMulNBits"},
    "attention": {"Attention", "MultiHeadAttention", "GroupQueryAttention", "Softmax", "IsNaN", "Where"},
    "rotary": {"RotaryEmbedding", "Neg", "Split", "Sin", "Cos"},
    "norm": {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization",
             "LayerNormalization", "SkipLayerNormalization", "Pow", "ReduceMean", "Sqrt", "Reciprocal", "Div"},
    "cast": {"Cast"},
}
KIND_OF = {op: kind for kind, ops in KINDS.items() for op in ops}


def quiet():
    """torch.onnx's chatter off the terminal, as the export pipeline keeps it (and ONNX Runtime's)."""
    stack = contextlib.ExitStack()
    stack.enter_context(quiet_exporter())
    for name in ("onnx_ir", "onnxruntime"):
        logger = logging.getLogger(name)
        stack.callback(logger.setLevel, logger.level)
        logger.setLevel(logging.ERROR)
    return stack


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the models ---------------------------------------------------------------------------
def load_models() -> dict[str, Any]:
    from rmsnorm_deploy.exporter import hf, presets

    return {
        "hf-llama (hidden 256, 4 layers, GQA 4:2)": hf.from_config(HF_LLAMA, "float32", seed=0),
        "tiny preset": presets.build_preset(presets.load_preset("tiny"), "float32"),
    }


def shapes_for(loaded: Any) -> list[tuple[int, int]]:
    """The issue's shapes; a model shorter than 512 positions also runs at [1, its maximum]."""
    shapes = list(SHAPES)
    if loaded.max_seq_len < 512:
        shapes.insert(0, (1, loaded.max_seq_len))
    return shapes


# -- the exports --------------------------------------------------------------------------
def export_ours(loaded: Any, out: Path, fuse: bool) -> dict[str, Any]:
    from rmsnorm_deploy.exporter.pipeline import export_model
    from rmsnorm_deploy.exporter.plan import ExportOptions

    result = export_model(loaded, out / "model.onnx", ExportOptions(fuse_attention=fuse, force=True))
    return {"path": str(out / "model.onnx"), "parity": result.parity.status,
            "fusions": result.fusions.to_dict() if result.fusions else None}


def export_torch(loaded: Any, out: Path, opset: int) -> dict[str, Any]:
    """``torch.onnx.export(dynamo=True)`` of the same module as a user would call it (its default
    optimizations on), with dynamic batch and sequence."""
    from rmsnorm_deploy.exporter.pipeline import example_input_ids

    ids = example_input_ids(2, 16, loaded.vocab_size, 0)
    with quiet():
        program = torch.onnx.export(loaded.module, (), kwargs={"input_ids": ids}, dynamo=True, opset_version=opset,
                                    input_names=["input_ids"], output_names=["logits"],
                                    dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}})
        program.save(str(out / "model.onnx"))
    return {"path": str(out / "model.onnx")}


def export_ort_optimizer(source: Path, out: Path, loaded: Any) -> dict[str, Any]:
    from onnxruntime.transformers.optimizer import optimize_model

    module = loaded.module.model
    config = getattr(module, "config", None)
    heads = config.num_attention_heads if config is not None else module.args.n_heads
    hidden = config.hidden_size if config is not None else module.args.dim
    with quiet():
        optimized = optimize_model(str(source), model_type="gpt2", num_heads=heads, hidden_size=hidden)
        fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
        optimized.save_model_to_file(str(out / "model.onnx"))
    return {"path": str(out / "model.onnx"), "fused": fused}


def export_optimum(loaded: Any, out: Path, python: str | None) -> dict[str, Any]:
    if loaded.source.get("kind") != "hf":
        raise RuntimeError("not applicable: optimum exports Hugging Face models, this is a preset")
    python = python or sys.executable
    probe = subprocess.run([python, "-c", "import optimum.exporters.onnx, optimum.version as v; print(v.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(f"optimum-onnx is not importable by {python} ({probe.stderr.strip().splitlines()[-1:]}); "
                           "it needs transformers < 4.58: install it in its own environment and pass --optimum-python")
    folder = out / "hf-folder"
    loaded.module.model.save_pretrained(folder)
    onnx_dir = out / "onnx"
    run = subprocess.run([python, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(folder),
                          "--task", "text-generation", str(onnx_dir)], capture_output=True, text=True)
    if run.returncode != 0 or not (onnx_dir / "model.onnx").is_file():
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"optimum-cli export failed: {tail[:300]}")
    versions = subprocess.run([python, "-c", "import optimum.version, transformers, torch; "
                               "print(optimum.version.__version__, transformers.__version__, torch.__version__)"],
                              capture_output=True, text=True).stdout.split()
    return {"path": str(onnx_dir / "model.onnx"), "versions": dict(zip(["optimum", "transformers", "torch"], versions))}


# -- running ------------------------------------------------------------------------------
def session(path: str, profile_prefix: str | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Idle ORT threads spin after each run; with the exports timed in turn, one session's
    # spinning threads would steal the cores of the next one's timing.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def feeds_for(sess: Any, ids: np.ndarray) -> dict[str, np.ndarray]:
    """``input_ids``, plus the all-ones mask and 0..seq-1 positions that optimum's graphs take."""
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones_like(ids)
        elif i.name == "position_ids":
            feeds[i.name] = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
        else:
            raise RuntimeError(f"unexpected input {i.name!r}")
    return feeds


def bound_call(sess: Any, feeds: dict[str, np.ndarray], out_shape: tuple[int, ...]) -> tuple[Callable[[], None], Any]:
    import onnxruntime as ort

    binding = sess.io_binding()
    keep = []
    for name, array in feeds.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        keep.append(value)
        binding.bind_ortvalue_input(name, value)
    out = ort.OrtValue.ortvalue_from_numpy(np.empty(out_shape, np.float32))
    keep.append(out)
    binding.bind_ortvalue_output("logits", out)
    return (lambda: sess.run_with_iobinding(binding)), (keep, out)


def profile(path: str, feeds: dict[str, np.ndarray], out_shape: tuple[int, ...], calls: int, tmp: Path) -> dict[str, Any]:
    """Kernel time per call by op type and by kind, from ONNX Runtime's profiler (the first run,
    which allocates, is left out)."""
    sess = session(path, profile_prefix=str(tmp / "profile"))
    call, _held = bound_call(sess, feeds, out_shape)
    for _ in range(calls + 1):
        call()
    profile_file = sess.end_profiling()
    events = json.load(open(profile_file))
    os.remove(profile_file)
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    after_first = runs[0]["ts"] + runs[0]["dur"] if runs else 0
    timed_runs = max(1, len(runs) - 1)
    by_op: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= after_first:
            by_op[e["args"]["op_name"]] += e["dur"]
    ops = {op: round(us / timed_runs / 1e3, 3) for op, us in by_op.most_common()}
    kinds: collections.Counter = collections.Counter()
    for op, ms in ops.items():
        kinds[KIND_OF.get(op, "other")] += ms
    return {"ops_ms": ops, "kinds_ms": {k: round(kinds.get(k, 0.0), 3) for k in [*KINDS, "other"]},
            "kernel_total_ms": round(sum(ops.values()), 3), "runs": timed_runs}


def float64_logits(loaded: Any, norms: Any, ids: np.ndarray) -> np.ndarray:
    from rmsnorm_deploy.exporter.upcast import float64_outputs

    return float64_outputs(loaded.module, norms, input_ids=torch.from_numpy(ids))["logits"].numpy()


# -- the run ------------------------------------------------------------------------------
def bench_model(name: str, loaded: Any, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from rmsnorm_deploy.exporter.detect import detect_norms

    norms = detect_norms(loaded.module, dtype="float32").norms
    exports: dict[str, dict[str, Any]] = {}
    makers: list[tuple[str, Callable[[Path], dict[str, Any]]]] = [
        (OURS, lambda d: export_ours(loaded, d, fuse=False)),
        (OURS_FUSED, lambda d: export_ours(loaded, d, fuse=True)),
        ("torch.onnx opset 18", lambda d: export_torch(loaded, d, 18)),
        ("torch.onnx opset 23", lambda d: export_torch(loaded, d, 23)),
        ("torch.onnx 18 + ORT optimizer", lambda d: export_ort_optimizer(Path(exports["torch.onnx opset 18"]["path"]),
                                                                         d, loaded)),
        ("optimum-onnx", lambda d: export_optimum(loaded, d, args.optimum_python)),
    ]
    for i, (label, make) in enumerate(makers):
        folder = tmp / f"{name.split()[0]}-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        clock = time.perf_counter()
        try:
            exports[label] = make(folder)
            exports[label]["export_s"] = round(time.perf_counter() - clock, 1)
            log(f"  exported {label} in {exports[label]['export_s']} s")
        except Exception as exc:  # a peer that cannot export is a result, not a crash
            exports[label] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
            log(f"  {label}: not exported ({exports[label]['error']})")
    for info in exports.values():
        if "path" in info:
            info["ops"] = _graph_ops(info["path"])

    shapes: dict[str, Any] = {}
    for shape in shapes_for(loaded):
        key = f"{shape[0]}x{shape[1]}"
        ids = token_ids(shape, loaded.vocab_size, seed=shape[0] * 1000 + shape[1])
        want = float64_logits(loaded, norms, ids)
        out_shape = want.shape
        rows: dict[str, dict[str, Any]] = {}
        calls: dict[str, Callable[[], None]] = {}
        keep = []
        for label, info in exports.items():
            if "path" not in info:
                rows[label] = {"ran": False, "error": "not exported: " + info["error"]}
                continue
            try:
                sess = session(info["path"])
                feeds = feeds_for(sess, ids)
                call, held = bound_call(sess, feeds, out_shape)
                call()
                got = held[1].numpy()
                rows[label] = {"ran": True, "max_abs_error": float(np.abs(got.astype(np.float64) - want).max())}
                calls[label] = call
                keep.append((sess, held))
            except Exception as exc:
                rows[label] = {"ran": False, "error": " ".join(str(exc).split())[:300]}
        # rounds, the order rotating, so drift does not favour one export
        labels = list(calls)
        per_call = _estimate(calls)
        times: dict[str, list[float]] = {label: [] for label in labels}
        round_medians: dict[str, list[float]] = {label: [] for label in labels}
        for r in range(args.rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            for label in order:
                call = calls[label]
                n = max(5, int(args.block_seconds / per_call[label]))
                call()
                block = []
                for _ in range(n):
                    start = time.perf_counter()
                    call()
                    block.append(time.perf_counter() - start)
                times[label] += block
                round_medians[label].append(statistics.median(block) * 1e3)
        for label in labels:
            rows[label]["median_ms"] = round(statistics.median(times[label]) * 1e3, 3)
            rows[label]["calls"] = len(times[label])
            rows[label]["round_medians_ms"] = [round(t, 3) for t in round_medians[label]]
        if args.profile:
            for label in labels:
                feeds = feeds_for(keep[labels.index(label)][0], ids)
                rows[label]["profile"] = profile(exports[label]["path"], feeds, out_shape, args.profile_calls, tmp)
        peers = {label: row["median_ms"] for label, row in rows.items()
                 if row.get("ran") and not label.startswith(OURS)}
        fastest = min(peers, key=peers.get) if peers else None
        for label in (OURS, OURS_FUSED):
            if rows.get(label, {}).get("ran") and fastest:
                rows[label]["ratio_to_fastest_peer"] = round(rows[label]["median_ms"] / peers[fastest], 3)
        shapes[key] = {"exports": rows, "fastest_peer": fastest}
        log(f"  {key}: " + ", ".join(f"{label} {row['median_ms']:.2f} ms" if row.get("ran") else f"{label} FAILED"
                                     for label, row in rows.items()))
    return {"exports": exports, "shapes": shapes, "max_seq_len": loaded.max_seq_len}


def _estimate(calls: dict[str, Callable[[], None]]) -> dict[str, float]:
    out = {}
    for label, call in calls.items():
        start = time.perf_counter()
        for _ in range(3):
            call()
        out[label] = (time.perf_counter() - start) / 3
    return out


def _graph_ops(path: str) -> dict[str, int]:
    import onnx

    model = onnx.load(path, load_external_data=False)
    return dict(collections.Counter(n.op_type for n in model.graph.node).most_common())


# -- reporting ----------------------------------------------------------------------------
def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = ["# Our exports vs peer exports in ONNX Runtime CPU", "",
             f"ONNX Runtime {env['onnxruntime']} CPU, {THREADS} intra-op threads, ORT_ENABLE_ALL, float32, inputs "
             f"bound once; median of {results['settings']['rounds']} interleaved rounds. torch {env['torch']}, "
             f"transformers {env['transformers']}, onnxscript {env['onnxscript']}; {env['cpu']}; load average "
             f"{env['load_before']} before, {env['load_after']} after.", "",
             "ratio = our latency / the fastest peer that ran at that shape (< 1: ours is faster). "
             "error = max abs difference of the logits from the model run in float64.", ""]
    for model, data in results["models"].items():
        lines += [f"## {model}", ""]
        shapes = list(data["shapes"])
        headers = ["export"] + [f"{s} ms" for s in shapes] + [f"{s} error" for s in shapes]
        rows = []
        for label in data["exports"]:
            row = [label]
            for s in shapes:
                r = data["shapes"][s]["exports"][label]
                if not r.get("ran"):
                    row.append("failed")
                    continue
                ratio = f" ({r['ratio_to_fastest_peer']:.2f}x)" if "ratio_to_fastest_peer" in r else ""
                mark = " *" if data["shapes"][s]["fastest_peer"] == label else ""
                row.append(f"{r['median_ms']:.2f}{ratio}{mark}")
            for s in shapes:
                r = data["shapes"][s]["exports"][label]
                row.append(f"{r['max_abs_error']:.1e}" if r.get("ran") else "-")
            rows.append(row)
        lines += ["```", format_table(headers, rows), "```", "", "`*` the fastest peer at that shape.", ""]
        failures = [(label, s, data["shapes"][s]["exports"][label]["error"]) for label in data["exports"] for s in shapes
                    if not data["shapes"][s]["exports"][label].get("ran")]
        seen = set()
        for label, s, err in failures:
            if (label, err) in seen:
                continue
            seen.add((label, err))
            where = [x for lab, x, e in failures if lab == label and e == err]
            lines.append(f"- {label} failed at {', '.join(where)}: {err[:240]}")
        if failures:
            lines.append("")
        if any("profile" in r for s in shapes for r in data["shapes"][s]["exports"].values()):
            lines += ["Kernel time per call by kind (ONNX Runtime profiler, ms), ours with --fuse-attention "
                      "against the fastest peer:", ""]
            kinds = [*KINDS, "other"]
            prow = []
            for s in shapes:
                fastest = data["shapes"][s]["fastest_peer"]
                for label in (OURS_FUSED, fastest, OURS):
                    r = data["shapes"][s]["exports"].get(label, {})
                    if "profile" not in r:
                        continue
                    p = r["profile"]
                    prow.append([s, label] + [f"{p['kinds_ms'][k]:.2f}" for k in kinds] + [f"{p['kernel_total_ms']:.2f}"])
            lines += ["```", format_table(["shape", "export"] + kinds + ["total"], prow), "```", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    parser.add_argument("--block-seconds", type=float, default=0.25, help="time per export per round (default 0.25)")
    parser.add_argument("--optimum-python", help="a Python with optimum-onnx installed (default: this one)")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip ONNX Runtime's profiler")
    parser.add_argument("--profile-calls", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    import onnxruntime

    env = {
        "onnxruntime": onnxruntime.__version__, "torch": torch.__version__, "onnx": package_version("onnx"),
        "onnxscript": package_version("onnxscript"), "transformers": package_version("transformers"),
        "python": platform.python_version(), "cpu": f"{os.cpu_count()} CPUs ({platform.machine()})",
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }
    torch.set_num_threads(THREADS)
    results: dict[str, Any] = {"environment": env, "settings": {
        "threads": THREADS, "rounds": args.rounds, "block_seconds": args.block_seconds,
        "graph_optimization": "ORT_ENABLE_ALL", "shapes": [list(s) for s in SHAPES]}, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        for name, loaded in load_models().items():
            log(f"{name}:")
            results["models"][name] = bench_model(name, loaded, args, Path(tmp))
    env["load_after"] = [round(x, 2) for x in os.getloadavg()]
    for data in results["models"].values():  # paths of a temporary folder mean nothing afterwards
        for info in data["exports"].values():
            info.pop("path", None)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "peers_ort_cpu.json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results)
    (args.out_dir / "peers_ort_cpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
