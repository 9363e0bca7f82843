"""Every tolerance the project uses, in one table, each with the reason for its size.

Keys are ``(check, backend, dtype)``:

* ``check="norm"``: one RMSNorm's output against the float64 oracle of its spec
  (``reference.oracle``), measured in ULPs of the output dtype.
* ``check="model"``: a whole exported model's outputs against the PyTorch module it came
  from, run in the same dtype (logits after many matmuls: absolute/relative bounds).

:data:`ACCURACY_BOUNDS` holds the other kind of bound, keyed the same way:

* ``check="model_vs_float64"``: a runtime's distance from the float64 run of the source
  module may be at most ``ratio`` times the PyTorch module's own distance from it, plus
  ``atol``: an export may not be less accurate than its source. Relative to the source,
  because a model's logits (and so its rounding error) scale with its weights.

Backends are the runtimes that produce the output: ``torch`` (our reference itself),
``onnxruntime``, ``tensorrt``, ``triton`` (our kernel).
"""

from __future__ import annotations

import dataclasses
from typing import Any


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
    "rounding to {dtype}: 0.5 ulp for scale_then_cast, and up to 1 ulp more for cast_then_scale, which rounds "
    "the normalized value and the gain before the product is rounded; 2 ulp leaves room for a runtime that "
    "divides where torch multiplies by rsqrt"
)
_FP32_MODEL = (
    "float32 logits after a few layers of matmuls: the runtimes sum in different orders, so differences grow "
    "with the depth to ~1e-5 relative; 1e-4 absolute is the bar the exported model must meet against eager"
)
_HALF_MODEL = (
    "{dtype} logits: every matmul and residual add rounds to {dtype} in both runtimes, in different orders, so "
    "differences of a few {dtype} ulps per layer add up; the bound is a few ulps of the logits' magnitude"
)

TOLERANCES: dict[tuple[str, str, str], Tolerance] = {}
for _backend in ("torch", "onnxruntime", "tensorrt", "triton"):
    TOLERANCES[("norm", _backend, "float32")] = Tolerance(atol=1e-30, max_ulp=16, reason=_FP32_NORM)
    for _dt in ("float16", "bfloat16"):
        TOLERANCES[("norm", _backend, _dt)] = Tolerance(max_ulp=2, reason=_HALF_NORM.format(dtype=_dt))
for _backend in ("onnxruntime", "tensorrt"):
    TOLERANCES[("model", _backend, "float32")] = Tolerance(atol=1e-4, rtol=1e-4, reason=_FP32_MODEL)
    TOLERANCES[("model", _backend, "float16")] = Tolerance(atol=2e-2, rtol=2e-2, reason=_HALF_MODEL.format(dtype="float16"))
    TOLERANCES[("model", _backend, "bfloat16")] = Tolerance(atol=1.25e-1, rtol=1e-1, reason=_HALF_MODEL.format(dtype="bfloat16"))


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
    "{dtype} logits against a float64 run: the runtime and torch round every matmul and add to {dtype}, in "
    "different orders, so each is some ulps of {dtype} from float64; the runtime may be at most {ratio:g}x as far "
    "as torch (plus {atol:g} for outputs whose torch error is near zero), or it would be less accurate than the source"
)
ACCURACY_BOUNDS: dict[tuple[str, str, str], AccuracyBound] = {}
for _backend in ("onnxruntime", "tensorrt"):
    for _dt, _ratio, _atol in (("float32", 4.0, 1e-5), ("float16", 2.0, 2e-3), ("bfloat16", 2.0, 1.6e-2)):
        ACCURACY_BOUNDS[("model_vs_float64", _backend, _dt)] = AccuracyBound(
            _ratio, _atol, _F64_RATIO.format(dtype=_dt, ratio=_ratio, atol=_atol))


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
