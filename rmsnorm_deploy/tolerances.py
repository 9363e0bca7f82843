"""Every tolerance the project uses, in one table, each with the reason for its size.

Keys are ``(check, backend, dtype)``:

* ``check="norm"``: one RMSNorm's output against the float64 oracle of its spec
  (``reference.oracle``), measured in ULPs of the output dtype.
* ``check="model"``: a whole exported model's outputs against the PyTorch module it came
  from, run in the same dtype (logits after many matmuls: absolute/relative bounds).

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
    "rounding to {dtype}: below 1 ulp for scale_then_cast (one rounding); cast_then_scale rounds up to three "
    "times (the normalized value, a gain that is not already a {dtype} value, i.e. a float32 weight or Gemma's "
    "1 + w, and their product), each off by at most half an ulp of its own value, which in ulps of the result "
    "adds up to just under 3 (the reference itself reaches 2.4 on random inputs)"
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
        TOLERANCES[("norm", _backend, _dt)] = Tolerance(max_ulp=3, reason=_HALF_NORM.format(dtype=_dt))
for _backend in ("onnxruntime", "tensorrt"):
    TOLERANCES[("model", _backend, "float32")] = Tolerance(atol=1e-4, rtol=1e-4, reason=_FP32_MODEL)
    TOLERANCES[("model", _backend, "float16")] = Tolerance(atol=2e-2, rtol=2e-2, reason=_HALF_MODEL.format(dtype="float16"))
    TOLERANCES[("model", _backend, "bfloat16")] = Tolerance(atol=1.25e-1, rtol=1e-1, reason=_HALF_MODEL.format(dtype="bfloat16"))


def tolerance_for(check: str, backend: str, dtype: str) -> Tolerance:
    """The tolerance of ``check`` for ``backend`` on ``dtype`` outputs; KeyError names what exists."""
    key = (check, backend, dtype)
    try:
        return TOLERANCES[key]
    except KeyError:
        known = sorted({k[:2] for k in TOLERANCES})
        raise KeyError(f"no tolerance for {key}; known (check, backend) pairs: {known}") from None
