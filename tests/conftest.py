"""Shared test settings: Hypothesis profile and the odd shapes every numeric test runs over."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("ci")

#: hidden 1, 7, 760, 4096 (odd and power-of-two) x rows 1 and 199
ODD_SHAPES = [(rows, hidden) for rows in (1, 199) for hidden in (1, 7, 760, 4096)]
DTYPES = ["float32", "float16", "bfloat16"]
