"""Every tolerance the project uses, in one table, each with the reason for its size.

Keys are ``(check, backend, dtype)``:

* ``check="norm"``: one RMSNorm's output against the float64 oracle of its spec
  (``reference.oracle``), measured in ULPs of the output dtype.
* ``check="norm_vs_torch"``: one RMSNorm's output against the torch reference of its spec
  run in the same dtype (``reference.reference``: the rounding-faithful source), in ULPs.
* ``check="layer_norm"``: one LayerNorm found in a graph against ``torch.nn.functional.layer_norm``
  evaluated in float64, in ULPs of the output dtype.
* ``check="model"``: outputs against PyTorch in the same dtype where no float64 run exists and
  rounding cannot accumulate over depth: one layer at a time on the graph's own input (the
  layer-by-layer parity of a streamed model), and shallow test models. A whole deep model is never
  held to it: see ``model_vs_float64`` below.
* ``check="backends"``: an output of one backend against the same output of another backend
  running the same graph (a third-party graph without a PyTorch source).
* ``check="rotary_table"``: the cos/sin tables ONNX Runtime computes from the graph's ``inv_freq``
  (``decoder/ort_rotary.py``) against the model's ``rotary_emb`` in float32.
* ``check="quantized_model"``: one layer of a weight-only quantized graph whose ``MatMulNBits``
  compute in float32 (``accuracy_level`` 0 or 1) against the PyTorch layer holding the dequantized
  weights read back from the graph (``decoder/quantize.py``), as ``model`` is for one layer.
* ``check="quantized_model_int8"``: the same at ``accuracy_level`` 4 (int8 compute), the
  reference also rounding each quantized MatMul's input to int8 per block as the kernel does;
  its ``atol`` is a share of the output's largest value (:func:`tolerance_at_scale`).

:data:`ACCURACY_BOUNDS` holds the verdicts on whole models, keyed the same way:

* ``check="model_vs_float64"``: a runtime's distance from the float64 run of the source
  module may be at most ``ratio`` times the PyTorch module's own distance from it, plus
  ``atol``: an export may not be less accurate than its source. Relative to the source,
  because a model's logits (and so its rounding error) scale with its weights and depth. This
  is the verdict of every whole-model parity: the plain export, the KV-cache graphs (prefill and
  every decode step), ``validate``. The distance to PyTorch in the same dtype is reported beside
  it as context: two float32 runtimes summing in different orders drift apart with depth (on a
  trained 30-layer model by more than either is from float64), so it decides nothing.
* ``check="quantized_model_vs_float64"``: the same for a weight-only quantized graph computing in
  float32, against the PyTorch model holding the dequantized weights read back from the graph,
  run in the model's dtype and in float64.

Backends are the runtimes that produce the output: ``torch`` (our reference itself),
``onnxruntime``, ``tensorrt``, ``triton`` (our kernel).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes

from rmsnorm_deploy.contract.dtypes import machine_epsilon, numpy_dtype


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """An element passes when ``|a - e| <= atol + rtol*|e|`` or its ULP error <= ``max_ulp``."""

    atol: float = 0.0
    rtol: float = 0.0
    max_ulp: float | None = None
    reason: str = ""

    def describe(self) -> str:
        parts = []
        if self.max_ulp is not None:
            parts.append(f"max_ulp={self.max_ulp:g}")
        if self.atol or self.rtol or self.max_ulp is None:
            parts.append(f"atol={self.atol:g} rtol={self.rtol:g}")
        return " or ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FP32_NORM = (
    "float32 output: the float32 sum of squares over up to 65536 terms carries up to about log2(n)/2 ulp of "
    "relative error into the rms, plus the rounding of the divide (or rsqrt and multiply) and of the gain"
)
_HALF_NORM = (
    "{dtype} output: the float32 arithmetic is ~2^-13 ulp of {dtype} away from exact, so what remains is the "
    "rounding to {dtype}: below 1 ulp for scale_then_cast (one rounding); cast_then_scale rounds up to three "
    "times (the normalized value, a gain that is not already a {dtype} value, i.e. a float32 weight or Gemma's "
    "1 + w, and their product), each off by at most half an ulp of its own value, which in ulps of the result "
    "adds up to just under 3 (the reference itself reaches 2.4 on random inputs)"
)
_FP32_MODEL = (
    "float32 outputs of one layer (or a shallow model) against eager on the same input: the runtimes sum in "
    "different orders, ~1e-5 relative; 1e-4 absolute and relative. Over a deep stack these differences compound "
    "(trained SmolLM2-135M, 30 layers: ONNX Runtime and torch float32 logits 3.9e-4 apart, each 1.9e-4 and 2.5e-4 "
    "from float64), so whole models are held to float64 instead (ACCURACY_BOUNDS)"
)
_HALF_MODEL = (
    "{dtype} logits: every matmul and residual add rounds to {dtype} in both runtimes, in different orders, so "
    "differences of a few {dtype} ulps per layer add up; the bound is a few ulps of the logits' magnitude"
)

_FP32_NORM_VS_TORCH = (
    "float32 output against the float32 torch reference: each is within a few ulp of the exact value (see the norm "
    "check) and they sum in different orders, so they may differ by the sum of both errors"
)
_HALF_NORM_VS_TORCH = (
    "{dtype} output against the torch reference in {dtype}: both round the same float32 value, which they compute "
    "with different op forms (x/sqrt vs x*rsqrt) and summation orders, so a value close to a rounding boundary can "
    "land on either side (1 ulp); for cast_then_scale the flipped rounding of the normalized value is then "
    "multiplied by the gain, up to 2 ulp of the product"
)
_LAYER_NORM_BIAS = (
    "; where the bias cancels the scaled value the output is small but its error is set by the terms, so an "
    "absolute bound of a few ulp at 8 (the largest |normalized * gain| of generated activations and gains) also passes"
)
_FP32_LAYER_NORM = (
    "float32 LayerNorm: as the RMSNorm bound, plus the cancellation of subtracting the mean, which costs "
    "log2(|mean|/std) bits; generated activations have mean 0, so the RMSNorm bound applies" + _LAYER_NORM_BIAS
)
_HALF_LAYER_NORM = (
    "{dtype} LayerNorm with float32 statistics: the rounding to {dtype} of the scaled and shifted value (0.5 ulp), "
    "the bias add when it is done in {dtype} (0.5 ulp more), and a margin for a divide in place of rsqrt"
    + _LAYER_NORM_BIAS
)
_FP32_BACKENDS = (
    "float32 outputs of two runtimes on the same graph: matmuls and reductions sum in different orders and may use "
    "fused multiply-add, differences grow with depth to ~1e-5 relative; 1e-4 absolute and relative"
)
_HALF_BACKENDS = (
    "{dtype} outputs of two runtimes on the same graph: one runtime may keep {dtype} intermediates where the other "
    "widens to float32 (ONNX Runtime CPU widens everything), so each layer can differ by a few {dtype} ulps"
)

_F64_NORM = (
    "float64 output of the torch reference with float64 accumulation (the float64 torch runner) against the "
    "oracle: the same formula in float64, x * rsqrt(v) against x / sqrt(v), a few float64 ulps apart"
)

_ROTARY_TABLE = (
    "float32 cos/sin of the same float32 angle (inv_freq times a position: one rounding in both) by two libraries: "
    "ONNX Runtime's Cos/Sin and torch's are each within about 1 ulp of the exact value, so they may differ by 2 ulps, "
    "2^-23 absolute for values near 1 (measured on 32768 positions x 128 frequencies: 21 % of entries differ, "
    "by at most 2^-23)"
)
_QUANTIZED_FP32 = (
    "one layer of a weight-only quantized graph computing in float32 (MatMulNBits accuracy_level 0 or 1) against "
    "the PyTorch layer holding the dequantized weights: the kernel multiplies by exactly those weights (an int times "
    "a float scale is exact in float32, and equal bit for bit to what it multiplies an identity into), summed block "
    "by block in another order, so the bound of the unquantized layer in this dtype applies"
)
_QUANTIZED_INT8 = (
    "outputs of a graph computing in int8 (MatMulNBits accuracy_level 4) against the PyTorch model holding the "
    "dequantized weights, each quantized MatMul's input rounded per block to int8 as the kernel rounds it (one "
    "MatMulNBits matches that to 1e-6 relative). ONNX Runtime's fused float ops before a MatMul "
    "(SimplifiedLayerNormalization, QuickGelu) give activations a few float32 ulps from PyTorch's, and wherever one "
    "sits that close to a rounding boundary the two sides round it to neighbouring int8 steps (1/127 of its block's "
    "largest value): a handful per MatMul at hidden 4096, each moving what follows. So the bound is a share of the "
    "output's own scale, the largest |expected| value (tolerance_at_scale): measured up to 0.7 % for one layer at "
    "hidden 4096, 2.1 % for three, 1.6 % for 12 layers at hidden 768; 5 %, against the 1-40 % the weights' "
    "quantization itself moves the logits"
)
#: Checks whose ``atol`` is a share of the largest |expected| value, not an absolute bound.
SCALED_CHECKS = ("quantized_model_int8",)

TOLERANCES: dict[tuple[str, str, str], Tolerance] = {}
TOLERANCES[("norm", "torch", "float64")] = Tolerance(max_ulp=4, reason=_F64_NORM)
for _backend in ("torch", "onnxruntime", "tensorrt", "triton"):
    TOLERANCES[("norm", _backend, "float32")] = Tolerance(atol=1e-30, max_ulp=16, reason=_FP32_NORM)
    for _dt in ("float16", "bfloat16"):
        TOLERANCES[("norm", _backend, _dt)] = Tolerance(max_ulp=3, reason=_HALF_NORM.format(dtype=_dt))
    TOLERANCES[("norm_vs_torch", _backend, "float32")] = Tolerance(atol=1e-30, max_ulp=32, reason=_FP32_NORM_VS_TORCH)
    TOLERANCES[("layer_norm", _backend, "float32")] = Tolerance(atol=4 * 2.0**-21, max_ulp=16, reason=_FP32_LAYER_NORM)
    for _dt in ("float16", "bfloat16"):
        TOLERANCES[("norm_vs_torch", _backend, _dt)] = Tolerance(max_ulp=2, reason=_HALF_NORM_VS_TORCH.format(dtype=_dt))
        TOLERANCES[("layer_norm", _backend, _dt)] = Tolerance(
            atol=2 * 8 * machine_epsilon(_dt), max_ulp=2, reason=_HALF_LAYER_NORM.format(dtype=_dt))
for _backend in ("onnxruntime", "tensorrt"):
    TOLERANCES[("backends", _backend, "float32")] = Tolerance(atol=1e-4, rtol=1e-4, reason=_FP32_BACKENDS)
    TOLERANCES[("backends", _backend, "float16")] = Tolerance(atol=2e-2, rtol=2e-2, reason=_HALF_BACKENDS.format(dtype="float16"))
    TOLERANCES[("backends", _backend, "bfloat16")] = Tolerance(
        atol=1.25e-1, rtol=1e-1, reason=_HALF_BACKENDS.format(dtype="bfloat16"))
    TOLERANCES[("model", _backend, "float32")] = Tolerance(atol=1e-4, rtol=1e-4, reason=_FP32_MODEL)
    TOLERANCES[("model", _backend, "float16")] = Tolerance(atol=2e-2, rtol=2e-2, reason=_HALF_MODEL.format(dtype="float16"))
    TOLERANCES[("model", _backend, "bfloat16")] = Tolerance(atol=1.25e-1, rtol=1e-1, reason=_HALF_MODEL.format(dtype="bfloat16"))
TOLERANCES[("rotary_table", "onnxruntime", "float32")] = Tolerance(atol=2.0**-23, max_ulp=2, reason=_ROTARY_TABLE)
for _dt in ("float32", "float16"):  # the dtypes MatMulNBits runs in on ONNX Runtime CPU
    _model = TOLERANCES[("model", "onnxruntime", _dt)]
    TOLERANCES[("quantized_model", "onnxruntime", _dt)] = Tolerance(
        atol=_model.atol, rtol=_model.rtol, reason=_QUANTIZED_FP32 + f" ({_dt}: {_model.reason})")
    TOLERANCES[("quantized_model_int8", "onnxruntime", _dt)] = Tolerance(atol=5e-2, reason=_QUANTIZED_INT8)


@dataclasses.dataclass(frozen=True)
class AccuracyBound:
    """``max|runtime - float64| <= ratio * max|torch - float64| + atol``, for outputs of the same dtype."""

    ratio: float
    atol: float
    reason: str = ""

    def tolerance(self, source_error: float) -> Tolerance:
        """The absolute tolerance this bound allows when the source module is ``source_error`` from float64."""
        return Tolerance(
            atol=self.ratio * float(source_error) + self.atol,
            reason=f"{self.ratio:g} x the PyTorch module's own error vs float64 ({source_error:.3g}) + {self.atol:g}",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_F64_RATIO = (
    "{dtype} outputs against a float64 run of the source: the runtime and torch round every matmul and add to "
    "{dtype}, in different orders, so each is some ulps of {dtype} from float64, and both drift further with depth "
    "and logit scale alike; the runtime may be at most {ratio:g}x as far as torch (plus {atol:g} for outputs whose "
    "torch error is near zero), or it would be less accurate than the source. Measured ratios (runtime / torch "
    "distance) on trained checkpoints: SmolLM2-135M 0.78-1.06 (plain graph), 0.79-1.4 (onnxruntime target, prefill "
    "and steps); Gemma 3 270M 1.9-2.7 (plain graph: ONNX Runtime's own graph optimizations move its logits 2.7e-3 "
    "from its unoptimized run). Planted defects (a wrong epsilon, w for 1 + w, one layer's weights swapped, a norm "
    "dropped) land beyond 10x the bound (tests/exporter/test_real_export_defects.py)"
)
_F64_QUANTIZED = (
    "; for a quantized graph computing in float32 the source is the model holding the dequantized weights: the kernel "
    "multiplies by exactly those weights, summed block by block in another order, so the same ratio applies"
)
ACCURACY_BOUNDS: dict[tuple[str, str, str], AccuracyBound] = {}
for _backend in ("onnxruntime", "tensorrt"):
    for _dt, _ratio, _atol in (("float32", 4.0, 1e-5), ("float16", 2.0, 2e-3), ("bfloat16", 2.0, 1.6e-2)):
        ACCURACY_BOUNDS[("model_vs_float64", _backend, _dt)] = AccuracyBound(
            _ratio, _atol, _F64_RATIO.format(dtype=_dt, ratio=_ratio, atol=_atol))
_INT8_SPREAD = (
    "a graph computing in int8 against its int8-rounding reference, where that reference is itself unstable: its "
    "float32 and float64 runs differ only in summation order, yet round activations to different int8 steps, and "
    "each flip moves all that follows. On real Gemma 3 270M (int8, 18 layers, activations in the hundreds) the two "
    "runs land up to 4.2 logits apart while the graph is 2.8 from the float32 run, beyond 5 % of the logits' scale "
    "(2.7); at int4-mixed the runs land 1.35 apart and the graph 2.9 from the float32 run (2.2x). Where the reference's own spread allows more than the share of scale, the graph may be as many times "
    "that spread from it as a float graph may be its source's distance from float64 ({ratio:g}x: the graph's "
    "distance is one more sample of the same flips), while tolerance_at_scale's share applies where the reference "
    "is stable, as on SmolLM2"
)
for _dt in ("float32", "float16"):  # the dtypes MatMulNBits runs in on ONNX Runtime CPU
    _bound = ACCURACY_BOUNDS[("model_vs_float64", "onnxruntime", _dt)]
    ACCURACY_BOUNDS[("quantized_model_vs_float64", "onnxruntime", _dt)] = dataclasses.replace(
        _bound, reason=_bound.reason + _F64_QUANTIZED)
    ACCURACY_BOUNDS[("quantized_model_int8", "onnxruntime", _dt)] = AccuracyBound(
        _bound.ratio, 0.0, _INT8_SPREAD.format(ratio=_bound.ratio))


def accuracy_bound_for(check: str, backend: str, dtype: str) -> AccuracyBound:
    """The accuracy bound of ``check`` for ``backend`` on ``dtype`` outputs; KeyError names what exists."""
    key = (check, backend, dtype)
    try:
        return ACCURACY_BOUNDS[key]
    except KeyError:
        known = sorted({k[:2] for k in ACCURACY_BOUNDS})
        raise KeyError(f"no accuracy bound for {key}; known (check, backend) pairs: {known}") from None


def tolerance_for(check: str, backend: str, dtype: str) -> Tolerance:
    """The tolerance of ``check`` for ``backend`` on ``dtype`` outputs; KeyError names what exists."""
    key = (check, backend, dtype)
    try:
        return TOLERANCES[key]
    except KeyError:
        known = sorted({k[:2] for k in TOLERANCES})
        raise KeyError(f"no tolerance for {key}; known (check, backend) pairs: {known}") from None


def tolerance_at_scale(check: str, backend: str, dtype: str, scale: float) -> Tolerance:
    """:func:`tolerance_for`; for a check of :data:`SCALED_CHECKS` its ``atol`` times ``scale`` (the
    largest |expected| value of the output compared)."""
    base = tolerance_for(check, backend, dtype)
    if check not in SCALED_CHECKS:
        return base
    return dataclasses.replace(base, atol=base.atol * float(scale),
                               reason=f"{base.atol:g} x the largest |expected| value {float(scale):.3g}: {base.reason}")


_SUBNORMAL_GAIN = (
    "; cast_then_scale rounds the normalized value to {dtype} before the gain multiplies it, and where that value is "
    "subnormal its rounding step (the smallest {dtype} subnormal) is large next to the product, so the gain times two "
    "such steps is allowed as an absolute error"
)


def norm_tolerance(check: str, backend: str, dtype: str, spec: Any, gain_max: float) -> Tolerance:
    """The tolerance of ``check`` (``norm`` or ``norm_vs_torch``) for one norm of ``spec`` whose gain is at
    most ``gain_max`` in magnitude: :func:`tolerance_for`, plus, for cast_then_scale in a half dtype, the
    absolute error of rounding a subnormal normalized value before the gain multiplies it."""
    base = tolerance_for(check, backend, dtype)
    if dtype not in ("float16", "bfloat16") or not spec.has_gain or spec.order != "cast_then_scale":
        return base
    step = float(ml_dtypes.finfo(numpy_dtype(dtype)).smallest_subnormal)
    return dataclasses.replace(base, atol=max(base.atol, 2.0 * float(gain_max) * step),
                               reason=base.reason + _SUBNORMAL_GAIN.format(dtype=dtype))


def subnormal_input_allowance(dtype: str, gain_abs: Any, rms: Any) -> Any:
    """Per-element absolute error a norm's output may have because its input was rounded to ``dtype``
    (or not): a backend may normalize its input before rounding it to the model dtype (ONNX Runtime's
    CPU provider keeps float16 graphs in float32 between ops), while the oracle sees the rounded value.
    Where that value is normal, the rounding is within the ulp bound already; where it is subnormal,
    the rounding step is the smallest subnormal, which the norm scales by ``|gain| / rms`` of the row.
    ``gain_abs`` and ``rms`` broadcast against the output; returns 0 for float32."""
    import numpy as np

    if dtype not in ("float16", "bfloat16"):
        return np.zeros(())
    step = float(ml_dtypes.finfo(numpy_dtype(dtype)).smallest_subnormal)
    return np.asarray(gain_abs, dtype=np.float64) * (step / 2.0) / np.asarray(rms, dtype=np.float64)
