"""Export a pre-norm model to ONNX with every RMSNorm as its exact spec, then check its parity.

MODEL is a preset name (e.g. tiny), a preset TOML file, a Hugging Face folder (config.json +
*.safetensors), or a llama.cpp/Ollama GGUF file (or a folder holding one and no config.json): its
weights dequantized to float32 by transformers' GGUF loader are the checkpoint, its tokenizer and chat
template come along. Every norm is detected and confirmed bit for bit before export; the graph is
written atomically with report.json beside it, and ONNX Runtime CPU is compared with the PyTorch
model (same dtype) and with a float64 run. Exit code 1 if the parity check fails, 2 on bad input
(nothing is written)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rmsnorm_deploy.contract.dtypes import MODEL_DTYPES
from rmsnorm_deploy.decoder.convention import TARGETS
from rmsnorm_deploy.decoder.quantize import (
    BLOCK_SIZES,
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_BLOCK_SIZE,
    SCHEMES,
    Quantization,
)
from rmsnorm_deploy.exporter.plan import DEFAULT_BATCH, DEFAULT_SEQ, ExportOptions, load_torch_model, plan_export
from rmsnorm_deploy.graph.lowerings import LOWERINGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="preset name (e.g. tiny), preset TOML file, Hugging Face folder, or GGUF file (or a "
                             "folder holding one .gguf and no config.json; dequantized to float32 once, cached)")
    parser.add_argument("-o", "--output", metavar="OUT",
                        help="model file (*.onnx) or folder (gets model.onnx); default export/<model>/<dtype>-<lowering>/")
    parser.add_argument("--dtype", default="float32", choices=MODEL_DTYPES, help="activation and weight dtype (default float32)")
    parser.add_argument("--lowering", default="function", choices=LOWERINGS,
                        help="how each RMSNorm is written (default function; see README)")
    parser.add_argument("--opset", type=int,
                        help="ONNX opset, 18 to 23 (default 18; 23 for --lowering native or --fuse-attention)")
    parser.add_argument("--fuse-attention", action="store_true",
                        help="write attention and rotary embeddings as ONNX opset-23 Attention and RotaryEmbedding "
                             "(faster in ONNX Runtime; TensorRT imports them from 10.15 on); implies --opset 23")
    parser.add_argument("--kv-cache", action="store_true",
                        help="one graph for prefill and decode with past/present key-value tensors (the convention "
                             "optimum and onnxruntime-genai read), genai_config.json and the Hugging Face config and "
                             "tokenizer files beside it; run it with `rmsnorm-deploy generate`")
    parser.add_argument("--target", default=None, choices=TARGETS,
                        help="the --kv-cache graph: portable (plain ops; TensorRT and every runtime) or onnxruntime "
                             "(GroupQueryAttention and fused projections, written from the module tree; fastest in "
                             "ONNX Runtime). Default portable")
    parser.add_argument("--share-buffer", action="store_true",
                        help="--target onnxruntime: past and present share one max-length buffer "
                             "(onnxruntime-genai's past_present_share_buffer)")
    parser.add_argument("--quantize", choices=SCHEMES,
                        help="--target onnxruntime: weight-only quantized projections (ONNX Runtime's MatMulNBits, "
                             "quantized by its own quantizers), a recipe: int8 / int4 (symmetric, every projection), "
                             "int8-smooth (int8, each projection's input smoothed per feature as measured on a "
                             "calibration text before the kernel rounds it to int8), "
                             "int4-mixed (llama.cpp Q4_K_M's layout: 4-bit with zero points, 8-bit head and half "
                             "the Q/K/V, output and down projections), int4-kquant (the same, 4-bit blocks by "
                             "k-quant search), int4-hqq (the same, 4-bit blocks by ONNX Runtime's HQQ), int8-asym (8-bit with zero points, head too), int4-fit (4-bit "
                             "with a least-squares float scale and offset per block, 8-bit head), "
                             "int4-fit-mixed (int4-mixed's layout, int4-fit's blocks), int4-auto (int4-fit with "
                             "the projections measured to lose the most on a calibration text in 8 bits), int4-auto-zp (the same with an "
                             "integer zero point per block: the fast kernel alone), int4-gptq (int4-auto-zp's units and grid, "
                             "the 4-bit blocks by GPTQ under the calibration text's input Hessian); "
                             "each weight's width is printed and written in the model's metadata; every norm stays "
                             "exact, in float32")
    parser.add_argument("--block-size", type=int, metavar="N",
                        help=f"--quantize: weights per scale, one of {', '.join(map(str, BLOCK_SIZES))} "
                             f"(default {DEFAULT_BLOCK_SIZE})")
    parser.add_argument("--accuracy-level", type=int, metavar="L",
                        help="--quantize: MatMulNBits' accuracy_level: 0 or 1 compute in float32, 4 in int8 "
                             f"(default {DEFAULT_ACCURACY_LEVEL}: the fastest)")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="--quantize int8/int4: the LM head too (default: kept in the graph's dtype; the other "
                             "recipes always quantize it); a tied head and embedding are then one quantized weight")
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                        help=f"example batch size: traced and checked (default {DEFAULT_BATCH})")
    parser.add_argument("--seq", type=int, default=DEFAULT_SEQ,
                        help=f"example sequence length: traced and checked (default {DEFAULT_SEQ})")
    parser.add_argument("--norm-spec", action="append", default=[], metavar="CLASS_OR_PATH=SPEC",
                        help="declare the spec of the norms of a class (e.g. MixtralRMSNorm) or at a module path: a "
                             "named spec (torch, llama, gemma, olmo2, nogain; epsilon read from the module) or fields "
                             "(eps=1e-6,gain=offset,order=scale_then_cast); confirmed bit for bit; repeatable")
    parser.add_argument("--force", action="store_true", help="replace an existing model and report")


def run(args: argparse.Namespace) -> int:
    from rmsnorm_deploy.decoder.export import DecoderOptions, open_model, plan_decoder_export, run_decoder_export
    from rmsnorm_deploy.errors import UserError
    from rmsnorm_deploy.exporter.pipeline import run_export
    from rmsnorm_deploy.progress import Progress
    from rmsnorm_deploy.table import format_table

    options = ExportOptions(dtype=args.dtype, lowering=args.lowering, opset=args.opset, batch=args.batch,
                            seq=args.seq, force=args.force, release_model=True, fuse_attention=args.fuse_attention,
                            norm_specs=tuple(args.norm_spec))
    if not args.kv_cache and (args.target is not None or args.share_buffer or args.quantize):
        flag = (f"--target {args.target}" if args.target is not None else
                "--share-buffer" if args.share_buffer else f"--quantize {args.quantize}")
        raise UserError(f"{flag} is an option of the KV-cache decoder graph; add --kv-cache")
    if args.kv_cache:
        decoder = DecoderOptions(target=args.target or "portable", share_buffer=args.share_buffer,
                                 quantization=_quantization(args))
        decoder_plan = plan_decoder_export(options, decoder, model_ref=args.model, output=args.output)
        plan = decoder_plan.export
    else:
        plan = plan_export(options, model_ref=args.model, output=args.output)
    target = plan.model_path

    progress = Progress(prefix="export ")
    if args.kv_cache and decoder.target == "onnxruntime":
        with progress.stage(f"reading {args.model} in {options.dtype} (a folder's weights stay on disk)") as st:
            loaded, tensors = open_model(args.model, decoder_plan)
            st.note(f"{loaded.parameter_count() / 1e6:.1f}M parameters")
        return _run_ort_decoder(loaded, decoder_plan, progress, tensors)
    with progress.stage(f"loading {args.model} in {options.dtype}") as st:
        loaded = load_torch_model(args.model, options.dtype)
        st.note(f"{loaded.parameter_count() / 1e6:.1f}M parameters")
    if args.kv_cache:
        result = run_decoder_export(loaded, decoder_plan, progress=progress)
    else:
        result = run_export(loaded, plan, progress=progress)

    size = target.stat().st_size + _size(target.parent / (target.name + ".data"))
    print(f"exported {target} ({size / 2**20:.1f} MiB, opset {result.report['opset']}, {options.dtype}, "
          f"lowering {options.lowering})")
    if result.fusions is not None:
        print(f"fused: {result.fusions.describe()}")
    if result.report.get("kv_cache"):
        kv = result.report["kv_cache"]
        print(f"KV cache: {kv['num_layers']} layers x past/present [batch, {kv['kv_heads']}, past, {kv['head_dim']}] "
              f"{kv['dtype']}, up to {kv['max_length']} positions; beside it: "
              f"{', '.join(result.report.get('serving_files', []))} (run it: rmsnorm-deploy generate {target.parent})")
    groups: dict[tuple[str, str, str], int] = {}
    for norm in result.detection.norms:
        key = (norm.class_name.rsplit(".", 1)[-1], norm.how, norm.spec.describe())
        groups[key] = groups.get(key, 0) + 1
    print(format_table(["norms", "class", "found as", "spec (confirmed bit for bit against the module)"],
                       [[count, cls, how, spec] for (cls, how, spec), count in groups.items()]))
    for path, cls in result.detection.other_norms:
        print(f"left as exported by torch (not an RMSNorm): {path} ({cls})")
    for left in result.detection.not_exported:
        print(f"not on the exported path (never called on the example input): {left.name} ({left.class_name})")
    if result.parity is not None:
        print()
        print(result.parity.table())
    if result.report_path is not None:
        print(f"report: {result.report_path}")
    if result.parity is not None and result.parity.status == "not run":
        print(f"warning: parity not checked: {result.parity.reason}", file=sys.stderr)
    return 1 if result.parity_failed else 0


def _quantization(args: argparse.Namespace) -> Quantization | None:
    """``--quantize`` and its options, checked; None without ``--quantize``."""
    from rmsnorm_deploy.errors import UserError

    if args.quantize is None:
        given = [flag for flag, value in (("--block-size", args.block_size), ("--accuracy-level", args.accuracy_level),
                                          ("--quantize-lm-head", args.quantize_lm_head or None)) if value is not None]
        if given:
            raise UserError(f"{given[0]} is an option of --quantize; add --quantize int8 or --quantize int4")
        return None
    return Quantization(args.quantize, DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size,
                        DEFAULT_ACCURACY_LEVEL if args.accuracy_level is None else args.accuracy_level,
                        args.quantize_lm_head)


def _run_ort_decoder(loaded, decoder_plan, progress, tensors) -> int:
    from rmsnorm_deploy.decoder.export import run_decoder_export

    plan, decoder = decoder_plan.export, decoder_plan.decoder
    options = plan.options
    result = run_decoder_export(loaded, decoder_plan, progress=progress, tensors=tensors)
    dec = result.decoder
    size = plan.model_path.stat().st_size + _size(plan.model_path.parent / (plan.model_path.name + ".data"))
    weights = decoder.quantization.describe() if decoder.quantization is not None else options.dtype
    print(f"exported {plan.model_path} ({size / 2**20:.1f} MiB, {weights}, target onnxruntime, "
          f"{len(dec.model.graph.node)} nodes, {dec.norm_nodes} norm nodes ({options.lowering}), "
          f"LM head {dec.lm_head}, {'shared' if decoder.share_buffer else 'separate'} past/present); beside it: "
          f"{', '.join(result.serving_files)} (run it: rmsnorm-deploy generate {plan.model_path.parent})")
    if result.parity is not None:
        print()
        print(result.parity.table())
    if result.text_cost is not None:
        from rmsnorm_deploy.decoder.divergence import text_cost_line

        print(f"vs the unquantized model on text (what quantization costs, not checked): "
              f"{text_cost_line(result.text_cost)}")
    if result.report_path is not None:
        print(f"report: {result.report_path}")
    if result.layer_by_layer:
        print(f"checked layer by layer: {result.layer_by_layer}")
    return 1 if result.parity_failed else 0


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0
