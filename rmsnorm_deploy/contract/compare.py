"""Comparing an output with its expected value: a result object, not a boolean.

:func:`compare` reports max/mean/p99 absolute and relative error, the error in units in
the last place (ULP) of the output dtype, NaN/Inf mismatches and the first bad indices,
and, like Polygraphy's ``OutputCompareResult``, the tolerance that would have passed.
``bool(result)`` is pass/fail under the tolerance it was given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from rmsnorm_deploy.contract.dtypes import PRECISION_BITS, dtype_name, to_numpy
from rmsnorm_deploy.contract.tolerances import Tolerance

# Smallest normal exponent of each dtype: below it the spacing stops shrinking.
_MIN_NORMAL_EXP = {"float32": -126, "float16": -14, "bfloat16": -126, "float64": -1022}


def ulp_of(values: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` at each of ``values`` (float64 in, float64 out)."""
    name = dtype_name(dtype)
    p = PRECISION_BITS[name]
    mag = np.abs(values.astype(np.float64, copy=False))
    finite_mag = np.where(np.isfinite(mag), mag, 0.0)
    _, exp = np.frexp(finite_mag)  # mag = m * 2**exp, m in [0.5, 1)
    # zero and subnormals have the spacing of the smallest normal binade
    exp = np.where(finite_mag > 0, np.maximum(exp - 1, _MIN_NORMAL_EXP[name]), _MIN_NORMAL_EXP[name])
    return np.ldexp(1.0, exp - (p - 1))


@dataclasses.dataclass
class CompareResult:
    """How far ``actual`` is from ``expected``, and whether that is within ``tolerance``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tolerance: Tolerance
    max_abs: float
    mean_abs: float
    p99_abs: float
    max_rel: float
    max_ulp: float
    nan_mismatch: int
    inf_mismatch: int
    bad_count: int
    first_bad: list[tuple[int, ...]]
    first_bad_values: list[tuple[float, float]]
    shape_mismatch: str = ""
    #: elements whose expected value is NaN (a reference computed from NaN inputs): nothing to
    #: compare them with, so they fail even where the actual value is NaN too
    nan_expected: int = 0

    @property
    def passed(self) -> bool:
        return (not self.shape_mismatch and self.bad_count == 0 and self.nan_mismatch == 0 and self.inf_mismatch == 0
                and self.nan_expected == 0 and self.size > 0)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def problem(self) -> str:
        """Why this result fails although no element is out of tolerance ("" when there is no such reason)."""
        if self.shape_mismatch:
            return self.shape_mismatch
        if self.size == 0:
            return "nothing compared: the output is empty"
        if self.nan_expected:
            return (f"not comparable: the reference is NaN at {self.nan_expected} of {self.size} elements "
                    "(NaN in the inputs or weights?)")
        return ""

    def __bool__(self) -> bool:
        return self.passed

    def would_pass(self) -> str:
        """The loosest bound this result needed, for a person deciding whether to relax it."""
        return f"max_ulp>={self.max_ulp:.3g} or atol>={self.max_abs:.3g} or rtol>={self.max_rel:.3g}"

    def summary(self) -> str:
        if self.shape_mismatch:
            return f"{self.name}: FAIL {self.shape_mismatch}"
        status = "PASS" if self.passed else "FAIL"
        if self.problem():
            return f"{self.name}: FAIL {self.problem()}"
        text = (
            f"{self.name} [{self.dtype}{list(self.shape)}]: {status} max_abs={self.max_abs:.3g} "
            f"max_rel={self.max_rel:.3g} max_ulp={self.max_ulp:.3g} ({self.tolerance.describe()})"
        )
        if self.nan_mismatch or self.inf_mismatch:
            text += f" nan_mismatch={self.nan_mismatch} inf_mismatch={self.inf_mismatch}"
        if not self.passed and self.first_bad:
            pairs = ", ".join(f"{idx}: got {a:.6g} want {e:.6g}" for idx, (a, e) in zip(self.first_bad, self.first_bad_values))
            text += f"; {self.bad_count} bad, first {pairs}; would pass with {self.would_pass()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["tolerance"] = self.tolerance.to_dict()
        data["passed"] = self.passed
        data["problem"] = self.problem()
        data["shape"] = list(self.shape)
        data["first_bad"] = [list(i) for i in self.first_bad]
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()}


def compare(
    actual: Any,
    expected: Any,
    tolerance: Tolerance,
    *,
    name: str = "y",
    dtype: Any = None,
    max_reported: int = 5,
    allowance: np.ndarray | None = None,
) -> CompareResult:
    """Compare ``actual`` with ``expected`` (any precision; float64 oracle values welcome).

    ``dtype`` is the dtype whose ULPs measure the error: by default ``actual``'s.
    An element passes when ``|a - e| <= atol + rtol * |e|`` or, if the tolerance has
    ``max_ulp``, when its ULP error is at most that. A NaN or infinity where the expected
    value is finite fails, infinities must match exactly, and an expected NaN (a reference
    computed from NaN inputs) is not comparable: it fails too, as does an empty comparison. ``allowance`` (from a rule in ``tolerances.py``) adds
    a per-element absolute error on top of ``atol``.
    """
    a_arr, e_arr = _as_array(actual), _as_array(expected)
    dt = dtype_name(dtype if dtype is not None else a_arr.dtype)
    if a_arr.shape != e_arr.shape:
        return CompareResult(
            name, dt, tuple(a_arr.shape), tolerance, math.inf, math.inf, math.inf, math.inf, math.inf, 0, 0,
            int(max(a_arr.size, e_arr.size)), [], [], shape_mismatch=f"shape {a_arr.shape} != expected {e_arr.shape}",
        )
    a = a_arr.astype(np.float64)
    e = e_arr.astype(np.float64)
    a_nan, e_nan = np.isnan(a), np.isnan(e)
    nan_mismatch = int(np.count_nonzero(a_nan != e_nan))
    a_inf, e_inf = np.isinf(a), np.isinf(e)
    inf_mismatch = int(np.count_nonzero((a_inf | e_inf) & ~(a_inf & e_inf & (np.sign(a) == np.sign(e)))))
    finite = np.isfinite(a) & np.isfinite(e)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        abs_err = np.where(finite, np.abs(a - e), 0.0)
        rel_err = np.where(finite & (e != 0), abs_err / np.abs(e), np.where(abs_err > 0, np.inf, 0.0))
    ulp_err = np.where(finite, abs_err / ulp_of(np.where(finite, e, 0.0), dt), 0.0)
    ok = abs_err <= tolerance.atol + tolerance.rtol * np.abs(np.where(finite, e, 0.0)) + (
        0.0 if allowance is None else np.broadcast_to(allowance, abs_err.shape))
    if tolerance.max_ulp is not None:
        ok |= ulp_err <= tolerance.max_ulp
    bad = finite & ~ok
    bad_idx = np.argwhere(bad)[:max_reported]
    count = int(a.size)
    return CompareResult(
        name=name,
        dtype=dt,
        shape=tuple(a.shape),
        tolerance=tolerance,
        max_abs=float(abs_err.max()) if count else 0.0,
        mean_abs=float(abs_err.mean()) if count else 0.0,
        p99_abs=float(np.percentile(abs_err, 99)) if count else 0.0,
        max_rel=float(rel_err[finite].max()) if finite.any() else 0.0,
        max_ulp=float(ulp_err.max()) if count else 0.0,
        nan_mismatch=nan_mismatch,
        inf_mismatch=inf_mismatch,
        bad_count=int(np.count_nonzero(bad)),
        first_bad=[tuple(int(i) for i in idx) for idx in bad_idx],
        first_bad_values=[(float(a[tuple(idx)]), float(e[tuple(idx)])) for idx in bad_idx],
        nan_expected=int(np.count_nonzero(e_nan)),
    )


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    try:
        import torch

        if isinstance(value, torch.Tensor):

            return to_numpy(value)
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass
    return np.asarray(value)
