"""A mixture-of-experts MLP in the ONNX Runtime decoder graph: the router's MatMul and one
``com.microsoft.MoE`` (``QMoE`` with ``--quantize``).

What ONNX Runtime 1.32's CPU kernels compute (measured; held by the MoE rows of the family table
and ``tests/decoder/test_moe.py``):

- ``MoE`` takes the router's *logits* [tokens, experts] and computes softmax, top-k and, with
  ``normalize_routing_weights``, the renormalization over the k; then ``sum_k w_k * fc2_k(swiglu(fc1_k(x)))``
  with ``swiglu = G * sigmoid(alpha * G) * (L + beta)``, ``G``, ``L`` the gate and up clamped to
  ``swiglu_limit``: within 6e-7 of the float64 expert math of Qwen3-MoE, Mixtral and gpt-oss.
- Only the fused, interleaved gate/up layout runs on CPU (``swiglu_fusion=1``: fc1 [experts, 2I,
  hidden], rows gate 0, up 0, gate 1, ...; fc2 [experts, hidden, I]); fc3 and ``swiglu_fusion`` 0/2
  are refused at session start.
- ``QMoE`` reads ONNX Runtime's own ``quantize_matmul_{4,8}bits`` packing per expert ([experts, N,
  K * bits / 8], scales [experts, N, K / block], ``weights_prepacked=0``; symmetric, as
  ``MatMulNBits``) and is exact against the dequantized weights: float32 activations for int4 at
  ``accuracy_level`` 0/1; int8 weights always, and int4 at level 4, round each expert's input and
  activated intermediate to int8 per block (``quantize.round_activations``).
- ``QMoE`` renormalizes the top k even at ``normalize_routing_weights=0``; given ``router_weights``
  it selects on ``router_probs`` and mixes with ``router_weights``' values there: the softmax is the
  unnormalized routing, exactly.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from rmsnorm_deploy.decoder.ort_model import MS_DOMAIN, OrtDecoderError
from rmsnorm_deploy.decoder.quantize import QuantizedExperts, expert_rows, expert_width


def make_moe(b: Any, family: Any, mlp: torch.nn.Module, x: str, base: str) -> str:
    """``mlp`` (a sparse block of ``family``, a ``MoEFamily``) on ``x`` [batch, seq, hidden], written by
    the builder ``b``: router logits, then one MoE (or QMoE) node."""
    config = b.lm.config
    router, experts = getattr(mlp, family.router, None), getattr(mlp, family.experts, None)
    if router is None or experts is None or not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        raise OrtDecoderError(f"{b._path(mlp)}: not a mixture-of-experts block with {family.router!r} and fused "
                              f"{family.experts!r} parameters, as {family.model_type} layers are")
    count, k = int(experts.gate_up_proj.shape[0]), family.top_k(config)
    params = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if family.expert_bias else ())
    names = {p: b._tensor_name(getattr(experts, p), f"{b._path(experts)}.{p}") for p in params}
    hidden, inter = b.dims.hidden, int(experts.down_proj.shape[1 if family.experts_transposed else 2])
    # the router: [tokens, experts] logits (its weight is not quantized: the op routes on them)
    r_name = b._tensor_name(router.weight, f"{b._path(router)}.weight")
    r_weight = b.w.blocks(f"{base}.mlp.router.weight", (hidden, count), b.w.np_dtype,
                          b._transposed_blocks([r_name], count, hidden))
    logits = b.w.one("MatMul", [x, r_weight], f"{base}/mlp/router")
    if getattr(router, "bias", None) is not None:
        bias = b.tensors.get(b._tensor_name(router.bias, f"{b._path(router)}.bias"))
        logits = b.w.one("Add", [logits, b.w.weight(f"{base}.mlp.router.bias", bias)], f"{base}/mlp/router_bias")
    flat = b.w.one("Reshape", [logits, b.i64(f"{base}/router_shape", [-1, count])], f"{base}/mlp/router_logits")
    halves = not family.gate_up_interleaved
    layouts = {"gate_up_proj": (2 * inter, hidden, halves), "down_proj": (hidden, inter, False)}

    def matrices(param: str) -> Iterator[torch.Tensor]:
        for e in range(count):
            yield expert_rows(b.tensors.rows(names[param], e, e + 1)[0], transposed=family.experts_transposed,
                              halves=layouts[param][2])

    fc = {}
    for param, fc_name in (("gate_up_proj", "fc1"), ("down_proj", "fc2")):
        n, kk, rows_halves = layouts[param]
        where = f"{base}.mlp.experts.{fc_name}"
        if b.quantizer is None:
            fc[fc_name] = [b.w.blocks(where, (count, n, kk), b.w.np_dtype,
                                      (b.w.cast(m)[None] for m in matrices(param)))]
        else:
            fc[fc_name] = _quantized(b, where, matrices(param), count, n, kk,
                                     f"{b._path(experts)}.{param}", family.experts_transposed, rows_halves)
        bias = names.get(f"{param}_bias")
        fc[fc_name].append("" if bias is None else b.w.weight(f"{where}.bias", torch.stack(
            [expert_rows(row, transposed=False, halves=rows_halves) for row in b.tensors.get(bias)])))
    alpha, beta, limit = family.swiglu(config)
    attrs = dict(k=k, normalize_routing_weights=int(family.normalize_routing(config)), activation_type="swiglu",
                 swiglu_fusion=1, activation_alpha=float(alpha), activation_beta=float(beta),
                 **({"swiglu_limit": float(limit)} if limit is not None else {}))
    if b.quantizer is None:
        return b.w.one("MoE", [x, flat, *fc["fc1"], *fc["fc2"]], f"{base}/mlp/moe", domain=MS_DOMAIN, **attrs)
    q = b.quantization
    (p1, s1, b1), (p2, s2, b2) = fc["fc1"], fc["fc2"]
    # QMoE renormalizes whatever normalize_routing_weights says: unnormalized, it mixes with the softmax
    mix = [] if attrs["normalize_routing_weights"] else [""] * 6 + [
        b.w.one("Softmax", [flat], f"{base}/mlp/router_softmax", axis=-1)]
    return b.w.one("QMoE", [x, flat, p1, s1, b1, p2, s2, b2, *mix], f"{base}/mlp/qmoe", domain=MS_DOMAIN,
                   expert_weight_bits=q.bits, block_size=q.block_size, accuracy_level=q.accuracy_level,
                   weights_prepacked=0, **attrs)


def _quantized(b: Any, where: str, matrices: Iterator[torch.Tensor], count: int, n: int, k: int, parameter: str,
               transposed: bool, halves: bool) -> list[str]:
    """ONNX Runtime's quantizer on each expert's [N, K] weight: [packed, scales] for QMoE, recorded
    (``quantize.QuantizedExperts``) for the dequantized reference."""
    q = b.quantization
    if q.bits == 8 and q.compute != "int8":
        raise OrtDecoderError("QMoE computes int8 experts with int8 activations on CPU whatever the accuracy level; "
                              "export this mixture-of-experts model at int8 with --accuracy-level 4")
    if k % q.block_size or n % q.block_size:
        raise OrtDecoderError(f"{parameter}: QMoE needs the experts' hidden and intermediate sizes ({k}, {n}) to be "
                              f"multiples of the block size {q.block_size}; choose a smaller --block-size")
    scales: list[np.ndarray] = []

    def packed() -> Iterator[np.ndarray]:
        for m in matrices:
            w = b.quantizer(b.w.cast_transposed(m), expert_width(q))
            scales.append(w.scales[None])
            yield w.packed.reshape(1, n, -1)

    packed_name = b.w.blocks(f"{where}_Q{q.bits}", (count, n, k * q.bits // 8), np.uint8, packed())
    scale_name = b.w.blocks(f"{where}_scales", (count, n, k // q.block_size), b.w.np_dtype, scales)
    b.quantized_experts.append(QuantizedExperts(packed_name, scale_name, k, n, count, parameter, transposed, halves))
    return [packed_name, scale_name]
