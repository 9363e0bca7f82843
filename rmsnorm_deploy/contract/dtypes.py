"""Dtype names and their torch, numpy and ONNX forms.

The project speaks of dtypes by name (``"float32"``, ``"float16"``, ``"bfloat16"``,
``"float64"``); this module converts between the name and each library's object.
numpy has no native bfloat16: ``ml_dtypes.bfloat16`` (a dependency of onnx) stands in.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from onnx import TensorProto

from rmsnorm_deploy.errors import UserError

#: The activation dtypes a model can be exported and validated in.
MODEL_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")

_ONNX = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
    "float64": TensorProto.DOUBLE,
}
_NUMPY = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
}
_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp64": "float64", "double": "float64", "f64": "float64",
}
#: Bits of precision (including the implicit bit) of each dtype: one ulp at 1.0 is 2**-(p-1).
PRECISION_BITS = {"float32": 24, "float16": 11, "bfloat16": 8, "float64": 53}


def dtype_name(dtype: Any) -> str:
    """The canonical name of ``dtype``: a name, alias, torch dtype, numpy dtype or ONNX enum."""
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower())
        if name in _ONNX:
            return name
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(_ONNX)}")
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        for name, enum in _ONNX.items():
            if enum == dtype:
                return name
        raise UserError(f"unsupported ONNX element type {dtype}; use float32, float16, bfloat16 or float64")
    torch_name = _torch_dtype_name(dtype)
    if torch_name is not None:
        return torch_name
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(_ONNX)}") from None
    for name, candidate in _NUMPY.items():
        if candidate == np_dtype:
            return name
    raise UserError(f"unsupported dtype {dtype!r}; use one of {', '.join(_ONNX)}")


def _torch_dtype_name(dtype: Any) -> str | None:
    import torch

    if isinstance(dtype, torch.dtype):
        names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
        if dtype in names:
            return names[dtype]
        raise UserError(f"unsupported torch dtype {dtype}; use float32, float16, bfloat16 or float64")
    return None


def onnx_type(dtype: Any) -> int:
    return _ONNX[dtype_name(dtype)]


def numpy_dtype(dtype: Any) -> np.dtype:
    return _NUMPY[dtype_name(dtype)]


def torch_dtype(dtype: Any):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}[
        dtype_name(dtype)
    ]


def to_numpy(tensor) -> np.ndarray:
    """A torch tensor as a numpy array of the same dtype (bfloat16 through ml_dtypes)."""
    import torch

    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(array: np.ndarray):
    """A numpy array as a torch tensor of the same dtype (bfloat16 through ml_dtypes)."""
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def machine_epsilon(dtype: Any) -> float:
    """The gap between 1.0 and the next value of ``dtype``."""
    return 2.0 ** -(PRECISION_BITS[dtype_name(dtype)] - 1)
