"""Whether this machine runs TensorRT engines, and the reason it does not (the skip message).

One place for the ``trt`` tests' condition: tensorrt importable and a CUDA GPU that torch sees.
"""

from __future__ import annotations

import importlib.util

import pytest


def trt_skip_reason() -> str | None:
    """Why TensorRT engines cannot run here, or ``None`` when they can."""
    if importlib.util.find_spec("tensorrt") is None:
        return "needs tensorrt: not installed here (run `pytest -m trt` in the Docker image)"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU for TensorRT: torch sees none"
    return None


TRT_SKIP = trt_skip_reason()
#: ``pytestmark`` of a module whose every test builds or runs an engine.
needs_trt = [pytest.mark.trt, pytest.mark.skipif(TRT_SKIP is not None, reason=TRT_SKIP or "")]
