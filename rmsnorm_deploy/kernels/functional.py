"""``rms_norm(spec, x, weight)``: the fused Triton kernel behind a torch-shaped function.

This layer owns the checks a user can fail (dtypes, shapes, devices, sizes) and the
reshaping of ``[..., *normalized_shape]`` to rows; ``triton_rmsnorm`` holds the kernel and
its launcher. Inference only: there is no backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import InputError
from rmsnorm_deploy.optional import require

#: Dtypes the kernel reads and writes.
KERNEL_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


def rms_norm(
    spec: RMSNormSpec,
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    **config: Any,
) -> torch.Tensor:
    """``spec`` applied to ``x`` by the fused Triton kernel; same shape and dtype as ``x``.

    ``weight``: shaped like the normalized dims, in ``x``'s dtype or float32 (``None``
    when the spec has no gain). ``out``: a contiguous tensor shaped and typed like ``x``
    to write into (TensorRT's output buffer). ``config``: ``rows_per_program``/``num_warps`` overrides
    for :func:`~rmsnorm_deploy.kernels.triton_rmsnorm.launch_config` (benchmarks).
    CUDA tensors run compiled; CPU tensors only with ``TRITON_INTERPRET=1`` (Triton's
    interpreter).
    """
    require("triton", "the Triton RMSNorm kernel")
    from rmsnorm_deploy.kernels import triton_rmsnorm as kernel  # optional: it imports triton

    rows, n_rows, hidden, row_stride = _rows(spec, x, weight)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise InputError(f"out must be a contiguous {dtype_name(x.dtype)} tensor of shape {list(x.shape)} on {x.device}")
    if n_rows > 0:
        # The kernel reads pointers: contiguous tensors go as they are, since every reshaping view or
        # detach costs microseconds of host time per call, more than the kernel itself at decode sizes.
        w = weight if weight is None or weight.is_contiguous() else weight.contiguous()
        kernel.launch_rows(spec, rows, w, out, n_rows, hidden, row_stride, hidden,
                           kernel.launch_config(hidden, **config))
    return out


def _rows(spec: RMSNormSpec, x: torch.Tensor, weight: torch.Tensor | None) -> tuple[torch.Tensor, int, int, int]:
    """``(tensor, rows, hidden, row stride)``: ``x``'s rows, each contiguous, after checking everything the
    kernel assumes; ``x`` itself where it is contiguous."""
    if not isinstance(x, torch.Tensor):
        raise InputError(f"x must be a torch.Tensor, got {type(x).__name__}")
    name = dtype_name(x.dtype)
    if name not in KERNEL_DTYPES:
        raise InputError(f"the Triton RMSNorm kernel reads {', '.join(KERNEL_DTYPES)}; x is {name}")
    k = spec.normalized_dims
    if x.dim() < k:
        raise InputError(f"x has {x.dim()} dims but the spec normalizes the last {k}")
    normalized_shape = tuple(x.shape[x.dim() - k:])
    hidden = math.prod(normalized_shape)
    if spec.has_gain:
        if weight is None:
            raise InputError(f"spec gain {spec.gain!r} needs a weight of shape {list(normalized_shape)}")
        if not isinstance(weight, torch.Tensor):
            raise InputError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        if tuple(weight.shape) != normalized_shape:
            raise InputError(f"weight has shape {list(weight.shape)}; x's normalized dims are {list(normalized_shape)}")
        if weight.dtype not in (x.dtype, torch.float32):
            raise InputError(f"weight is {dtype_name(weight.dtype)}; the kernel takes a weight in x's dtype ({name}) or float32")
        if weight.device != x.device:
            raise InputError(f"weight is on {weight.device} but x is on {x.device}")
    elif weight is not None:
        raise InputError("spec gain 'none' takes no weight; pass weight=None")
    if hidden == 0:
        raise InputError(f"x has an empty normalized shape {list(normalized_shape)}")
    from rmsnorm_deploy.kernels.triton_rmsnorm import check_hidden  # optional: it imports triton

    check_hidden(hidden)
    if x.is_contiguous():
        return x, x.numel() // hidden, hidden, hidden
    x2d = x.reshape(-1, hidden)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    return x2d, x2d.shape[0], hidden, x2d.stride(0)
