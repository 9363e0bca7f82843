"""Shared test settings: the Hypothesis profile, and Triton's interpreter where there is no GPU."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton chooses between compiling and interpreting when `triton` is first imported (its
# own tl.sum, tl.max... are @triton.jit functions decorated then), so the choice is made
# here, before any test module imports it: without a GPU, the Triton kernel tests run in
# the interpreter. Each pytest-xdist worker imports this file first, so each gets it.
if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("ci")
