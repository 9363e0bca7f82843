"""Every decoder family of the installed transformers that has an RMS norm: our export against torch.onnx alone.

For each causal-LM model type of transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), a tiny
random model from its config (2 layers, hidden 64, 4 heads over 2 KV heads, vocabulary 256; norm
gains moved off their initial values by ``hf.from_config``) is

* exported by rmsnorm-deploy in float32 (``function`` lowering; probing finds the specs of
  unknown norm classes): status (``pass`` / ``FAIL`` / the one-line error), max abs error of
  ONNX Runtime's logits vs transformers' eager float32 logits, RMSNorm nodes in the graph and
  norm modules found, and the float16 export's parity status;
* exported by ``torch.onnx.export(dynamo=True)`` alone (same wrapper, same input, no norm
  handling): status and max abs error vs eager float32 in ONNX Runtime.

Families without a module whose class name says RMS norm are listed as skipped. Each family runs
in its own process with a timeout; results are merged into benchmarks/results/hf_families.json
(so the run can be split: ``--families a,b`` or ``--chunk 2/5``) and the table rewritten into
hf_families.md.

    python -m benchmarks.sweeps.hf_families --chunk 1/4 --timeout 400
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
JSON = RESULTS / "hf_families.json"
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, head_dim=16, pad_token_id=0, bos_token_id=1,
            eos_token_id=1)
#: A value in EXTRA that leaves a TINY field out of the family's config (a read-only property there).
DROP = object()
#: Per-family config fields a tiny model of that family needs besides TINY.
EXTRA: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=16),
}
#: Multi-head latent attention (DeepSeek-V2/V3 style): low ranks, a rotary head_dim that matches
#: qk_rope_head_dim, and as many key/value heads as query heads (the latent K/V is per head).
_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
            num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=1, n_group=1, topk_group=1)
#: DeepSeek-V3.2's sparse-attention indexer, small enough for 16 tokens.
_INDEXER = dict(index_topk=8, index_head_dim=16, index_n_heads=2)
EXTRA.update({
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": {**_MLA, **_INDEXER},
    "axk1": _MLA,
    "axk2": {**_MLA, **_INDEXER, "gated_norm_rank": 4},
    "deepseek_v32": {**_MLA, **_INDEXER},
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    # AFMoE's router gate is zero-initialized (every token an exact tie of all its experts): kept
    # small so the export is quick; its parity reports the ties (exporter/routing.py)
    "afmoe": dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32),
    # hybrid and MoE families whose default expert counts (256-512) and linear-attention or
    # Mamba dims made the "tiny" model slow enough to time out (a 2x16 forward of Qwen3-Next's
    # took 15-40 s, its float64 run 76 s, on 2 busy cores)
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       layer_types=["linear_attention", "full_attention"]),
    "inkling_text": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                         swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8,
                         rel_extent=32),
    "bailing_hybrid": {**_MLA, "num_local_experts": 4, "layer_group_size": 2},
    # Mamba's chunk size stays the default (256): both parity shapes (16 and 21 tokens) in one chunk.
    # With 16, Falcon-H1's graph traced at 16 tokens (one chunk) fails in ONNX Runtime at 21 (two):
    # "Shape mismatch attempting to re-use buffer {3,1,4,16,16} != {3,2,4,16,16}" in a Slice.
    "bamba": dict(mamba_n_heads=4, mamba_d_state=16),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=16),
    "falcon": dict(head_dim=DROP),  # a property of FalconConfig (hidden / heads = 16 here too)
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                  first_k_dense_replace=1),
    "dots3_note_text": _MLA,
    # MLA families: the latent K/V is per head (with TINY's 2 KV heads for 4 query heads the forward
    # fails in attention), and youtu's and longcat_flash's rotary tables are sized by head_dim, which
    # must equal qk_rope_head_dim (TINY's 16 against the default 64 fails in the rotary product)
    "youtu": _MLA,
    "minicpm3": _MLA,
    "sarvam_mla": _MLA,
    # and LongCat-Flash's router also picks among zero (identity) experts: 2 of them beside the 4
    # routed ones, not the default 256 that would take nearly every top-2 choice
    "longcat_flash": {**_MLA, "zero_expert_num": 2},
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
})
GATED_HINT = "gated norm"
#: The parity status of an export whose every difference is a top-k routing choice flipped on a
#: near-tie (``rmsnorm_deploy.exporter.parity.ROUTING_TIE``): not the target, not a defect.
ROUTING_TIE = "routing tie"


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _config(model_type: str) -> dict:
    merged = {**TINY, **EXTRA.get(model_type, {}), "model_type": model_type}
    return {k: v for k, v in merged.items() if v is not DROP}


def _norm_classes(module) -> list[str]:
    """The class names of the normalization modules in ``module`` (by name, minus known non-norms)."""
    import re

    from rmsnorm_deploy.exporter.probing import NOT_NORMS

    return sorted({type(m).__name__ for m in module.modules()
                   if re.search("norm", type(m).__name__, re.I) and not isinstance(m, NOT_NORMS)})


def _has_rms_norm(classes: list[str]) -> bool:
    import re

    return any(re.search("RMS|Rms|rmsnorm", c) for c in classes)  # not "LayerNormSelf..."


def _meta_triage(model_type: str) -> dict | None:
    """The row of a family without an RMS norm, found on the meta device in this process (no weights,
    no child process); None when the family has one or its tiny model does not build here."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.for_model(**_config(model_type))
        model_cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
        with torch.device("meta"):
            classes = _norm_classes(model_cls(config))
    except Exception:  # noqa: BLE001 - the child process reports why it does not build
        return None
    return None if _has_rms_norm(classes) else {"family": model_type, "norm_classes": classes,
                                                "status": "no RMS norm"}


def _max_abs(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def run_family(model_type: str) -> dict:
    """One family, in this process."""
    warnings.simplefilter("ignore")
    import torch

    from rmsnorm_deploy.errors import one_line
    from rmsnorm_deploy.exporter import hf
    from rmsnorm_deploy.exporter.pipeline import export_model, norm_node_count

    row: dict = {"family": model_type}
    try:
        loaded = hf.from_config(_config(model_type), "float32", seed=1)
    except Exception as exc:  # noqa: BLE001 - a family whose tiny config does not build is reported
        row["status"] = "config failed"
        row["error"] = f"{type(exc).__name__}: {one_line(exc, limit=200)}"
        return row
    row["norm_classes"] = _norm_classes(loaded.module)
    if not _has_rms_norm(row["norm_classes"]):
        row["status"] = "no RMS norm"
        return row
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        eager = loaded.module(input_ids=ids)["logits"].numpy()
    import onnx

    from rmsnorm_deploy.exporter.plan import ExportOptions
    from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        try:
            result = export_model(loaded, Path(tmp) / "ours.onnx", ExportOptions())
            row["ours"] = result.parity.status
            if result.parity.reason:
                row["ours_reason"] = result.parity.reason[:300]
            row["norm_nodes"] = norm_node_count(onnx.load(str(Path(tmp) / "ours.onnx")))
            row["norm_modules"] = len(result.detection.norms)
            row["how"] = sorted({n.how for n in result.detection.norms})
            if result.detection.not_exported:  # norm-like modules text input never calls: not in the graph
                row["not_exported"] = [n.name for n in result.detection.not_exported]
            with OnnxRuntimeRunner(Path(tmp) / "ours.onnx", ["cpu"]) as runner:
                row["ours_max_abs"] = _max_abs(runner.infer({"input_ids": ids.numpy()})["logits"], eager)
        except Exception as exc:  # noqa: BLE001
            row["ours"] = "error"
            message = f"{type(exc).__name__}: {one_line(exc, limit=300)}"
            row["ours_reason"] = message
            if "gated" in message or "second input" in message or "tensors inside the model" in message:
                row["ours"] = GATED_HINT
        row["ours_s"] = round(time.perf_counter() - start, 1)
        if row["ours"] == "pass":
            try:
                half = hf.from_config(_config(model_type), "float16", seed=1)
                parity16 = export_model(half, Path(tmp) / "fp16" / "model.onnx", ExportOptions(dtype="float16")).parity
                row["ours_fp16"] = parity16.status
                if parity16.reason:
                    row["ours_fp16_reason"] = parity16.reason[:300]
            except Exception as exc:  # noqa: BLE001
                row["ours_fp16"] = f"error: {type(exc).__name__}: {one_line(exc, limit=160)}"
        start = time.perf_counter()
        try:
            from rmsnorm_deploy.exporter.surgery import quiet_exporter

            with quiet_exporter():
                program = torch.onnx.export(loaded.module, (), kwargs={"input_ids": ids}, dynamo=True,
                                            input_names=["input_ids"], output_names=["logits"],
                                            dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}})
            program.save(str(Path(tmp) / "torch.onnx"))
            with OnnxRuntimeRunner(Path(tmp) / "torch.onnx", ["cpu"]) as runner:
                row["torch_onnx_max_abs"] = _max_abs(runner.infer({"input_ids": ids.numpy()})["logits"], eager)
            row["torch_onnx"] = "exports"
        except Exception as exc:  # noqa: BLE001
            chain = exc
            while chain.__cause__ is not None:
                chain = chain.__cause__
            row["torch_onnx"] = "fails"
            row["torch_onnx_error"] = f"{type(chain).__name__}: {one_line(chain, limit=200)}"
        row["torch_onnx_s"] = round(time.perf_counter() - start, 1)
    ok_ours = row.get("ours") == "pass" and row.get("ours_max_abs", 1.0) <= 1e-4 and \
        row.get("norm_nodes") == row.get("norm_modules")
    if ok_ours:
        row["status"] = "target met"
    elif row.get("ours") == ROUTING_TIE:  # parity proved it: the routing flipped on a near-tie (exporter/routing.py)
        row["status"] = ROUTING_TIE
    else:
        row["status"] = "torch.onnx fails too" if row["torch_onnx"] == "fails" else "miss"
    return row


#: Why a family misses the target, where a measurement beyond its row found out (the row's own
#: error says the rest). Keyed by model type.
EXPLAINED: dict[str, str] = {
    "jetmoe": "exact routing tie: the padding token's all-zero embedding scores every expert 0.0; ONNX TopK "
              "takes the lowest indices, torch.topk others; with torch's routing forced the logits agree to 1.2e-7",
    "mixtral": "float16 only: a near-tie of 2 float16 ULPs in layer 1's router (0.09472656 vs 0.09460449); "
               "with torch's routing forced the logits agree to 4.9e-4 (tolerance 0.02)",
    "afmoe": "transformers zero-initializes AFMoE's router, so in a random model every token ties across "
             "all experts; forced routing agrees to 4.6e-7",
    "deepseek_v32": "the sparse-attention indexer's top-k over masked -inf scores is a tie (margin 0)",
    "axk2": "the sparse-attention indexer's top-k over masked -inf scores is a tie (margin 0)",
    "deepseek_v4": "x * rsqrt(mean(x^2) + eps) rounds differently from every spec (2 ULP in float16): "
                   "refused with the closest candidate; it needs a spec of its own",
    "hrm_text": "a recurrent model: its 10 norm modules run 4 times each, so 40 norm nodes (one per call, "
                "each exact) is right; logits within 2.2e-7",
    "gemma3": "the multimodal model, its vision tower at its defaults (2.7B parameters): text input never "
              "calls its projector's mm_soft_emb_norm, listed as not on the exported path; the float16 run is "
              "refused by the memory budget; its decoder, gemma3_text, meets the target (3.6e-7)",
    "moss_transcribe_diarize": "its tiny config keeps the audio encoder's defaults (908M parameters): the "
                               "float16 run was refused by the memory budget while another row ran beside it",
    "gemma4_unified": "multimodal: over 900 s at load 6-9; its decoder, gemma4_text, meets the target",
    "kimi_linear": "a linear-attention hybrid: about 900 s per row (torch.export's symbolic tracing), run "
                   "alone with a 1,500 s timeout",
    "qwen3_5_moe_text": "a linear-attention MoE hybrid: about 670 s per row, run alone with a 1,500 s timeout",
    "longcat_flash": "its experts (with identity 'zero' experts) are not @use_experts_implementation, so no "
                     "batched_mm: the eager loop over nonzero() of the experts hit is data-dependent for "
                     "torch.export (unbind of an unbacked size)",
    "nanochat": "its final norm module runs twice (on the embeddings before the layers, and after them), so 10 "
                "norm nodes for 9 modules (one per call, each exact) is right; logits within 2.4e-7",
    "phi4_multimodal": "the audio encoder's weightless Phi4MultimodalAudioMeanVarianceNormLayer is never called "
                       "on text input, so it is not in the graph: left out and listed (report.json's "
                       "not_exported_norms); the 5 text norms are exact",
}
#: Verdicts that count as explained misses in the summary.
EXPLAINED_VERDICTS = ("torch.onnx fails too", ROUTING_TIE)


def write_markdown(data: dict) -> None:
    """The table, with every causal-LM type of the installed transformers (not run ones included)."""
    try:
        everything = families()
    except Exception:  # noqa: BLE001 - without transformers, the measured rows only
        everything = []
    measured = data["rows"]
    rows = [measured.get(name, {"family": name, "status": "not run in this pass"})
            for name in sorted(set(everything) | set(measured))]
    count = lambda *verdicts: sum(1 for r in rows if r.get("status") in verdicts)  # noqa: E731
    with_rms = [r for r in rows if r.get("status") not in ("no RMS norm", "config failed", "not run in this pass")]
    lines = [
        "# Decoder families of transformers with an RMS norm: rmsnorm-deploy vs torch.onnx alone",
        "",
        "Tiny random configs (2 layers, hidden 64, vocabulary 256, norm gains perturbed; per-family fields in "
        "`EXTRA`), float32, `function` lowering; max abs error of ONNX Runtime CPU's logits vs transformers' "
        "eager float32 on input_ids 2x16; float16 parity is the export's own check. Each family runs in its own "
        "process with a timeout. `python -m benchmarks.sweeps.hf_families [--families a,b] [--resume]`.",
        "",
        f"**{len(rows)} causal-LM model types**; {count('not run in this pass')} not run in this pass; "
        f"{count('no RMS norm')} have no RMS norm; {count('config failed')} have no tiny config that builds here. "
        f"Of the {len(with_rms)} measured with an RMS norm: target (logits within 1e-4, one norm node per norm "
        f"module) **met by {count('target met')}**; {count(ROUTING_TIE)} differ only by a routing tie (proven by "
        f"forcing torch's expert choice); {count('torch.onnx fails too')} fail in torch.onnx itself (its error "
        f"shown); {count('miss')} miss; {sum(1 for r in rows if str(r.get('status', '')).startswith(('timeout', 'crashed')))} "
        "timed out or crashed (see the why column).",
        f"Versions: {json.dumps(data.get('versions', {}))}.",
        "",
        "| family | norm classes | ours | max abs vs eager | norm nodes / modules | fp16 parity | found as | "
        "torch.onnx alone | torch.onnx max abs | verdict | why |",
        "|---|---|---|---:|---|---|---|---|---:|---|---|",
    ]
    fmt = lambda v: f"{v:.2g}" if isinstance(v, float) else ""  # noqa: E731
    for r in rows:
        ours = r.get("ours", r.get("status", ""))
        if r.get("ours_reason") and ours != "pass":
            ours += f": {r['ours_reason'][:160]}"
        elif r.get("error") and ours in ("crashed", "config failed"):
            ours += f": {r['error'].strip().splitlines()[-1][:160]}"
        torch_onnx = r.get("torch_onnx", "")
        if r.get("torch_onnx_error"):
            torch_onnx += f": {r['torch_onnx_error'][:120]}"
        nodes = f"{r['norm_nodes']} / {r['norm_modules']}" if "norm_nodes" in r else ""
        how = ", ".join(h.replace("confirmed by probing: ", "probing: ") for h in r.get("how", []))
        fp16 = r.get("ours_fp16", "") + (f": {r['ours_fp16_reason'][:160]}" if r.get("ours_fp16_reason") else "")
        why = EXPLAINED.get(r["family"], "")
        cells = [r["family"], ", ".join(r.get("norm_classes", [])), ours, fmt(r.get("ours_max_abs")), nodes, fp16, how,
                 torch_onnx, fmt(r.get("torch_onnx_max_abs")), str(r.get("status", "")), why]
        lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    (RESULTS / "hf_families.md").write_text("\n".join(lines) + "\n")


def _run_child(name: str, timeout: float) -> dict:
    """One family in its own process, so that a hang or a crash costs only its row."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        return {"family": name, "status": f"timeout after {timeout:g}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    return json.loads(lines[-1][4:]) if lines else {"family": name, "status": "crashed",
                                                     "error": (proc.stderr or "")[-300:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", help="comma-separated model types (default: all)")
    parser.add_argument("--chunk", help="I/N: the I-th of N equal parts of the family list")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per family (default 600)")
    parser.add_argument("--markdown", action="store_true", help="only rewrite the table from the JSON")
    parser.add_argument("--resume", action="store_true", help="skip families already in the JSON")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one family, JSON on stdout
    args = parser.parse_args()
    if args.one:
        try:
            row = run_family(args.one)
        except Exception as exc:  # noqa: BLE001
            row = {"family": args.one, "status": "crashed", "error": traceback.format_exc(limit=-2)[-400:]}
            del exc
        print("ROW " + json.dumps(row), flush=True)
        return 0
    if args.markdown:
        write_markdown(json.loads(JSON.read_text()))
        return 0
    names = args.families.split(",") if args.families else families()
    if args.chunk:
        i, n = (int(v) for v in args.chunk.split("/"))
        names = names[i - 1::n]
    from rmsnorm_deploy.graph.metadata import tool_versions

    data = json.loads(JSON.read_text()) if JSON.is_file() else {"benchmark": "hf_families", "rows": {}}
    data["versions"] = tool_versions()
    mine: dict[str, dict] = {}
    data["machine"] = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    done = set(json.loads(JSON.read_text())["rows"]) if args.resume and JSON.is_file() else set()
    for name in names:
        if name in done:
            continue
        start = time.perf_counter()
        row = _meta_triage(name) or _run_child(name, args.timeout)
        row["wall_s"] = round(time.perf_counter() - start, 1)
        mine[name] = row
        if JSON.is_file():  # another chunk may have written rows meanwhile: its new rows count, ours win
            data["rows"] = json.loads(JSON.read_text())["rows"]
        data["rows"].update(mine)
        print(json.dumps(row), flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        staged = JSON.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps(data, indent=1) + "\n")
        staged.replace(JSON)
        write_markdown(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
