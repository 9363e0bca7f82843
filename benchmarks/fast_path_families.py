"""The breadth of ``export --kv-cache --target onnxruntime``: every family it writes, checked and timed.

Not a test: one run, one row per row of the family table (``tests/decoder/families.py``: the
tiny configs the suite holds to transformers), plus one line per refused model type with its
reason. Columns:

* **writes**: the graph is built (``build_decoder``), every norm our exact node audited in float32;
* **exact**: prefill and 4 decode steps (3 left-padded rows, the prompt longer than the sliding
  window where there is one) within the float64-grounded bound, the largest distance to
  transformers float32 shown; and 32 greedy tokens equal to transformers' ``generate``;
* **int4**: ``--quantize int4`` (block 32, float32 compute) writes, and its 16 greedy tokens equal
  transformers' on the dequantized weights;
* **genai runs it**: onnxruntime-genai 0.18's own ``Generator`` on our written folder gives our
  tokens (only where genai knows the model type);
* **decode ms/token**: the same family at a size where time means something (hidden 512, 8 layers,
  8 heads over 4 KV heads, vocabulary 32000, float32; its own fields kept: windows, softcaps,
  multipliers, experts), prompt 128, 64 new tokens, batch 1, 2 threads, ORT_ENABLE_ALL, the median
  over interleaved rounds: our ``export`` (the CLI, parity included) decoded by our loop, beside
  onnxruntime-genai's builder (``-p fp32 -e cpu``) decoded by its own runtime where its builder
  writes the family. Both must give transformers' tokens (recorded).

    python benchmarks/fast_path_families.py [--rounds 3] [--rows llama,gemma3,...] [--no-speed] [--merge]

Writes ``benchmarks/results/fast_path_families.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_kv_decode import (  # noqa: E402
    GenaiRuntime,
    build_genai,
    export_folder,
    log,
    ours_runner,
    runner_call,
    save_hf,
)
from rmsnorm_deploy.resources import package_version  # noqa: E402
from tests.decoder.families import ROWS, FamilyRow  # noqa: E402

PROMPT, NEW_TOKENS = 128, 64
#: The timed size: the row's config with these dimensions (its family's own fields kept).
SPEED_DIMS = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=1024)
#: A timed row's sliding window (the tiny rows' 8 would leave nothing to attend to at 128 tokens).
SPEED_WINDOW = 64
#: Config fields scaled with the dimensions where a row has them (MoE expert widths).
SCALED_FIELDS = {"moe_intermediate_size": 704, "intermediate_size_mlp": 1408}


def _short(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def check_row(row: FamilyRow) -> dict[str, Any]:
    """writes / exact / int4 / genai on the row's tiny config (the suite's own checks, measured)."""
    from rmsnorm_deploy.decoder.convention import KVCacheLayout, left_padded
    from rmsnorm_deploy.decoder.genai_client import genai_greedy
    from rmsnorm_deploy.decoder.genai_config import write_serving_files
    from rmsnorm_deploy.decoder.ort_step import KVDecoderRunner
    from rmsnorm_deploy.decoder.ort_export import write_ort_decoder
    from rmsnorm_deploy.decoder.ort_graph import build_decoder
    from rmsnorm_deploy.decoder.ort_parity import audit_norms, decode_parity
    from rmsnorm_deploy.decoder.quantize import Quantization, dequantized_reference
    from rmsnorm_deploy.decoder.transformers_step import transformers_generate
    from rmsnorm_deploy.exporter import hf
    from rmsnorm_deploy.graph.metadata import ModelMetadata

    out: dict[str, Any] = {"row": row.name, "model_type": row.model_type, "window": row.window}
    prompt = (row.window or 4) + 5
    loaded = hf.from_config(row.config, "float32", seed=0)
    lm = loaded.module.model

    def generate_ref(ids: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
        return transformers_generate(lm, ids, mask, max_new_tokens=n, pad_token_id=0, stop_at_eos=False)

    try:
        dec = build_decoder(loaded)
        out["norms"] = audit_norms(dec.model, dec.norm_nodes)
        out["writes"] = True
    except Exception as exc:  # recorded, the table goes on
        out.update(writes=False, why=_short(exc))
        return out
    parity = decode_parity(loaded, dec.model, batch=3, prompt=prompt, steps=4)
    out["max_abs_vs_transformers"] = max(r.max_abs for r in parity.results)
    out["parity"] = "pass" if not parity.failed and parity.tokens_equal else "FAIL"
    rng_ids = np.random.default_rng(3).integers(3, loaded.vocab_size, size=(3, prompt), dtype=np.int64)
    mask = np.ones_like(rng_ids)
    mask[1, :2], mask[2, :4] = 0, 0
    rng_ids[mask == 0] = 0
    ours = KVDecoderRunner(build_decoder(loaded, max_length=64).model).greedy(rng_ids, mask, new_tokens=32).tokens
    out["tokens_equal"] = bool(np.array_equal(ours, generate_ref(rng_ids, mask, 32)))
    try:
        q = build_decoder(loaded, quantization=Quantization("int4", 32, 0, False), max_length=64)
        got = KVDecoderRunner(q.model).greedy(rng_ids[:2], mask[:2], new_tokens=16).tokens
        with dequantized_reference(loaded.module, q.model, ModelMetadata.read(q.model).quantization):
            want = generate_ref(rng_ids[:2], mask[:2], 16)
        out["int4"] = "tokens equal" if np.array_equal(got, want) else "tokens differ"
    except Exception as exc:
        out["int4"] = f"refused: {_short(exc)}"
    if row.genai:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            written = write_ort_decoder(loaded, path, force=False, max_length=64)
            write_serving_files(path, KVCacheLayout.from_dict(ModelMetadata.read(written.model).kv_cache),
                                loaded.source, force=False)
            prompts = [[int(t) for t in rng_ids[0]]]
            want = generate_ref(*left_padded(prompts, 0), 32)[0].tolist()
            try:
                theirs = genai_greedy(path.parent, prompts[0], 32)
                out["genai"] = "tokens equal" if theirs and theirs == want[:len(theirs)] else "tokens differ"
            except Exception as exc:
                out["genai"] = f"error: {_short(exc)}"
    return out


def speed_config(row: FamilyRow) -> dict[str, Any]:
    config = {**row.config, **SPEED_DIMS}
    layers = row.config.get("num_hidden_layers")
    for field, value in row.config.items():  # per-layer lists (layer_types, no_rope_layers, ...): the pattern repeated
        if isinstance(value, list) and len(value) == layers:
            config[field] = [value[i % layers] for i in range(SPEED_DIMS["num_hidden_layers"])]
    for field, value in SCALED_FIELDS.items():
        if field in config:
            config[field] = value
    if row.window is not None:
        config["sliding_window"] = SPEED_WINDOW
    return config


def time_row(row: FamilyRow, rounds: int, tmp: Path) -> dict[str, Any]:
    """decode ms/token of our export and (where it writes the family) genai's builder, interleaved."""
    from rmsnorm_deploy.decoder.transformers_step import transformers_steps
    from rmsnorm_deploy.exporter import hf

    loaded = hf.from_config(speed_config(row), "float32", seed=0)
    hf_dir = tmp / f"{row.name}-hf"
    save_hf(loaded, hf_dir)
    ids = np.random.default_rng(0).integers(3, loaded.vocab_size, size=(1, PROMPT), dtype=np.int64)
    want = transformers_steps(loaded.module.model, ids, new_tokens=NEW_TOKENS, keep_logits=False).tokens
    contenders: dict[str, Any] = {}
    result: dict[str, Any] = {"config": {k: v for k, v in speed_config(row).items() if k in SPEED_DIMS}}
    try:
        folder = export_folder(hf_dir, tmp / f"{row.name}-ours", "--target", "onnxruntime")
        contenders["ours"] = runner_call(ours_runner(folder / "model.onnx"))
    except Exception as exc:
        result["ours_error"] = _short(exc)
    if row.genai:
        try:
            genai_dir = build_genai(hf_dir, tmp / f"{row.name}-genai", tmp / "genai-cache")
            contenders["genai builder"] = GenaiRuntime(genai_dir).greedy
        except Exception as exc:
            result["genai_error"] = _short(exc)
    steps: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        names = [n for n in contenders if f"{n.split()[0]}_error" not in result]
        for name in names[r % max(1, len(names)):] + names[:r % max(1, len(names))]:
            try:
                tokens, _, step_s = contenders[name](ids)
            except Exception as exc:  # its runtime failed on this model: recorded, the others go on
                result[f"{name.split()[0]}_error"] = _short(exc)
                steps.pop(name, None)
                continue
            result.setdefault("tokens_equal_transformers", {})[name] = bool(np.array_equal(tokens, want))
            steps[name].append(1e3 * statistics.mean(step_s))
    for name, values in steps.items():
        result[f"{name} decode ms/token"] = statistics.median(values)
    if "ours" in steps and "genai builder" in steps:
        result["ours / genai"] = result["ours decode ms/token"] / result["genai builder decode ms/token"]
    return result


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# The fast path's breadth: every family `--target onnxruntime` writes",
        "",
        f"{results['when']}, {results['machine']}; onnxruntime {results['versions']['onnxruntime']}, "
        f"transformers {results['versions']['transformers']}, onnxruntime-genai "
        f"{results['versions']['onnxruntime-genai']}. Written by `python benchmarks/fast_path_families.py`.",
        "",
        "Exact: prefill + 4 decode steps on the family table's tiny config (3 left-padded rows, the prompt "
        "past the sliding window), the largest distance to transformers float32, and 32 greedy tokens equal "
        "to transformers'. int4: block 32, float32 compute, 16 greedy tokens against transformers on the "
        "dequantized weights. Decode: hidden 512, 8 layers, vocabulary 32000, float32, prompt 128, 64 new "
        "tokens, batch 1, 2 threads, median over interleaved rounds; genai builder only where it writes "
        "the family. genai: run where onnxruntime-genai 0.18 knows the model type, except the LongRoPE rows "
        "(genai recomputes Phi-3's cache at 4,097 tokens whatever the switch; tests/decoder/test_families.py "
        "holds it to our loop without the recompute there).",
        "",
        "| row | model type | writes | exact (max \\|Δ\\| vs transformers) | tokens past the window | int4 | "
        "genai runs our folder | decode ms/token ours | genai builder | ours / genai |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        speed = row.get("speed", {})

        def ms(key: str) -> str:
            value = speed.get(f"{key} decode ms/token")
            error = speed.get(f"{key.split()[0]}_error")
            if value is not None:
                return f"{value:.2f}"
            return f"failed: {error[:110]}" if error else "–"

        if not row.get("writes"):
            lines.append(f"| {row['row']} | {row['model_type']} | no: {row.get('why')} | | | | | | | |")
            continue
        ratio = speed.get("ours / genai")
        lines.append(
            f"| {row['row']} | {row['model_type']} | yes ({row['norms']} norms, float32) | {row['parity']} "
            f"({row['max_abs_vs_transformers']:.1e}) | {'equal' if row['tokens_equal'] else 'DIFFER'}"
            f"{' (window ' + str(row['window']) + ')' if row['window'] else ''} | {row['int4']} | "
            f"{row.get('genai', '–')} | {ms('ours')} | "
            f"{ms('genai builder') if row.get('genai') else '–'} | {f'{ratio:.2f}' if ratio else '–'} |")
    if results.get("note"):
        lines += ["", results["note"]]
    lines += ["", "## Refused model types", "", "| model type | why |", "|---|---|"]
    lines += [f"| {t} | {why} |" for t, why in sorted(results["refused"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    parser.add_argument("--no-speed", action="store_true", help="skip the decode timings")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the existing results that this run does not measure (and the "
                             "timings of rows run with --no-speed)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    import torch

    from rmsnorm_deploy.decoder.families import REFUSED

    torch.set_num_threads(2)
    wanted = set(args.rows.split(",")) if args.rows else None
    rows = [r for r in ROWS if wanted is None or r.name in wanted]
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "versions": {p: package_version(p) for p in ("onnxruntime", "transformers", "onnxruntime-genai", "torch")},
        "rows": [], "refused": dict(REFUSED),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            log(f"{row.name}")
            try:
                entry = check_row(row)
            except Exception as exc:
                traceback.print_exc()
                entry = {"row": row.name, "model_type": row.model_type, "writes": False, "why": _short(exc)}
            if entry.get("writes") and not args.no_speed:
                try:
                    entry["speed"] = time_row(row, args.rounds, Path(tmp))
                except Exception as exc:
                    traceback.print_exc()
                    entry["speed"] = {"ours_error": _short(exc)}
            results["rows"].append(entry)
            log(json.dumps(entry, default=str))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = out / "fast_path_families.json"
    if args.merge and previous.is_file():
        old = {r["row"]: r for r in json.loads(previous.read_text())["rows"]}
        for entry in results["rows"]:
            if "speed" not in entry and "speed" in old.get(entry["row"], {}):
                entry["speed"] = old[entry["row"]]["speed"]
        ran = {r["row"] for r in results["rows"]}
        order = [r.name for r in ROWS]
        results["rows"] += [r for name, r in old.items() if name not in ran]
        results["rows"].sort(key=lambda r: order.index(r["row"]) if r["row"] in order else len(order))
    (out / "fast_path_families.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "fast_path_families.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
