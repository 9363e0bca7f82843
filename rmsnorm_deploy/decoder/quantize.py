"""Weight-only int8/int4 MatMuls (``export --quantize``): ONNX Runtime's quantizer, and what it computes.

Each projection weight is quantized by ONNX Runtime's own weight-only quantizers, one tensor at a
time, so the graph writer can stream, at the width its ``--quantize`` recipe names for it
(``quant_recipes``): round-to-nearest
(``onnxruntime.quantization.matmul_nbits_quantizer.DefaultWeightOnlyQuantizer.qbits_block_quant``,
its C++ ``quantize_matmul_4bits``/``quantize_matmul_8bits`` kernels), symmetric or with zero
points, or the k-quant scale search (``onnxruntime.quantization.neural_compressor.weight_only``);
one float scale (and zero point) per ``block_size`` values of an input column, packed as
``com.microsoft.MatMulNBits`` reads it ([N, K / block_size, block_size * bits / 8] bytes). The
norms are not touched: they stay our exact ``rmsnorm_deploy::RMSNorm`` nodes.

What the kernel multiplies by, and so the reference a quantized graph is held to:

- the weights, dequantized: ``(q - zero_point) * scale``, the zero point ``2^(bits-1)`` where
  there is none (:func:`dequantize`; exact in float32, and equal bit for bit to what
  ``MatMulNBits`` multiplies an identity matrix into and what ``GatherBlockQuantized`` looks up);
- for a fitted width (``Width.offsets``), ``(q - 2^(bits-1)) * scale + offset``: MatMulNBits
  (symmetric) multiplies the first term, and a float MatMul of the input's sums over each block
  by the offsets [K / block_size, N] adds the second; the offsets are 1/block_size of the weights,
  and cost a few microseconds a projection where float zero points cost the fast kernel
  (``benchmarks/results/quant_quality.md``);
- at ``accuracy_level`` 0 or 1 the input as it is (float32 compute);
- at ``accuracy_level`` 4 (int8 compute) the input rounded per row and block of ``block_size`` to
  int8, with the scale ``max|x| / 127`` of its block (:func:`round_activations`), before the int8
  dot products are summed in int32; the offsets' block sums read the input as it is;
- for a per-channel width (``Width.per_channel``, not MatMulNBits: ``MatMulInteger``), the weight
  int8 [N, K] with one scale per output row, the input multiplied by a smoothing factor per feature
  and rounded to int8 per row, the int32 products scaled back (:func:`channel_head`, step for step
  as the graph's nodes; its lookup :func:`dequantize_channel`).

:func:`dequantized_reference` puts exactly that into a PyTorch model in place of its Linear
weights (and, at int8 compute, on their inputs), for the time of a comparison.

Long: what a quantized weight is, packed, recorded and read back, is one fact kept in one place for
projections, the tied head and embedding, and QMoE's experts alike; split, the packing and its
reference would drift apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from rmsnorm_deploy.decoder.quant_recipes import OFFSET_METHODS, RECIPES, UNIT_OF_ROLE, Recipe, Width
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.quantized import ACCURACY_COMPUTE
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.resources import package_version

#: ``--quantize`` recipes (``quant_recipes``): each weight's width and quantizer.
SCHEMES = tuple(RECIPES)
#: ``--accuracy-level`` -> the dtype MatMulNBits computes in on ONNX Runtime CPU.
ACCURACY_LEVELS = ACCURACY_COMPUTE
#: The fastest level at both bit widths on this project's CPU measurement (int8 weights compute
#: 10x slower in float32 than in int8): benchmarks/results/quant_accuracy_levels.md.
DEFAULT_ACCURACY_LEVEL = 4
#: MatMulNBits block sizes: powers of two from 16.
BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 32


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How the weights are quantized: the recipe ``scheme`` (``quant_recipes.RECIPES``),
    ``block_size`` values per scale, the kernel's ``accuracy_level``, and whether the LM head is
    quantized too (a recipe may quantize it always: ``Recipe.head_always``)."""

    scheme: str
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    lm_head: bool = False
    #: a measured recipe's choice (``quant_sensitivity.measured``): the (unit, layer)s in 8 bits
    upgrades: tuple[tuple[str, int], ...] = ()
    #: and what was measured, recorded in the metadata
    measurement: dict[str, Any] | None = dataclasses.field(default=None, compare=False, hash=False)
    #: the measured mean squared input per feature [K] of each Linear (its path in the causal LM), which
    #: weights a fitted width's least squares (llama.cpp's importance matrix); not in the metadata
    #: (GPTQ's: the input's second moments [K, K], measured as asked for: ``quant_sensitivity.LayerHessians``)
    importance: Mapping[str, np.ndarray] | None = dataclasses.field(default=None, compare=False, hash=False,
                                                                    repr=False)
    #: the measured smoothing of a per-channel width (``quant_sensitivity.head_smoothing``) or of MatMulNBits
    #: projections (``quant_smoothing``): the factor [K] the input is multiplied by (and the weight's input rows
    #: divided by) before rounding, per Linear path; a per-channel width without one: ones, any other: no Mul
    smoothing: dict[str, np.ndarray] | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.scheme not in RECIPES:
            raise UserError(f"unknown --quantize {self.scheme!r}; choose one of {', '.join(RECIPES)}")
        if isinstance(self.block_size, bool) or self.block_size not in BLOCK_SIZES:
            raise UserError(f"--block-size {self.block_size!r} is not one MatMulNBits takes; choose one of "
                            f"{', '.join(map(str, BLOCK_SIZES))}")
        if isinstance(self.accuracy_level, bool) or self.accuracy_level not in ACCURACY_LEVELS:
            raise UserError(f"--accuracy-level {self.accuracy_level!r} is not one of "
                            + ", ".join(f"{k} ({v} compute)" for k, v in ACCURACY_LEVELS.items())
                            + " (2 and 3 ask for float16 and bfloat16 compute, which ONNX Runtime CPU runs as 1)")

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.scheme]

    @property
    def head(self) -> bool:
        """Whether the LM head is quantized (asked for, or the recipe's own choice)."""
        return self.lm_head or self.recipe.head_always

    def width(self, role: str, layer: int = 0, layers: int = 1) -> Width | None:
        """The width of one weight (``quant_recipes.ROLES``); None: kept in the graph's dtype."""
        if role == "head" and not self.head:
            return None
        if self.recipe.measured:
            if self.measurement is None:
                raise UserError(f"--quantize {self.scheme} chooses its widths by measuring the model; "
                                "measure it first (quant_sensitivity.measured)")
            if (UNIT_OF_ROLE.get(role), layer) in self.upgrades:
                return self.recipe.upgrade
        return self.recipe.width(role, layer, layers)

    @property
    def bits(self) -> int:
        """The bits of a projection in the recipe's first layer (every one, for int8 and int4)."""
        return self.recipe.width("o", 0, 1).bits

    @property
    def compute(self) -> str:
        """The dtype MatMulNBits computes in: ``float32`` or ``int8``."""
        return ACCURACY_LEVELS[self.accuracy_level]

    def describe(self) -> str:
        head = ", LM head too" if self.head else ", LM head unquantized"
        what = "symmetric" if self.scheme in ("int8", "int4") else self.recipe.summary
        return (f"{self.scheme} weights (block {self.block_size}, {what}), accuracy_level {self.accuracy_level} "
                f"({self.compute} compute){head}")

    def node_attributes(self, k: int, n: int, bits: int | None = None) -> dict[str, int]:
        """MatMulNBits' attributes; ``accuracy_level`` 0 is left out, as ONNX Runtime's quantizer does."""
        attrs = {"K": int(k), "N": int(n), "bits": int(bits or self.bits), "block_size": self.block_size}
        if self.accuracy_level:
            attrs["accuracy_level"] = self.accuracy_level
        return attrs


@dataclasses.dataclass
class QuantizedWeight:
    """One weight as MatMulNBits reads it: ``packed`` [N, K/block, block*bits/8] uint8, ``scales``
    [N, K/block] (the graph's float dtype), ``zero_points`` [N, ceil(K/block * bits/8)] uint8 or None,
    ``offsets`` [N, K/block] (the scales' dtype) for a fitted width, else None."""

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    offsets: np.ndarray | None = None


def _rtn(width: Width, block_size: int) -> Any:
    module = require("onnxruntime.quantization.matmul_nbits_quantizer", "quantizing weights (--quantize)")
    config = module.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=width.symmetric, bits=width.bits)
    return module.DefaultWeightOnlyQuantizer(config)


def _kquant(weight_kn: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ONNX Runtime's k-quant search on a [K, N] weight: (q [N, blocks, block] uint8, scales [N,
    blocks] float64, zero points [N, blocks] uint8); K padded with zeros to whole blocks."""
    module = require("onnxruntime.quantization.neural_compressor.weight_only", "quantizing weights (--quantize)")
    k, n = weight_kn.shape
    blocks = -(-k // block_size)
    padded = np.zeros((n, blocks * block_size), np.float32)
    padded[:, :k] = np.asarray(weight_kn, np.float32).T
    q, scales, zero = module.quant_tensor_k_quant_cpu(padded, bits, block_size)
    return (q.astype(np.uint8).reshape(n, blocks, block_size), scales.reshape(n, blocks),
            zero.astype(np.uint8).reshape(n, blocks))


def _hqq(weight_kn: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ONNX Runtime's HQQ (half-quadratic, calibration-free: its ``HQQWeightOnlyQuantizer``'s
    ``quantize_internal``, 20 rounds of a sparse-error shrinkage over each block's float zero) on a
    [K, N] weight, in the offsets form ``(q - 2^(bits-1)) * s + c``: HQQ's ``(q - z) * s`` with
    ``c = (2^(bits-1) - z) * s``, so the fast symmetric kernel computes it (a float zero point
    would not be: the module docstring). Returns (q [N, blocks, block] uint8, s and c [N, blocks] in
    ``weight_kn``'s dtype, each q the nearest level under those stored values); K padded with zeros."""
    module = require("onnxruntime.quantization.matmul_nbits_quantizer", "quantizing weights (--quantize)")
    dtype, levels = weight_kn.dtype, float((1 << bits) - 1)
    k, n = weight_kn.shape
    quantizer = module.HQQWeightOnlyQuantizer(module.HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits))
    tensor = torch.from_numpy(np.ascontiguousarray(np.asarray(weight_kn, np.float32).T))  # [N, K]: blocks along K
    _, inverse, zero = quantizer.quantize_internal(tensor, bits=bits, group_size=block_size, axis=1)
    scale = inverse.double().numpy()  # quantize_internal returns 1 / its inverse scale: the step
    offsets = ((levels + 1) / 2 - zero.double().numpy()) * scale
    scale, offsets = scale.astype(dtype), offsets.astype(dtype)
    w, _, _, _ = _blocks_of(weight_kn, block_size, None)
    return _nearest_levels(w, scale, offsets, levels).astype(np.uint8), scale, offsets


#: The fit's starting ranges: each block's min..max, then narrowed by these fractions of it at
#: each end (a block's outliers may cost more steps than they save), each refined by
#: :data:`FIT_ROUNDS` rounds of least squares; the best (squared error) per block is kept.
FIT_SHRINK = (0.0, 0.05)
FIT_ROUNDS = 3


def fit_blocks(weight_kn: np.ndarray, bits: int, block_size: int, importance: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A float scale ``s`` and a float offset ``c`` per block of ``block_size`` values of each
    input column of ``weight_kn`` [K, N], chosen to minimize the block's squared error of
    ``(q - 2^(bits-1)) * s + c`` (what the graph multiplies by: module docstring), q in
    0..2^bits - 1: alternate rounding q to the nearest level and the least-squares ``(s, c)`` for
    that q, from a few starting ranges (:data:`FIT_SHRINK`). Returns (q [N, blocks, block] uint8,
    s and c [N, blocks] in ``weight_kn``'s dtype, each q the nearest level under those stored values);
    K padded to whole blocks, the padding left out of every fit. A block whose values lie on any
    16-level (2^bits) evenly spaced grid that spans it is found exactly from the min..max start.
    ``importance`` [K] (the mean squared input of each input feature): the squared errors are
    weighted by it, so the fit minimizes the expected output error, not the weights' (a floor of
    1e-4 of its mean keeps a feature the text never used from being ignored)."""
    dtype, levels = weight_kn.dtype, float((1 << bits) - 1)
    w, weights, lo, hi = _blocks_of(weight_kn, block_size, importance)
    n, blocks = lo.shape
    count = weights.sum(-1)
    best = (np.full((n, blocks), np.inf), np.zeros((n, blocks)), np.zeros((n, blocks)))
    for shrink in FIT_SHRINK:
        scale = (hi - lo) * (1.0 - 2.0 * shrink) / levels
        scale = np.where(scale > 0, scale, 1.0)
        offset = lo + (hi - lo) * shrink
        for _ in range(FIT_ROUNDS + 1):
            error, scale_cast, zero_cast, _ = _fit_error(w, weights, scale, offset, levels, dtype)
            better = error < best[0]
            best = (np.where(better, error, best[0]), np.where(better, scale_cast, best[1]),
                    np.where(better, zero_cast, best[2]))
            q = np.clip(np.rint((w - offset[..., None]) / scale[..., None]), 0, levels)
            sq, sqq = (weights * q).sum(-1), (weights * q * q).sum(-1)
            sw, sqw = (weights * w).sum(-1), (weights * q * w).sum(-1)
            det = count * sqq - sq * sq
            ok = det > 0
            fitted = np.where(ok, (count * sqw - sq * sw) / np.where(ok, det, 1.0), scale)
            ok &= fitted > 0
            scale = np.where(ok, fitted, scale)
            offset = np.where(ok, (sw - scale * sq) / count, offset)
    scale, offsets = best[1].astype(dtype), best[2].astype(dtype)
    q = _nearest_levels(w, scale, offsets, levels)
    return q.astype(np.uint8), scale, offsets


#: The integer zero points tried around each starting range's own (:func:`fit_zero_point_blocks`).
ZERO_STEPS = (-1, 0, 1)


def fit_zero_point_blocks(weight_kn: np.ndarray, bits: int, block_size: int, importance: np.ndarray | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`fit_blocks` in the fast kernel's own form: per block a float scale ``s`` and an
    integer zero point ``z`` (0..2^bits - 1), the weights ``(q - z) * s``, so MatMulNBits computes
    them with no offsets to add. From each starting range (:data:`FIT_SHRINK`) and the zero points
    next to its own (:data:`ZERO_STEPS`), alternate rounding q to the nearest level and the
    (importance-weighted) least-squares scale for that q and z; keep per block the lowest error.
    Returns (q [N, blocks, block] uint8, s [N, blocks] in ``weight_kn``'s dtype, z [N, blocks] uint8)."""
    dtype, levels = weight_kn.dtype, float((1 << bits) - 1)
    w, weights, lo, hi = _blocks_of(weight_kn, block_size, importance)
    n, blocks = lo.shape
    best = (np.full((n, blocks), np.inf), np.ones((n, blocks)), np.zeros((n, blocks)))
    for shrink in FIT_SHRINK:
        start = np.maximum((hi - lo) * (1.0 - 2.0 * shrink) / levels, 1e-30)
        own = np.clip(np.rint(-(lo + (hi - lo) * shrink) / start), 0, levels)
        for step in ZERO_STEPS:
            zero, scale = np.clip(own + step, 0, levels), start
            for _ in range(FIT_ROUNDS + 1):
                scale_cast = scale.astype(dtype).astype(np.float64)
                q = np.clip(np.rint(w / scale_cast[..., None] + zero[..., None]), 0, levels)
                d = q - zero[..., None]
                error = (weights * (d * scale_cast[..., None] - w) ** 2).sum(-1)
                better = error < best[0]
                best = (np.where(better, error, best[0]), np.where(better, scale_cast, best[1]),
                        np.where(better, zero, best[2]))
                num, den = (weights * d * w).sum(-1), (weights * d * d).sum(-1)
                ok = (den > 0) & (num > 0)
                scale = np.where(ok, num / np.where(ok, den, 1.0), scale)
    scale, zero = best[1].astype(dtype), best[2]
    q = np.clip(np.rint(w / scale.astype(np.float64)[..., None] + zero[..., None]), 0, levels)
    return q.astype(np.uint8), scale, zero.astype(np.uint8)


#: GPTQ's dampening: this share of the Hessian's mean diagonal added to its diagonal (the paper's 0.01).
GPTQ_DAMP = 0.01


@dataclasses.dataclass(frozen=True)
class GptqFactor:
    """What GPTQ reads of a Hessian, whatever the weight: the blocks in the order they are quantized,
    each block's features in that order, the permuted Hessian's diagonal, and the upper Cholesky
    factor of its inverse (``H^-1 = U^T U``). Made once per Hessian (:func:`gptq_factor`; a
    [8192, 8192] one takes tens of seconds here) and shared by the weight's row blocks and by the
    Linears that read the same input."""

    order: list[int]
    columns: list[np.ndarray]
    diagonal: np.ndarray
    upper: np.ndarray


def gptq_factor(hessian: np.ndarray, k: int, block_size: int, *, by_importance: bool = True) -> GptqFactor:
    """:class:`GptqFactor` of ``hessian`` [K, K] (see :func:`gptq_blocks`)."""
    h = np.array(hessian, np.float64)
    if h.shape != (k, k) or not np.all(np.isfinite(h)):
        raise ValueError(f"a Hessian of shape {h.shape} for K={k}: not K x K finite values")
    blocks = -(-k // block_size)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices(k)] += GPTQ_DAMP * float(np.mean(np.diag(h)))
    # the order the features are quantized in: whole blocks (each keeps its own scale and zero point),
    # the most driven first, and in each its most driven features first (GPTQ's "act order" within
    # the grid's blocks); later features absorb the earlier ones' errors
    drive = np.diag(h)
    spans = [np.arange(b * block_size, min((b + 1) * block_size, k)) for b in range(blocks)]
    order = sorted(range(blocks), key=lambda b: -float(drive[spans[b]].sum())) if by_importance else list(range(blocks))
    columns = [spans[b][np.argsort(-drive[spans[b]], kind="stable")] if by_importance else spans[b] for b in order]
    perm = np.concatenate(columns)
    hp = h[np.ix_(perm, perm)]
    del h
    diagonal = np.diag(hp).copy()
    inverse = np.linalg.inv(hp)
    del hp  # at most two [K, K] float64 arrays held at a time
    lower = np.linalg.cholesky(inverse)
    del inverse
    return GptqFactor(order, columns, diagonal, np.ascontiguousarray(lower.T))  # H^-1 = U^T U, U = lower^T


def gptq_blocks(weight_kn: np.ndarray, bits: int, block_size: int, hessian: np.ndarray | None, *,
                by_importance: bool = True, factor: GptqFactor | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ (Frantar et al. 2022) in MatMulNBits' zero-point grid: the input features are
    quantized one block at a time; each block's scale and integer zero point per output are fitted
    (:func:`fit_zero_point_blocks`, under the Hessian's diagonal) to the weights as updated so far,
    and each rounding's error is spread over the features not yet quantized through the upper
    Cholesky factor of the inverse Hessian, so the output error ``E|x (W - Q)|^2`` under the
    calibration inputs is what is minimized, not the weights'. ``by_importance``: the blocks most
    driven (the largest sum of the Hessian's diagonal) go first, and in each block its most driven
    features (GPTQ's act order, kept within the grid's contiguous blocks), so the features that
    matter most are rounded before they absorb others' errors; else in the graph's order. Measured
    on SmolLM2-135M: KL to the float model 0.063 against 0.072 on the GPL, 0.053 against 0.057 on
    another text (``benchmarks/quant_quality.py``). ``hessian`` [K, K]: ``E[x x^T]`` over the
    calibration set (``quant_sensitivity.LayerHessians``); dampened by :data:`GPTQ_DAMP`; a feature
    the set never drove is quantized on its own; or its ``factor`` made already. Returns what
    :func:`fit_zero_point_blocks` returns (q [N, blocks, block] uint8, s [N, blocks], z [N, blocks])."""
    dtype, levels = weight_kn.dtype, float((1 << bits) - 1)
    k, n = weight_kn.shape
    if factor is None:
        if hessian is None:
            raise ValueError("GPTQ quantizes under the calibration inputs' Hessian [K, K]; none was measured")
        factor = gptq_factor(hessian, k, block_size, by_importance=by_importance)
    if sum(len(c) for c in factor.columns) != k:
        raise ValueError(f"a GPTQ factor of {sum(len(c) for c in factor.columns)} features for K={k}")
    blocks = len(factor.order)
    order, columns, upper = factor.order, factor.columns, factor.upper
    perm = np.concatenate(columns)
    w = np.asarray(weight_kn, np.float64).T[:, perm].copy()  # [N, K] in the order quantized
    qp = np.zeros((n, k), np.float64)
    scales, zeros = np.zeros((n, blocks), dtype), np.zeros((n, blocks), np.uint8)
    start = 0
    for b, inside in zip(order, columns):
        i0, i1 = start, start + len(inside)
        start = i1
        # the block's scale and zero point: fitted in the graph's feature order (the padding, if any, last)
        natural = np.argsort(inside)
        _, s, z = fit_zero_point_blocks(np.ascontiguousarray(w[:, i0:i1][:, natural].T).astype(dtype), bits,
                                        block_size, factor.diagonal[i0:i1][natural])
        scales[:, b], zeros[:, b] = s[:, 0], z[:, 0]
        step, zero = s[:, 0].astype(np.float64), z[:, 0].astype(np.float64)
        errors = np.zeros((n, i1 - i0))
        for j in range(i0, i1):
            qp[:, j] = np.clip(np.rint(w[:, j] / step + zero), 0, levels)
            errors[:, j - i0] = (w[:, j] - (qp[:, j] - zero) * step) / upper[j, j]
            w[:, j + 1:i1] -= np.outer(errors[:, j - i0], upper[j, j + 1:i1])
        w[:, i1:] -= errors @ upper[i0:i1, i1:]
    q = np.zeros((n, blocks * block_size), np.float64)
    q[:, perm] = qp
    q[:, k:] = zeros[:, -1:]  # the last block's padding: its zero point, a weight of 0
    return q.reshape(n, blocks, block_size).astype(np.uint8), scales, zeros


def _blocks_of(weight_kn: np.ndarray, block_size: int, importance: np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the fits read: the weights [N, blocks, block] in float64 (K padded with zeros), each
    value's weight in the squared error [1, blocks, block] (0 on the padding; the importance where
    given, else 1), and each block's min and max [N, blocks] over its real values."""
    k, n = weight_kn.shape
    blocks = -(-k // block_size)
    w = np.zeros((n, blocks * block_size), np.float64)
    w[:, :k] = np.asarray(weight_kn, np.float64).T
    weights = np.zeros((1, blocks * block_size), np.float64)
    weights[:, :k] = 1.0 if importance is None else _importance_weights(importance, k)
    valid = np.zeros((1, blocks * block_size), bool)
    valid[:, :k] = True
    w, weights, valid = (a.reshape(a.shape[0], blocks, block_size) for a in (w, weights, valid))
    return w, weights, np.where(valid, w, np.inf).min(-1), np.where(valid, w, -np.inf).max(-1)


def _importance_weights(importance: np.ndarray, k: int) -> np.ndarray:
    """``importance`` [K] checked, with a floor of 1e-4 of its mean (a feature never driven still counts)."""
    imp = np.asarray(importance, np.float64).reshape(-1)
    if imp.shape != (k,) or not np.all(np.isfinite(imp)) or np.any(imp < 0):
        raise ValueError(f"importance of shape {imp.shape} for K={k}: not K finite non-negative values")
    return imp + 1e-4 * max(float(imp.mean()), 1e-30)


def _nearest_levels(w: np.ndarray, scale: np.ndarray, offsets: np.ndarray, levels: float) -> np.ndarray:
    """Each value's nearest level q of its block's grid ``(q - middle) * s + c`` (s, c as stored)."""
    s, c = scale.astype(np.float64)[..., None], offsets.astype(np.float64)[..., None]
    return np.clip(np.rint((w - c) / s + (levels + 1) / 2), 0, levels)


def _fit_error(w: np.ndarray, valid: np.ndarray, scale: np.ndarray, offset: np.ndarray, levels: float,
               dtype: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The squared error per block of the grid ``q * scale + offset`` once stored in ``dtype`` as
    a scale and the offset of the middle level ``c = offset + middle * scale``."""
    middle = (levels + 1) / 2
    scale_cast = scale.astype(dtype)
    offsets_cast = (offset + middle * scale_cast.astype(np.float64)).astype(dtype)
    q = _nearest_levels(w, scale_cast, offsets_cast, levels)
    s, c = scale_cast.astype(np.float32)[..., None], offsets_cast.astype(np.float32)[..., None]
    values = (q.astype(np.float32) - np.float32(middle)) * s + c
    return (((values - w) ** 2) * valid).sum(-1), scale_cast, offsets_cast, q


def pack_zero_points(zero: np.ndarray, bits: int) -> np.ndarray:
    """[N, blocks] zero points as MatMulNBits and GatherBlockQuantized read them: one byte each at
    8 bits; at 4 bits two a byte along the blocks, the low nibble first, an odd last one beside 8."""
    if bits == 8:
        return zero.astype(np.uint8)
    n, blocks = zero.shape
    padded = np.full((n, blocks + blocks % 2), 8, np.uint8)
    padded[:, :blocks] = zero
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8)


def zero_points_of(packed: np.ndarray | None, bits: int, shape: tuple[int, ...],
                   offsets: np.ndarray | None = None, scales: np.ndarray | None = None) -> np.ndarray:
    """The [N, blocks] float32 zero points of packed ones (``2^(bits-1)`` each where there are none);
    with ``offsets`` (and their ``scales``), the zero points they amount to, ``2^(bits-1) - c / s``."""
    n, blocks = shape
    if offsets is not None and scales is not None:
        s = scales.astype(np.float64)
        safe = np.where(s != 0, s, 1.0)
        return (float(1 << (bits - 1)) - offsets.astype(np.float64) / safe).astype(np.float32)
    if packed is None:
        return np.full((n, blocks), float(1 << (bits - 1)), np.float32)
    if bits == 8:
        return packed.reshape(n, blocks).astype(np.float32)
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)


class WeightQuantizer:
    """ONNX Runtime's quantizers, one [K, N] weight (or a block of its columns) at a time."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._rtn: dict[Width, Any] = {}
        self._gptq: tuple[np.ndarray, GptqFactor] | None = None

    def _factor(self, hessian: np.ndarray) -> GptqFactor:
        """GPTQ's factor of ``hessian``, kept for the next call with the same array (the writer
        quantizes a weight in blocks of rows, and Q, K and V share one Hessian)."""
        if self._gptq is None or self._gptq[0] is not hessian:
            self._gptq = None  # the last one dropped first: a large factor is K x K float64
            self._gptq = (hessian, gptq_factor(hessian, hessian.shape[0], self.block_size))
        return self._gptq[1]

    def __call__(self, weight_kn: np.ndarray, width: Width, importance: np.ndarray | None = None) -> QuantizedWeight:
        """``weight_kn`` [K, N] (float32 or float16) quantized at ``width``; the scales in its dtype;
        ``importance`` [K] weights a fitted width's least squares (:func:`fit_blocks`)."""
        weight_kn = np.ascontiguousarray(weight_kn)
        if width.per_channel:
            raise ValueError("a per-channel width is not MatMulNBits' packing; quantize it with quantize_channel")
        if width.method in OFFSET_METHODS:
            q, scales, offsets = (fit_blocks(weight_kn, width.bits, self.block_size, importance) if width.method == "fit"
                                  else _hqq(weight_kn, width.bits, self.block_size))
            if width.bits == 4:
                q = q[..., 0::2] | (q[..., 1::2] << 4)
            return QuantizedWeight(np.ascontiguousarray(q, np.uint8), scales, None, offsets)
        if width.method in ("fitzp", "gptq"):
            if width.method == "gptq" and (importance is None or np.ndim(importance) != 2):
                raise ValueError("GPTQ quantizes under the calibration inputs' Hessian [K, K]; none was measured")
            q, scales, zero = (fit_zero_point_blocks(weight_kn, width.bits, self.block_size, importance)
                               if width.method == "fitzp" else gptq_blocks(weight_kn, width.bits, self.block_size,
                                                                           None, factor=self._factor(importance)))
            if width.bits == 4:
                q = q[..., 0::2] | (q[..., 1::2] << 4)
            return QuantizedWeight(np.ascontiguousarray(q, np.uint8), scales, pack_zero_points(zero, width.bits))
        if width.method == "kquant":
            q, scales, zero = _kquant(weight_kn, width.bits, self.block_size)
            if width.bits == 4:
                q = q[..., 0::2] | (q[..., 1::2] << 4)
            return QuantizedWeight(np.ascontiguousarray(q, np.uint8), scales.astype(weight_kn.dtype),
                                   pack_zero_points(zero, width.bits))
        if width not in self._rtn:
            self._rtn[width] = _rtn(width, self.block_size)
        packed, scales, zero = self._rtn[width].qbits_block_quant(weight_kn)
        return QuantizedWeight(packed, scales, None if width.symmetric else zero)


def dequantize(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None = None, *, bits: int,
               block_size: int, k: int, offsets: np.ndarray | None = None) -> np.ndarray:
    """The [K, N] float32 weights MatMulNBits multiplies by: ``(q - zero_point) * scale`` (zero
    point ``2^(bits-1)`` without ``zero_points``), plus each block's ``offsets`` [N, blocks] where
    given (a fitted width: the module docstring), the padding of the last block dropped. int4: two
    values per byte, the low nibble first. ``packed`` may be the 2-D [N, K * bits / 8] form
    GatherBlockQuantized reads (the same bytes)."""
    n, blocks = scales.shape[0], int(math.ceil(k / block_size))
    shape = (n, blocks, block_size * bits // 8)
    if packed.shape != shape and not (packed.ndim == 2 and packed.size == math.prod(shape)):
        raise UserError(f"packed weights of shape {list(packed.shape)} do not hold [{n}, {blocks}, "
                        f"{block_size * bits // 8}] for K={k}, block {block_size}, {bits} bits")
    packed = packed.reshape(shape)
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, block_size)
    else:
        q = packed.reshape(n, blocks, block_size)
    zero = zero_points_of(zero_points, bits, (n, blocks)).reshape(n, blocks, 1)
    scale = scales.astype(np.float32).reshape(n, blocks, 1)
    w = (q.astype(np.float32) - zero) * scale
    if offsets is not None:
        w = w + offsets.astype(np.float32).reshape(n, blocks, 1)
    return np.ascontiguousarray(w.reshape(n, blocks * block_size)[:, :k].T)


def round_activations(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` as MatMulNBits at accuracy_level 4 sees it: each block of ``block_size`` values of the
    last dim rounded to int8 with the scale ``max|block| / 127`` (half to even), back in float."""
    k = x.shape[-1]
    blocks = int(math.ceil(k / block_size))
    padded = torch.nn.functional.pad(x.float(), (0, blocks * block_size - k))
    padded = padded.reshape(*x.shape[:-1], blocks, block_size)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(padded * inverse).clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(*x.shape[:-1], blocks * block_size)[..., :k].to(x.dtype)


def block_sums(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """The sums of each block of ``block_size`` values of ``x``'s last dim (the last block padded
    with zeros): what a fitted width's offsets are multiplied by."""
    k = x.shape[-1]
    blocks = int(math.ceil(k / block_size))
    padded = torch.nn.functional.pad(x, (0, blocks * block_size - k))
    return padded.reshape(*x.shape[:-1], blocks, block_size).sum(-1)


#: The floor of a row's int8 scale: an all-zero row rounds to zeros instead of dividing by zero.
CHANNEL_TINY = np.float32(1e-30)
CHANNEL_INVERSE_127 = np.float32(1.0 / 127.0)


def quantize_channel(weight_nk: np.ndarray, smoothing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [N, K] of a weight quantized per output row: the row divided by ``smoothing`` [K] (what
    its input is multiplied by), then rounded to int8 with the scale ``max|row| / 127`` (an all-zero
    row: scale 1). Returns (q [N, K] int8, scales [N] float32)."""
    w = np.asarray(weight_nk, np.float32) / np.asarray(smoothing, np.float32)
    amax = np.abs(w).max(axis=1)
    scales = np.where(amax > 0, amax * CHANNEL_INVERSE_127, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


def dequantize_channel(table: np.ndarray, scales: np.ndarray, smoothing: np.ndarray) -> np.ndarray:
    """The [N, K] float32 rows a per-channel weight stands for, as the lookup computes them:
    ``(q * scale_n) * smoothing_k`` (Cast, Mul, Mul)."""
    return (table.astype(np.float32) * scales.astype(np.float32)[:, None]) * smoothing.astype(np.float32)[None, :]


def channel_head(x: torch.Tensor, table: torch.Tensor, scales: torch.Tensor, smoothing: torch.Tensor, *,
                 exact: bool = True) -> torch.Tensor:
    """What the graph's per-channel MatMul computes, node for node, in float32: ``x * smoothing``; each
    row's scale ``max(max|row| * (1/127), tiny)``; the row divided by it and rounded half to even
    (int8); the int8 products summed exactly (int32) and cast to float32; times the row's scale, then
    each output's. ``table`` [N, K] int8, ``scales`` [N], ``smoothing`` [K]. ``exact``: the sums in
    float64 (exact for any K a model has); else float32 (a search that does not need the last bit)."""
    xs = x.float() * smoothing.float()
    step = torch.clamp(xs.abs().amax(dim=-1, keepdim=True) * torch.tensor(CHANNEL_INVERSE_127),
                       min=float(CHANNEL_TINY))
    q = torch.round(xs / step)
    wide = torch.float64 if exact else torch.float32
    acc = (q.to(wide) @ table.to(wide).T).float()
    return ((acc * step) * scales.float()).to(x.dtype)


# -- what the graph records, and the reference built from it -------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantizedLinear:
    """One MatMulNBits of the graph: its packed weight, scales and zero points ("" if none), its
    width, and the Linear modules (paths in the exported module tree) whose weights it holds side
    by side, with their output rows; ``embedding``: the Embedding module whose lookup
    (GatherBlockQuantized) reads the same packed weight, when the head is tied to it; ``offsets``:
    a fitted width's block offsets, stored [K / block, N] for the MatMul that adds them. A per-channel
    width (MatMulInteger, not MatMulNBits): ``packed`` the int8 rows [N, K], ``scales`` [N], and
    ``smoothing`` the factor [K] its input is multiplied by (:func:`channel_head`)."""

    packed: str
    scales: str
    k: int
    n: int
    parts: tuple[tuple[str, int], ...]
    width: Width = Width(4)
    zero_points: str = ""
    embedding: str = ""
    offsets: str = ""
    smoothing: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"packed": self.packed, "scales": self.scales, "zero_points": self.zero_points, "K": self.k,
                "N": self.n, "parts": [list(p) for p in self.parts], **self.width.to_dict(),
                "embedding": self.embedding, "offsets": self.offsets, "smoothing": self.smoothing}


def expert_rows(w: torch.Tensor, *, transposed: bool, halves: bool) -> torch.Tensor:
    """One expert's weight (or bias, 1-D) as ``com.microsoft.MoE`` reads it, [N, K], from the model's
    [N, K] ([K, N] when ``transposed``); ``halves``: the model's N rows are all gates then all ups,
    which the op wants interleaved (gate 0, up 0, gate 1, ...)."""
    w = w.t() if transposed else w
    if halves:
        half = w.shape[0] // 2
        w = torch.stack([w[:half], w[half:]], dim=1).reshape(w.shape)
    return w


def expert_parameter(w: torch.Tensor, *, transposed: bool, halves: bool) -> torch.Tensor:
    """The inverse of :func:`expert_rows`: the op's [N, K] back in the model's layout."""
    if halves:
        w = torch.cat([w[0::2], w[1::2]], dim=0)
    return w.t() if transposed else w


@dataclasses.dataclass(frozen=True)
class QuantizedExperts:
    """One QMoE weight of the graph: packed [experts, N, K * bits / 8] and scales [experts, N, K / block],
    and the model's fused experts parameter (its path) they hold, in the layout :func:`expert_rows` reads."""

    packed: str
    scales: str
    k: int
    n: int
    experts: int
    parameter: str
    transposed: bool
    halves: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def expert_width(q: Quantization) -> Width:
    """How QMoE's expert weights are quantized under any recipe: symmetric round-to-nearest at the
    recipe's bits (QMoE takes per-expert packing without per-tensor widths)."""
    return Width(q.bits)


def metadata_entry(q: Quantization, linears: list[QuantizedLinear],
                   experts: list[QuantizedExperts] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """The ``quantization`` entry of the model's metadata: the recipe and, per weight, what it did
    (QMoE's expert weights: symmetric round-to-nearest at the recipe's bits, :func:`expert_width`)."""
    methods = sorted({lin.width.method for lin in linears} | ({"rtn"} if experts else set()))
    return {"scheme": q.scheme, "recipe": q.recipe.summary, "bits": q.bits, "block_size": q.block_size,
            "accuracy_level": q.accuracy_level, "compute": q.compute,
            "symmetric": all(lin.width.symmetric for lin in linears), "lm_head": q.head,
            "quantizer": f"onnxruntime {package_version('onnxruntime')} "
                         + " and ".join(QUANTIZERS[m] for m in methods),
            "linears": [lin.to_dict() for lin in linears], "experts": [e.to_dict() for e in experts],
            **({"measured": q.measurement} if q.measurement is not None else {})}


def quantized_experts_of(entry: Any) -> list[QuantizedExperts]:
    """The QMoE weights of a metadata ``quantization`` entry (none before mixtures of experts were written)."""
    try:
        return [QuantizedExperts(str(e["packed"]), str(e["scales"]), int(e["k"]), int(e["n"]), int(e["experts"]),
                                 str(e["parameter"]), bool(e["transposed"]), bool(e["halves"]))
                for e in entry.get("experts", [])]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"the model's quantization metadata is damaged ({exc}); export it again") from None


def widths_summary(linears: list[QuantizedLinear]) -> str:
    """What a recipe did, in one line: how many MatMulNBits at each width (and a tied weight stored once)."""
    counts: dict[str, int] = {}
    for lin in linears:
        counts[lin.width.describe()] = counts.get(lin.width.describe(), 0) + 1
    shared = [lin for lin in linears if lin.embedding]
    return ", ".join(f"{n}x {w}" for w, n in counts.items()) + (
        f"; the head and {shared[0].embedding} share one int{shared[0].width.bits} weight "
        f"({'Gather' if shared[0].width.per_channel else 'GatherBlockQuantized'})"
        if shared else "")


#: What each method is, in ONNX Runtime.
QUANTIZERS = {"rtn": "DefaultWeightOnlyQuantizer", "kquant": "neural_compressor.weight_only k-quant",
              "hqq": "HQQWeightOnlyQuantizer's half-quadratic scale and zero, as a float offset per block",
              "fit": "rmsnorm_deploy's least-squares float scale and offset per block (quantize.fit_blocks)",
              "fitzp": "rmsnorm_deploy's least-squares float scale and integer zero point per block "
                       "(quantize.fit_zero_point_blocks)",
              "gptq": "GPTQ under the calibration text's Hessian, in the integer-zero-point grid (quantize.gptq_blocks)",
              "channel": "rmsnorm_deploy's per-channel int8 on smoothed int8 rows (quantize.quantize_channel)"}


def quantization_of(entry: Any) -> tuple[Quantization, list[QuantizedLinear]]:
    """The options and linears of a metadata ``quantization`` entry, every field checked."""
    try:
        q = Quantization(entry["scheme"], int(entry["block_size"]), int(entry["accuracy_level"]),
                         bool(entry["lm_head"]))
        linears = []
        for item in entry["linears"]:
            parts = tuple((str(path), int(rows)) for path, rows in item["parts"])
            width = Width(int(item.get("bits", entry["bits"])), bool(item.get("symmetric", True)),
                          str(item.get("method", "rtn")))
            linear = QuantizedLinear(str(item["packed"]), str(item["scales"]), int(item["K"]), int(item["N"]), parts,
                                     width, str(item.get("zero_points", "")), str(item.get("embedding", "")),
                                     str(item.get("offsets", "")), str(item.get("smoothing", "")))
            if sum(rows for _, rows in parts) != linear.n or linear.k < 1:
                raise ValueError(f"{linear.packed}: its parts' rows do not add up to N={linear.n}")
            if bool(linear.zero_points) != width.zero_points:
                raise ValueError(f"{linear.packed}: zero points {linear.zero_points!r} for a "
                                 f"{width.describe()} width")
            if bool(linear.offsets) != width.offsets:
                raise ValueError(f"{linear.packed}: offsets {linear.offsets!r} for a {width.describe()} width")
            if (width.per_channel and not linear.smoothing) or (linear.smoothing and width.offsets):
                raise ValueError(f"{linear.packed}: smoothing {linear.smoothing!r} for a {width.describe()} width")
            linears.append(linear)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"the model's quantization metadata is damaged ({exc}); export it again") from None
    return q, linears


def read_initializer(model: Any, name: str, base_dir: Any) -> np.ndarray:
    """An initializer of ``model`` as numpy, its external data read from ``base_dir``."""
    from onnx import numpy_helper

    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init, str(base_dir) if base_dir else "")
    raise UserError(f"the graph has no initializer {name!r} that its quantization metadata names; export it again")


@dataclasses.dataclass
class WeightCheck:
    """The graph's quantized weights against the model's own: each the nearest point of its
    block's grid ``(q - zero_point) * scale``, q in 0..2^bits - 1, to the original value (within
    half a step of it, or of the grid's end where the quantizer clipped it: the k-quant search's
    least-squares range may leave a block's extremes outside); and, for round-to-nearest, each
    scale where ONNX Runtime's rule puts it: symmetric, the block's largest magnitude over
    2^(bits-1); with zero points, the block's range (0 included) over 2^bits - 1. Without this
    check a wrong packing would be its own reference."""

    name: str = "quantized weights vs the model's"
    weights: int = 0
    max_steps: float = 0.0  # the largest |dequantized - nearest grid point| in steps
    worst_scale: float = 1.0  # the |scale| / (ONNX Runtime's rule) farthest from 1 (round-to-nearest)
    scale_excess: float = 0.0  # the largest |ratio - 1| over what its scales' rounding allows (at most 1)
    worst: str = ""
    clipped: int = 0  # weights outside their block's grid (k-quant), set to its nearest end
    #: GPTQ moves weights off their nearest grid point on purpose (each rounding's error is spread
    #: over the features after it), so its Linears are held to their relative distance
    #: ``|dequantized - model's| / |model's|`` instead: 4 bits measure 0.1-0.2, a wrong packing or
    #: another tensor's weights about 1.4
    gptq_spread: float = 0.0
    gptq_weights: int = 0
    GPTQ_RELATIVE = 0.5

    #: float rounding of the scale and of the dequantized product
    SLACK = 1e-5
    #: the same in steps: float32 rounding of ``w / scale`` is up to ~2^bits ulps of a step (8 bits:
    #: ~1.5e-5 measured on SmolLM2's head); a wrong packing is a whole step off
    STEP_SLACK = 1e-3

    def add(self, path: str, original: torch.Tensor, dequantized: np.ndarray, scales: np.ndarray,
            zero: np.ndarray, width: Width, block_size: int, scale_rounding: float = 0.0) -> None:
        """``original`` [rows, K] (the model's), ``dequantized`` [rows, K], ``scales`` and ``zero``
        (unpacked zero points) [rows, K/block] (the graph's); ``scale_rounding``: the relative rounding of
        the dtype the quantizer computed the scales in (a float16 graph's: 2^-11), beyond :attr:`SLACK`."""
        w = original.detach().float().numpy()
        rows, k = w.shape
        blocks = scales.shape[1]
        padded = np.zeros((rows, blocks * block_size), np.float32)
        padded[:, :k] = w
        padded = padded.reshape(rows, blocks, block_size)
        if width.per_channel:
            expected = np.abs(padded).max(-1) / 127.0
        elif width.symmetric:
            expected = np.abs(padded).max(-1) / float(1 << (width.bits - 1))
        else:
            expected = (np.maximum(padded.max(-1), 0) - np.minimum(padded.min(-1), 0)) / float((1 << width.bits) - 1)
        scale = scales.astype(np.float32)
        ends = np.stack([-zero * scale, (float((1 << width.bits) - 1) - zero) * scale])
        expand = lambda a: np.repeat(a, block_size, axis=-1)[..., :k]  # noqa: E731
        nearest = np.clip(w, expand(ends.min(0)), expand(ends.max(0)))
        step = np.abs(scale)
        with np.errstate(divide="ignore", invalid="ignore"):
            # an all-zero row: round-to-nearest's scale is 0, a per-channel one's 1 (its int8 values are 0 either way)
            empty = 1.0 if width.per_channel else np.where(step > 0, np.inf, 1.0)
            ratio = np.where(expected > 0, step / expected, empty)
            steps = 2.0 * np.abs(dequantized - nearest) / expand(np.maximum(step, 1e-30))
        self.clipped += int(np.count_nonzero(np.abs(nearest - w) > self.SLACK * expand(step)))
        if width.method in ("rtn", "channel") and ratio.size:
            far = float(ratio.flat[np.argmax(np.abs(ratio - 1.0))])
            excess = abs(far - 1.0) / max(self.SLACK, scale_rounding)
            if excess > self.scale_excess:
                self.worst_scale, self.scale_excess = far, excess
        if not np.all(np.isfinite(dequantized)):  # a NaN or Inf scale or offset is never within a step
            self.max_steps, self.worst = float("inf"), path
        elif width.method == "gptq":
            spread = float(np.linalg.norm(dequantized - w) / max(float(np.linalg.norm(w)), 1e-30))
            if spread > self.gptq_spread:
                self.gptq_spread = spread
                self.worst = path if spread > self.GPTQ_RELATIVE else self.worst
            self.gptq_weights += w.size
            return
        elif steps.size and float(steps.max()) > self.max_steps:
            self.max_steps, self.worst = float(steps.max()), path
        self.weights += w.size

    @property
    def passed(self) -> bool:
        return (self.max_steps <= 1.0 + self.STEP_SLACK and self.scale_excess <= 1.0
                and self.gptq_spread <= self.GPTQ_RELATIVE)

    def __bool__(self) -> bool:
        return self.passed

    def summary(self) -> str:
        return (f"{self.name}: {'PASS' if self.passed else 'FAIL'} {self.weights:,} weights each within "
                f"{self.max_steps / 2:.3g} quantization steps of its block's nearest grid point (at most 0.5)"
                f"{f' (worst: {self.worst})' if self.worst else ''}, {self.clipped:,} clipped to the grid's end; "
                f"every round-to-nearest step ONNX Runtime's (farthest ratio {self.worst_scale:.6g})"
                + (f"; {self.gptq_weights:,} GPTQ weights {self.gptq_spread:.3g} from the model's, relative (at "
                   f"most {self.GPTQ_RELATIVE:g})" if self.gptq_weights else ""))

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed}


def reference_compute(q: Quantization, linears: list[QuantizedLinear]) -> str:
    """The dtype the quantized graph's MatMuls compute in, as its reference is checked: ``int8`` when
    MatMulNBits rounds its inputs to int8 or any per-channel MatMulInteger does; else ``float32``."""
    return "int8" if q.compute == "int8" or any(lin.width.per_channel for lin in linears) else q.compute


@dataclasses.dataclass
class Reference:
    """What :func:`dequantized_reference` put into the model: the compute dtype, the weights' check,
    and each quantized Linear's whole dequantized weight by module path (offsets and smoothing included:
    the weight the model's own is compared with)."""

    compute: str
    weights: WeightCheck
    dequantized: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def dequantized_reference(root: torch.nn.Module, model: Any, entry: Any, *, base_dir: Any = None,
                          under: str = "", check: WeightCheck | None = None) -> Iterator[Reference]:
    """``root`` (the exported module tree) computing what the quantized ``model`` (a ModelProto;
    its external data under ``base_dir``) computes: each quantized Linear's weight and each quantized
    experts parameter (QMoE's) replaced by the dequantized values read back from the graph (checked
    against the weight it replaces: :class:`WeightCheck`) and, at int8 compute, their inputs rounded
    as the kernels round them; only the weights under the module path ``under`` when given (one layer
    at a time; ``check`` then gathers the weights' check over the layers). Restored on exit."""
    q, linears = quantization_of(entry)
    experts = quantized_experts_of(entry)
    if under:
        linears = [lin for lin in linears if all(path.startswith(under + ".") for path, _ in lin.parts)]
        experts = [e for e in experts if e.parameter.startswith(under + ".")]
    modules = dict(root.named_modules())
    check = check if check is not None else WeightCheck()
    dequantized: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        for lin in linears:
            if lin.width.per_channel:
                _channel_reference(stack, modules, model, base_dir, lin, check, dequantized)
                continue
            scales = read_initializer(model, lin.scales, base_dir)
            zero = read_initializer(model, lin.zero_points, base_dir) if lin.zero_points else None
            offsets = read_initializer(model, lin.offsets, base_dir).T if lin.offsets else None
            if offsets is not None and offsets.shape != scales.shape:
                raise UserError(f"the offsets {lin.offsets!r} are {list(offsets.T.shape)}, not the "
                                f"{list(scales.shape[::-1])} of their scales; export it again")
            packed = read_initializer(model, lin.packed, base_dir)
            weight = dequantize(packed, scales, zero, bits=lin.width.bits, block_size=q.block_size, k=lin.k)
            whole = weight if offsets is None else dequantize(packed, scales, zero, bits=lin.width.bits,
                                                             block_size=q.block_size, k=lin.k, offsets=offsets)
            zeros = zero_points_of(zero, lin.width.bits, scales.shape, offsets, scales)
            smooth = torch.from_numpy(read_smoothing(model, lin, base_dir)) if lin.smoothing else None
            start = 0
            for path, rows in lin.parts:
                module = _linear_module(modules, path, rows, lin.k)
                mine = torch.from_numpy(np.ascontiguousarray(whole[:, start:start + rows].T))
                # a smoothed weight is checked where it was quantized: its input rows divided by the factors
                original = module.weight if smooth is None else smoothed_weight(module.weight, smooth)
                check.add(path, original, mine.numpy(), scales[start:start + rows], zeros[start:start + rows],
                          lin.width, q.block_size, scale_rounding(module.weight.dtype))
                dequantized[path] = mine if smooth is None else mine * smooth.float()
                values = np.ascontiguousarray(weight[:, start:start + rows].T)
                stack.enter_context(_replaced(module, "weight", torch.from_numpy(values)))
                if offsets is not None:
                    stack.enter_context(_with_offsets(module, offsets[start:start + rows], q))
                elif q.compute == "int8" or smooth is not None:
                    stack.callback(module.register_forward_pre_hook(
                        lambda _m, args, b=q.block_size, s=smooth, r=q.compute == "int8":
                        (_kernel_input(args[0], b, s, r), *args[1:])).remove)
                start += rows
            if lin.embedding:  # the lookup reads the same packed weight: the dequantized rows, exactly
                rows_of = torch.from_numpy(np.ascontiguousarray(weight.T))
                embedding = _embedding_module(modules, lin)
                if smooth is not None:  # the rows times the factors, a Mul in the graph's dtype
                    rows_of = rows_of.to(embedding.weight.dtype) * smooth.to(embedding.weight.dtype)
                stack.enter_context(_replaced(embedding, "weight", rows_of))
        for item in experts:
            _dequantized_experts(stack, modules, model, base_dir, q, item, check)
        yield Reference(reference_compute(q, linears), check, dequantized)


def scale_rounding(dtype: Any) -> float:
    """The relative rounding of scales ONNX Runtime's quantizer computed for weights of ``dtype`` (a float16
    graph's are computed and rounded in float16, then stored as float32 exactly); 0 for float32."""
    return 2.0 ** -11 if str(dtype).removeprefix("torch.") == "float16" else 0.0


def smoothed_weight(weight: torch.Tensor, smoothing: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A weight's input rows divided by its smoothing as the writer divides them: in the graph's ``dtype``
    (default the weight's: a loaded model's is the export's), then in float32, then in the graph's dtype."""
    dtype = dtype or weight.dtype
    return (weight.detach().to(dtype).float() / smoothing.float()).to(dtype)


def _kernel_input(x: torch.Tensor, block_size: int, smoothing: torch.Tensor | None, rounded: bool) -> torch.Tensor:
    """A MatMulNBits' input as its kernel multiplies it: times the smoothing (the graph's Mul, in ``x``'s
    dtype) and, at int8 compute, rounded per block."""
    if smoothing is not None:
        x = x * smoothing.to(x.dtype)
    return round_activations(x, block_size) if rounded else x


def _linear_module(modules: dict[str, torch.nn.Module], path: str, rows: int, k: int) -> torch.nn.Linear:
    module = modules.get(path)
    if not isinstance(module, torch.nn.Linear) or tuple(module.weight.shape) != (rows, k):
        raise UserError(f"the quantization metadata names {path!r} [{rows}, {k}], which is not a "
                        "Linear of that shape in the model; export it again")
    return module


def _embedding_module(modules: dict[str, torch.nn.Module], lin: QuantizedLinear) -> torch.nn.Embedding:
    embedding = modules.get(lin.embedding)
    if not isinstance(embedding, torch.nn.Embedding) or tuple(embedding.weight.shape) != (lin.n, lin.k):
        raise UserError(f"the quantization metadata names {lin.embedding!r} [{lin.n}, {lin.k}], which "
                        "is not an Embedding of that shape in the model; export it again")
    return embedding


def read_channel(model: Any, lin: QuantizedLinear, base_dir: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A per-channel weight's int8 rows [N, K], scales [N] and smoothing [K] read back from the graph,
    their shapes and the smoothing (positive, finite: a NaN factor would make the graph and its reference
    agree on NaN) checked."""
    table = read_initializer(model, lin.packed, base_dir)
    scales = read_initializer(model, lin.scales, base_dir)
    if table.dtype != np.int8 or table.shape != (lin.n, lin.k) or scales.shape != (lin.n,):
        raise UserError(f"the per-channel weight {lin.packed!r} is {table.dtype} {list(table.shape)} with scales "
                        f"{list(scales.shape)}, not int8 [{lin.n}, {lin.k}] and [{lin.n}]; export it again")
    return table, scales, np.array(read_smoothing(model, lin, base_dir), np.float32)


def read_smoothing(model: Any, lin: QuantizedLinear, base_dir: Any) -> np.ndarray:
    """A weight's input smoothing [K] read back from the graph, in its stored dtype, checked: positive and
    finite (a NaN factor would make the graph and its reference agree on NaN)."""
    smoothing = np.array(read_initializer(model, lin.smoothing, base_dir))
    if smoothing.shape != (lin.k,) or smoothing.dtype.kind != "f":
        raise UserError(f"the smoothing {lin.smoothing!r} of {lin.packed!r} is {smoothing.dtype} "
                        f"{list(smoothing.shape)}, not [{lin.k}] floats; export it again")
    if not (np.all(np.isfinite(smoothing)) and np.all(smoothing > 0)):
        raise UserError(f"the smoothing {lin.smoothing!r} of {lin.packed!r} holds non-positive or non-finite factors; "
                        "export it again")
    return smoothing


def _channel_reference(stack: contextlib.ExitStack, modules: dict[str, torch.nn.Module], model: Any, base_dir: Any,
                       lin: QuantizedLinear, check: WeightCheck, dequantized: dict[str, torch.Tensor]) -> None:
    """A per-channel weight read back: each Linear it holds computing :func:`channel_head` on its rows,
    its weight (and a tied embedding's) the dequantized rows; checked in the smoothed space, where
    each int8 value is the nearest step of its row's grid to ``weight / smoothing``."""
    table, scales, smoothing = read_channel(model, lin, base_dir)
    whole = dequantize_channel(table, scales, smoothing)
    smooth = torch.from_numpy(np.array(smoothing, np.float32))
    start = 0
    for path, rows in lin.parts:
        module = _linear_module(modules, path, rows, lin.k)
        mine = slice(start, start + rows)
        dequantized[path] = torch.from_numpy(np.ascontiguousarray(whole[mine]))
        grid = table[mine].astype(np.float32) * scales[mine, None].astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            check.add(path, module.weight.detach().float() / smooth, grid, scales[mine, None],
                      np.full((rows, 1), 127.0, np.float32), lin.width, lin.k)
        stack.enter_context(_replaced(module, "weight", dequantized[path]))
        rows_t = torch.from_numpy(np.array(table[mine]))
        scales_t = torch.from_numpy(np.array(scales[mine], np.float32))

        def forward(x: torch.Tensor, m: torch.nn.Linear = module, t: torch.Tensor = rows_t,
                    s: torch.Tensor = scales_t) -> torch.Tensor:
            y = channel_head(x, t, s, smooth)
            return y if m.bias is None else y + m.bias
        stack.enter_context(_forward_of(module, forward))
        start += rows
    if lin.embedding:
        stack.enter_context(_replaced(_embedding_module(modules, lin), "weight", torch.from_numpy(whole)))


@contextlib.contextmanager
def _with_offsets(module: torch.nn.Linear, offsets: np.ndarray, q: Quantization) -> Iterator[None]:
    """``module`` (its weight already the 4-bit grid) computing what a fitted width's two nodes do:
    MatMulNBits on the input (rounded at int8 compute) plus the input's block sums, as they are,
    times ``offsets`` [rows, blocks]."""
    table = torch.from_numpy(np.array(offsets.T, np.float32))

    def forward(x: torch.Tensor) -> torch.Tensor:
        grid = round_activations(x, q.block_size) if q.compute == "int8" else x
        y = torch.nn.functional.linear(grid, module.weight, module.bias)
        return y + (block_sums(x.float(), q.block_size) @ table).to(y.dtype)

    with _forward_of(module, forward):
        yield


@contextlib.contextmanager
def _forward_of(module: torch.nn.Module, forward: Any) -> Iterator[None]:
    """``module`` calling ``forward`` for the time of the block."""
    saved = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if saved is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = saved


@contextlib.contextmanager
def _replaced(module: torch.nn.Module, name: str, values: torch.Tensor) -> Iterator[None]:
    """``module.name`` a new Parameter of ``values`` (not an in-place copy: a head tied to the embedding
    stays untied) for the time of the block."""
    saved = getattr(module, name)
    setattr(module, name, torch.nn.Parameter(values.to(saved.dtype), requires_grad=False))
    try:
        yield
    finally:
        setattr(module, name, saved)


def _dequantized_experts(stack: contextlib.ExitStack, modules: dict[str, torch.nn.Module], model: Any, base_dir: Any,
                         q: Quantization, item: QuantizedExperts, check: WeightCheck) -> None:
    """One QMoE weight's dequantized values in place of the experts parameter it holds; at int8 compute,
    the experts' input and their activated intermediate rounded per block (QMoE's two GEMMs): the experts
    then run transformers' ``batched_mm`` implementation, which calls ``_apply_gate`` where the eager loop
    inlines it."""
    path, _, attr = item.parameter.rpartition(".")
    module = modules.get(path)
    original = getattr(module, attr, None)
    if not isinstance(original, torch.Tensor) or original.dim() != 3 or original.shape[0] != item.experts:
        raise UserError(f"the quantization metadata names {item.parameter!r}, which is not a fused experts parameter "
                        "of the model; export it again")
    packed, scales = read_initializer(model, item.packed, base_dir), read_initializer(model, item.scales, base_dir)
    blocks = item.k // q.block_size
    values = []
    for e in range(item.experts):
        rows = dequantize(packed[e].reshape(item.n, blocks, -1), scales[e], bits=q.bits, block_size=q.block_size,
                          k=item.k).T
        mine = expert_rows(original[e].detach().float(), transposed=item.transposed, halves=item.halves)
        check.add(f"{item.parameter}[{e}]", mine, np.ascontiguousarray(rows), scales[e],
                  zero_points_of(None, q.bits, scales[e].shape), expert_width(q), q.block_size)
        values.append(expert_parameter(torch.from_numpy(np.ascontiguousarray(rows)), transposed=item.transposed,
                                       halves=item.halves))
    stack.enter_context(_replaced(module, attr, torch.stack(values)))
    if q.compute == "int8" and attr == "gate_up_proj":
        config, block = module.config, q.block_size
        saved = config._experts_implementation_internal
        config._experts_implementation_internal = "batched_mm"
        stack.callback(setattr, config, "_experts_implementation_internal", saved)
        gate = module._apply_gate
        module._apply_gate = lambda gate_up: round_activations(gate(gate_up), block)
        stack.callback(delattr, module, "_apply_gate")
        stack.callback(module.register_forward_pre_hook(
            lambda _m, args: (round_activations(args[0], block), *args[1:])).remove)
