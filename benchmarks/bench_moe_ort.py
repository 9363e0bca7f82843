"""A mixture-of-experts MLP on ONNX Runtime CPU: ``com.microsoft.MoE`` against two exact decompositions.

Not a test. One modest Mixtral-shaped model (hidden 512, 8 layers, 8 experts of intermediate 1024,
top 2, 8 heads over 4 KV heads, vocabulary 32000, random weights), written by
``--target onnxruntime`` (one ``MoE`` node per layer, ``decoder/ort_moe.py``), then the same graph
with each ``MoE`` node replaced by plain ONNX ops:

* ``dense``: every expert on every token (one MatMul over all experts' fc1, a batched MatMul for
  fc2), weighted by the top-k routing scattered into [tokens, experts] (zeros elsewhere): exact,
  simple, and it reads every expert's weights each step;
* ``gather``: each token's k experts' weights gathered (``Gather`` on the expert axis), then
  batched MatMuls: reads (and copies) only the chosen experts.

Also ``QMoE`` int4 (block 32, accuracy_level 4) for the bytes. Decode ms/token: batch 1, a 32-token
prompt, 64 greedy new tokens, 2 threads, the median step of 3 runs each (interleaved); tokens and
the largest logit difference are checked against the ``MoE`` graph. Writes
``benchmarks/results/moe_ort_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(model_type="mixtral", hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
              vocab_size=32000, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
THREADS, PROMPT, NEW_TOKENS, ROUNDS = 2, 32, 64, 3


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def decompose(model: onnx.ModelProto, how: str) -> onnx.ModelProto:
    """``model`` with each ``MoE`` node written as plain ops (``dense`` or ``gather``, module docstring)."""
    inits = {i.name: i for i in model.graph.initializer}
    nodes, new_inits = [], []
    for n, node in enumerate(model.graph.node):
        if node.op_type != "MoE":
            nodes.append(node)
            continue
        a = _attrs(node)
        x, logits, fc1, fc1_bias, fc2 = (list(node.input) + [""] * 6)[:5]
        fc2_bias = node.input[5] if len(node.input) > 5 else ""
        w1, w2 = numpy_helper.to_array(inits[fc1]), numpy_helper.to_array(inits[fc2])  # [E, 2I, H], [E, H, I]
        experts, hidden, inter = w1.shape[0], w1.shape[2], w2.shape[2]
        p = f"moe{n}/"

        def init(name: str, value: np.ndarray) -> str:
            new_inits.append(numpy_helper.from_array(np.array(value, copy=True, order="C"), p + name))
            return p + name

        def op(kind: str, inputs: list[str], out: str, **attrs: Any) -> str:
            nodes.append(helper.make_node(kind, inputs, [p + out], name=p + out, **attrs))
            return p + out

        x2 = op("Reshape", [x, init("flat_shape", np.array([-1, hidden], np.int64))], "x2")
        probs = op("Softmax", [logits], "probs", axis=-1)
        nodes.append(helper.make_node("TopK", [probs, init("k", np.array([a["k"]], np.int64))],
                                      [p + "top", p + "idx"], name=p + "topk", axis=-1))
        top = p + "top"
        if a.get("normalize_routing_weights", 0):
            top = op("Div", [top, op("ReduceSum", [top, init("axis1", np.array([1], np.int64))], "sum", keepdims=1)],
                     "top_norm")

        def swiglu(gate_up: str, tag: str) -> str:
            shape = op("Concat", [op("Shape", [gate_up], f"{tag}shape", end=-1),
                                  init(f"{tag}pairs", np.array([inter, 2], np.int64))], f"{tag}pair_shape", axis=0)
            pairs = op("Reshape", [op("Slice", [gate_up, init(f"{tag}s0", np.array([0], np.int64)),
                                                init(f"{tag}s1", np.array([2 * inter], np.int64)),
                                                init(f"{tag}ax", np.array([-1], np.int64))], f"{tag}gu"), shape],
                       f"{tag}pairs_r")
            g = op("Gather", [pairs, init(f"{tag}i0", np.array(0, np.int64))], f"{tag}g", axis=-1)
            u = op("Gather", [pairs, init(f"{tag}i1", np.array(1, np.int64))], f"{tag}u", axis=-1)
            alpha = init(f"{tag}alpha", np.array(a.get("activation_alpha", 1.0), np.float32))
            beta = init(f"{tag}beta", np.array(a.get("activation_beta", 0.0), np.float32))
            if "swiglu_limit" in a:
                lim = init(f"{tag}lim", np.array(a["swiglu_limit"], np.float32))
                g = op("Min", [g, lim], f"{tag}g_clamped")
                u = op("Clip", [u, op("Neg", [lim], f"{tag}neg"), lim], f"{tag}u_clamped")
            act = op("Mul", [g, op("Sigmoid", [op("Mul", [g, alpha], f"{tag}ag")], f"{tag}sig")], f"{tag}silu")
            return op("Mul", [act, op("Add", [u, beta], f"{tag}ub")], f"{tag}act")

        if how == "dense":
            w1_all = init("w1_all", w1.transpose(2, 0, 1).reshape(hidden, experts * 2 * inter))  # [H, E*2I]
            gu = op("MatMul", [x2, w1_all], "gu")
            if fc1_bias:
                gu = op("Add", [gu, init("b1_all", numpy_helper.to_array(inits[fc1_bias]).reshape(-1))], "gu_b")
            gu = op("Reshape", [gu, init("gu_shape", np.array([-1, experts, 2 * inter], np.int64))], "gu_e")
            act = op("Unsqueeze", [swiglu(gu, "sw_"), init("ax2", np.array([2], np.int64))], "act4")  # [T, E, 1, I]
            y = op("MatMul", [act, init("w2_t", w2.transpose(0, 2, 1))], "y")  # [T, E, 1, H]
            if fc2_bias:
                y = op("Add", [y, init("b2", numpy_helper.to_array(inits[fc2_bias])[:, None, :])], "y_b")
            zeros = op("Mul", [probs, init("zero", np.array(0.0, np.float32))], "zeros")
            weights = op("ScatterElements", [zeros, p + "idx", top], "weights", axis=1)  # [T, E]
            weights = op("Unsqueeze", [weights, init("ax23", np.array([2, 3], np.int64))], "weights_e")
            out = op("ReduceSum", [op("Mul", [y, weights], "weighted"), init("ax12", np.array([1, 2], np.int64))],
                     "out", keepdims=0)
        else:  # gather
            w1_sel = op("Gather", [init("w1_t", w1.transpose(0, 2, 1)), p + "idx"], "w1_sel", axis=0)  # [T,k,H,2I]
            x4 = op("Unsqueeze", [x2, init("ax12", np.array([1, 2], np.int64))], "x4")  # [T,1,1,H]
            gu = op("MatMul", [x4, w1_sel], "gu")  # [T,k,1,2I]
            if fc1_bias:
                b1 = op("Gather", [init("b1", numpy_helper.to_array(inits[fc1_bias])[:, None, :]), p + "idx"], "b1_sel",
                        axis=0)
                gu = op("Add", [gu, b1], "gu_b")
            w2_sel = op("Gather", [init("w2_t", w2.transpose(0, 2, 1)), p + "idx"], "w2_sel", axis=0)  # [T,k,I,H]
            y = op("MatMul", [swiglu(gu, "sw_"), w2_sel], "y")  # [T,k,1,H]
            if fc2_bias:
                b2 = op("Gather", [init("b2", numpy_helper.to_array(inits[fc2_bias])[:, None, :]), p + "idx"], "b2_sel",
                        axis=0)
                y = op("Add", [y, b2], "y_b")
            weights = op("Unsqueeze", [top, init("ax23", np.array([2, 3], np.int64))], "weights_e")  # [T,k,1,1]
            out = op("ReduceSum", [op("Mul", [y, weights], "weighted"), init("ax1", np.array([1, 2], np.int64))],
                     "out", keepdims=0)
        nodes.append(helper.make_node("Reshape", [out, op("Shape", [x], "x_shape")], list(node.output),
                                      name=p + "back"))
    used = {i for node in nodes for i in node.input}
    graph = helper.make_graph(nodes, model.graph.name, model.graph.input, model.graph.output,
                              [i for i in model.graph.initializer if i.name in used] + new_inits)
    out_model = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version,
                                  functions=model.functions)
    out_model.metadata_props.extend(model.metadata_props)
    return out_model


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    sys.path.insert(0, str(ROOT))
    from rmsnorm_deploy.decoder.ort_step import KVDecoderRunner
    from rmsnorm_deploy.decoder.ort_graph import build_decoder
    from rmsnorm_deploy.decoder.quantize import Quantization
    from rmsnorm_deploy.exporter import hf

    load_before = os.getloadavg()[0]
    loaded = hf.from_config(CONFIG, "float32", seed=0)
    base = build_decoder(loaded).model
    graphs = {"MoE op": base, "dense decomposition": decompose(base, "dense"),
              "gather decomposition": decompose(base, "gather"),
              "QMoE int4 (level 4)": build_decoder(loaded, quantization=Quantization("int4", 32, 4)).model}
    ids = np.random.default_rng(0).integers(3, CONFIG["vocab_size"], size=(1, PROMPT)).astype(np.int64)
    runners = {name: KVDecoderRunner(g, threads=THREADS) for name, g in graphs.items()}
    steps: dict[str, list[float]] = {name: [] for name in graphs}
    tokens, logits = {}, {}
    for r in range(ROUNDS):
        for name in list(graphs)[r % len(graphs):] + list(graphs)[:r % len(graphs)]:
            gen = runners[name].greedy(ids, new_tokens=NEW_TOKENS, keep_logits=True)
            steps[name] += list(gen.step_s[1:])
            tokens[name], logits[name] = gen.tokens, np.stack(gen.step_logits)
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    results = {"config": CONFIG, "load_average_1min_before_after": load, "cpus": os.cpu_count(), "threads": THREADS,
               "prompt": PROMPT, "new_tokens": NEW_TOKENS, "rounds": ROUNDS,
               "contenders": {}}
    for name in graphs:
        same = bool(np.array_equal(tokens[name], tokens["MoE op"]))
        diff = float(np.abs(logits[name][:5] - logits["MoE op"][:5]).max())  # the first steps: the same inputs
        results["contenders"][name] = {"decode_ms_per_token": round(1e3 * statistics.median(steps[name]), 3),
                                       "tokens_equal_to_moe_op": same, "max_logit_diff_first_5_steps": diff}
    out = ROOT / "benchmarks" / "results"
    (out / "moe_ort_cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["# Mixture of experts on ONNX Runtime CPU: MoE op vs exact decompositions", "",
             f"Mixtral-shaped, hidden 512, 8 layers, 8 experts (intermediate 1024), top 2, vocabulary 32000; "
             f"batch 1, prompt {PROMPT}, {NEW_TOKENS} new tokens, {THREADS} threads, median step of {ROUNDS} runs "
             f"(interleaved); {os.cpu_count()} CPUs shared, load average {load[0]} before and {load[1]} after: "
             "compare the rows, not the absolute times. The QMoE row's logits differ by what int4 costs.", "",
             "| graph | decode ms/token | tokens = MoE op's | max logit diff (5 steps) |", "| --- | --- | --- | --- |"]
    for name, r in results["contenders"].items():
        lines.append(f"| {name} | {r['decode_ms_per_token']} | {r['tokens_equal_to_moe_op']} | "
                     f"{r['max_logit_diff_first_5_steps']:.3g} |")
    (out / "moe_ort_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
