"""``--quantize`` recipes: which width and quantizer each weight of the decoder gets.

A recipe maps each weight the graph writes (a role: ``qkv``, ``o``, ``gate``, ``up``, ``gate_up``,
``down``, ``head``; and its layer) to a :class:`Width` (bits, symmetric or with zero points, the
quantizer) or to ``None`` (kept in the graph's dtype). ``MatMulNBits`` has one width per node, so
a fused projection (Q/K/V together) gets one width.

- ``int8`` / ``int4``: every projection 8 or 4 bits, symmetric, ONNX Runtime's round-to-nearest
  (its ``DefaultWeightOnlyQuantizer``); the LM head only with ``--quantize-lm-head``.
- ``int4-mixed``: llama.cpp's Q4_K_M layout on ONNX Runtime's kernels: 4-bit blocks with zero
  points (round-to-nearest over each block's range) for most projections; 8 bits for the tensors
  Q4_K_M widens (``src/llama-quant.cpp``, ``llama_tensor_get_type``): the output / tied embedding
  (Q6_K there), and, in the layers its ``use_more_bits`` picks (the first and last eighth and
  every third between: about half), ``attn_v`` (here the fused Q/K/V it is part of) and
  ``ffn_down`` (Q6_K there); and, measured on SmolLM2-135M (``benchmarks/quant_quality.py``),
  the attention output projection in those layers too (the most perplexity per byte of the
  tensors left at 4 bits). The LM head is always quantized; a tied embedding is then stored
  once, read by the lookup and the head.
- ``int4-kquant``: the same layout with the 4-bit blocks chosen by ONNX Runtime's k-quant search
  (``neural_compressor.weight_only``, llama.cpp's ``make_qkx`` weighted least squares over
  candidate scales): measured worse than round-to-nearest with zero points on SmolLM2.
- ``int4-hqq``: the same layout with the 4-bit blocks from ONNX Runtime's HQQ
  (``HQQWeightOnlyQuantizer``: half-quadratic optimization of each block's zero, no calibration);
  HQQ's float zero is written as ``int4-fit``'s float offset, so the fast kernel runs it.
- ``int8-smooth``: every projection 8 bits, symmetric round-to-nearest, its input first multiplied by a
  per-feature smoothing factor and its weight's input rows divided by it, the strength chosen per input on
  the calibration set (``quant_smoothing``): MatMulNBits at accuracy level 4 rounds its input to int8 in
  blocks, whose outlier features set the block's step; the LM head only with ``--quantize-lm-head`` (unsmoothed).
- ``int8-asym``: every projection and the head 8 bits with zero points (round-to-nearest over
  each block's min..max: no clipping of a block's largest magnitude).
- ``int4-fit``: every projection 4 bits with a float scale and a float offset per block fitted by
  least squares (``quantize.fit_blocks``: llama.cpp's Q4_1/Q4_K grid, a scale and a minimum); the
  offset is not a zero point MatMulNBits' fast kernels take (float zero points compute in float32
  at every accuracy level, measured 4-17x slower decode on ONNX Runtime 1.32 CPU), so the graph
  multiplies the 4-bit grid by a symmetric MatMulNBits and adds the offsets by a second MatMul of
  the input's block sums, 1/block_size of the weights (``quantize`` docstring); the head and tied
  embedding 8 bits.
- ``int4-fit-mixed``: ``int4-mixed``'s layout with ``int4-fit``'s 4-bit blocks.
- ``int4-auto``: ``int4-fit``, with the projections that lose the most per byte at 4 bits in 8 bits,
  measured on the model over a calibration set (``quant_sensitivity``: a shipped text and the
  model's own samples) within the bytes Q4_K_M's layout adds; each 4-bit block fitted under the
  set's mean squared input per feature.
- ``int4-auto-zp``: ``int4-auto`` with an integer zero point per block instead of a float offset
  (``quantize.fit_zero_point_blocks``): the grid MatMulNBits' fast kernel reads as it is, no
  offsets to add (``int4-mixed``'s speed), at a larger error than the offsets' (measured on Gemma 3
  270M: 1.56x their expected output error, 0.58x round-to-nearest's).
- ``int4-gptq``: ``int4-auto-zp``'s 8-bit units and grid, its 4-bit blocks by GPTQ
  (``quantize.gptq_blocks``): each rounding's error spread over the input features not yet
  quantized, under the calibration set's full input second moments (the Hessian), measured a
  group of layers at a time within ``quant_sensitivity.HESSIAN_BYTES`` (a layer alone over it is
  refused: ``quant_sensitivity.LayerHessians``); its head (and tied
  embedding) 8 bits per output channel (``CHANNEL8``), multiplied by ``MatMulInteger`` on the input
  rounded to int8 per row: ONNX Runtime's int8 GEMM reads the head about twice as fast as
  MatMulNBits' 8-bit kernel (measured on SmolLM2-135M: a decode step 0.89x), the input's outlier
  features first moved into the weights by a per-feature smoothing measured on the calibration set.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

#: Quantizers: ONNX Runtime's C++ round-to-nearest kernels, its k-quant scale search, or the
#: least-squares fit of a float scale and a float offset per block (``quantize.fit_blocks``).
#: ``channel``: one scale per output channel (8 bits, symmetric), the input rounded to int8 per row at run
#: time (``quantize.channel_head``).
METHODS = ("rtn", "kquant", "hqq", "fit", "fitzp", "gptq", "channel")
#: Methods whose blocks have a float offset (the scales' dtype) instead of a zero point: the graph
#: adds it by a MatMul of the input's block sums beside a symmetric MatMulNBits.
OFFSET_METHODS = ("fit", "hqq")
#: The roles a weight plays in the decoder graph, by the last name the graph writer gives it
#: (``...layers.3.self_attn.qkv_proj.weight``); ``other``: any other projection.
NAMES = {"qkv_proj": "qkv", "o_proj": "o", "gate_proj": "gate", "up_proj": "up", "gate_up_proj": "gate_up",
         "down_proj": "down", "lm_head": "head"}
ROLES = (*NAMES.values(), "other")
#: The unit a measured recipe widens a role in (``quant_sensitivity``): fused or not, gate and up are one.
UNIT_OF_ROLE = {"qkv": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up", "gate_up": "gate_up", "down": "down"}


def role_of(name: str) -> tuple[str, int]:
    """``(role, layer)`` of a weight the graph writer names ``name`` (layer 0 outside the layers)."""
    parts = name.removesuffix(".weight").split(".")
    layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return NAMES.get(parts[-1], "other"), int(layer.group(1)) if layer else 0


@dataclasses.dataclass(frozen=True)
class Width:
    """How one weight is quantized: ``bits`` (4 or 8), ``symmetric`` (no zero points: the
    kernel's default zero point 2^(bits-1)) or with zero points (uint8; for the ``OFFSET_METHODS``
    a float offset per block instead), and the quantizer ``method``."""

    bits: int
    symmetric: bool = True
    method: str = "rtn"

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.method not in METHODS or (
                self.method not in ("rtn", "channel") and self.symmetric) or (
                self.method == "channel" and (self.bits != 8 or not self.symmetric)):
            raise ValueError(f"no quantizer for {self}")

    @property
    def per_channel(self) -> bool:
        """Whether the weight has one scale per output channel and multiplies int8 rows (MatMulInteger)."""
        return self.method == "channel"

    @property
    def offsets(self) -> bool:
        """Whether each block has a float offset (added by a MatMul of block sums) rather than a zero point."""
        return self.method in OFFSET_METHODS

    @property
    def zero_points(self) -> bool:
        """Whether MatMulNBits reads uint8 zero points for this width."""
        return not self.symmetric and not self.offsets

    def describe(self) -> str:
        if self.per_channel:
            return "int8 per channel, int8 rows (MatMulInteger)"
        zero = "symmetric" if self.symmetric else "block offsets" if self.offsets else "zero points"
        return f"int{self.bits} {zero} {self.method}"

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits(i_layer, n_layers)``: the first and last eighth of the layers
    and every third layer between them (integer division, as there)."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


Rule = Callable[[str, int, int], "Width | None"]


def _uniform(bits: int) -> Rule:
    def rule(role: str, layer: int, layers: int) -> Width | None:
        return Width(bits)
    return rule


def _mixed(four: Width) -> Rule:
    def rule(role: str, layer: int, layers: int) -> Width | None:
        if role == "head" or (role in ("qkv", "o", "down") and use_more_bits(layer, layers)):
            return Width(8)
        return four
    return rule


def _int8_asym(role: str, layer: int, layers: int) -> Width | None:
    return Width(8, symmetric=False)


def _fit_head8(role: str, layer: int, layers: int) -> Width | None:
    return Width(8) if role == "head" else FIT4


#: 4-bit blocks with a fitted float scale and float offset each (``quantize.fit_blocks``).
FIT4 = Width(4, symmetric=False, method="fit")
#: 4-bit blocks with a fitted float scale and integer zero point each (``quantize.fit_zero_point_blocks``).
FITZP4 = Width(4, symmetric=False, method="fitzp")


def _fitzp_head8(role: str, layer: int, layers: int) -> Width | None:
    return Width(8) if role == "head" else FITZP4


#: 4-bit blocks in the integer-zero-point grid by GPTQ under the calibration inputs (``quantize.gptq_blocks``).
GPTQ4 = Width(4, symmetric=False, method="gptq")


#: The head in 8 bits per output channel, multiplied by int8 rows (``quantize.channel_head``).
CHANNEL8 = Width(8, method="channel")


def _gptq_head8(role: str, layer: int, layers: int) -> Width | None:
    return CHANNEL8 if role == "head" else GPTQ4


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    rule: Rule
    #: the LM head is quantized whatever ``--quantize-lm-head`` says (the recipe names its width)
    head_always: bool
    summary: str
    #: the recipe's 8-bit units are chosen by measuring the model (``quant_sensitivity``), at ``upgrade``
    measured: bool = False
    upgrade: Width = Width(8)
    #: the projections' inputs are smoothed as measured (``quant_smoothing``) instead of any unit widened
    smoothed: bool = False

    @property
    def unmeasured(self) -> str:
        """The recipe to choose where this measured one cannot run the model on its calibration set."""
        return "int8" if self.smoothed else "int4-mixed"

    def width(self, role: str, layer: int, layers: int) -> Width:
        if role not in ROLES:
            raise ValueError(f"unknown weight role {role!r}")
        return self.rule(role, layer, layers)


RECIPES = {r.name: r for r in (
    Recipe("int8", _uniform(8), False, "8-bit symmetric round-to-nearest"),
    Recipe("int4", _uniform(4), False, "4-bit symmetric round-to-nearest"),
    Recipe("int8-smooth", _uniform(8), False,
           "8-bit symmetric round-to-nearest, each projection's input smoothed per feature as measured on a "
           "calibration set (the outliers moved into the weights before the kernel rounds the input to int8)",
           measured=True, smoothed=True),
    Recipe("int4-mixed", _mixed(Width(4, symmetric=False)), True,
           "llama.cpp Q4_K_M's layout: 4-bit with zero points; 8-bit head/tied embedding, and Q/K/V, output and down "
           "projections in half the layers (llama.cpp's use_more_bits)"),
    Recipe("int4-kquant", _mixed(Width(4, symmetric=False, method="kquant")), True,
           "int4-mixed's layout with ONNX Runtime's k-quant search for the 4-bit blocks"),
    Recipe("int4-hqq", _mixed(Width(4, symmetric=False, method="hqq")), True,
           "int4-mixed's layout with ONNX Runtime's HQQ (half-quadratic, calibration-free) for the 4-bit blocks, "
           "run as int4-fit's offsets"),
    Recipe("int8-asym", _int8_asym, True, "8-bit with zero points, round-to-nearest, the head too"),
    Recipe("int4-fit", _fit_head8, True,
           "4-bit with a least-squares float scale and float offset per block; 8-bit head/tied embedding"),
    Recipe("int4-fit-mixed", _mixed(FIT4), True,
           "int4-mixed's layout (llama.cpp Q4_K_M's 8-bit tensors) with int4-fit's 4-bit blocks"),
    Recipe("int4-auto", _fit_head8, True,
           "int4-fit's blocks; the Q/K/V, output, gate+up or down projections of the layers that lose the most "
           "to 4 bits per byte, measured on a calibration set, in 8 bits within Q4_K_M's added bytes", measured=True),
    Recipe("int4-auto-zp", _fitzp_head8, True,
           "int4-auto with integer zero points instead of offsets: the fast kernel alone, each block's scale and "
           "zero point fitted under the measured inputs", measured=True),
    Recipe("int4-gptq", _gptq_head8, True,
           "int4-auto-zp's units and grid, each 4-bit block by GPTQ: its rounding errors spread over the features "
           "after it under the calibration set's input Hessian; the head 8-bit per channel on int8 rows "
           "(MatMulInteger), smoothed as measured", measured=True),
)}
