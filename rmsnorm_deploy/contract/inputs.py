"""Seeded inputs for parity checks: ordinary activations and stress values.

Stress inputs are what breaks a float16 reduction: magnitudes from 300 to 60000, whose
squares (9e4 to 3.6e9) overflow float16's 65504, mixed with all-zero rows.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rmsnorm_deploy.contract.dtypes import dtype_name, numpy_dtype

INPUT_KINDS = ("normal", "stress")
STRESS_RANGE = (300.0, 60000.0)


def activations(shape: Sequence[int], dtype: Any, *, seed: int = 0, kind: str = "normal") -> np.ndarray:
    """An activation tensor of ``shape`` in ``dtype``: ``normal`` (N(0, 2^2)) or ``stress``."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in shape)
    if kind == "normal":
        values = rng.normal(0.0, 2.0, size=shape)
    elif kind == "stress":
        lo, hi = np.log(STRESS_RANGE[0]), np.log(STRESS_RANGE[1])
        values = np.exp(rng.uniform(lo, hi, size=shape)) * rng.choice([-1.0, 1.0], size=shape)
        if len(shape) >= 2 and shape[-2] > 2:
            values[..., 1, :] = 0.0  # an all-zero row must give zeros, not NaN
    else:
        raise ValueError(f"unknown input kind {kind!r}; choose from {INPUT_KINDS}")
    return values.astype(numpy_dtype(dtype_name(dtype)))


def gain_weights(shape: Sequence[int], dtype: Any, gain: str, *, seed: int = 1) -> np.ndarray | None:
    """A weight for ``gain``: around 1 for ``weight``, around 0 for ``offset`` (Gemma's ``1 + w``)."""
    if gain == "none":
        return None
    rng = np.random.default_rng(seed)
    center = 1.0 if gain == "weight" else 0.0
    values = center + rng.normal(0.0, 0.5, size=tuple(shape))
    return values.astype(numpy_dtype(dtype_name(dtype)))


def token_ids(shape: Sequence[int], high: int, *, seed: int = 0) -> np.ndarray:
    """Seeded token ids in ``[0, high)``, int64, the input of every exported language model."""
    if high < 1:
        raise ValueError(f"a vocabulary of {high} tokens has no ids to draw")
    rng = np.random.default_rng(seed)
    return rng.integers(0, high, size=tuple(int(d) for d in shape), dtype=np.int64)
