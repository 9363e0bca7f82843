"""ONNX Runtime runner: CPU, CUDA and TensorRT execution providers, never a silent fallback.

onnxruntime-gpu asked for CUDA without the CUDA libraries logs an error and runs the whole
model on the CPU. This runner compares the providers the session really uses with the ones
that were asked for and raises :class:`ProviderError` naming what is missing.

bfloat16 has no numpy dtype in ONNX Runtime's Python API: inputs go in as ``OrtValue``s made
from a uint16 view, outputs come back through an ``IOBinding`` and are read from memory.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Sequence

import ml_dtypes
import numpy as np
import onnx

from rmsnorm_deploy._optional import require
from rmsnorm_deploy.dtypes import dtype_name
from rmsnorm_deploy.errors import InputError, ProviderError, UserError
from rmsnorm_deploy.runners.base import Runner

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
_ORT_TYPE_NAMES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(bfloat16)": "bfloat16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(bool)": "bool",
}
_BF16 = np.dtype(ml_dtypes.bfloat16)


def provider_name(short: str) -> str:
    """``cpu``/``cuda``/``tensorrt`` (or the full ORT name) to ONNX Runtime's provider name."""
    key = short.strip().lower()
    if key in PROVIDERS:
        return PROVIDERS[key]
    for full in PROVIDERS.values():
        if short == full:
            return full
    raise UserError(f"unknown provider {short!r}; choose from {', '.join(PROVIDERS)}")


class OnnxRuntimeRunner(Runner):
    """Runs an ONNX model with ONNX Runtime on the requested providers, or refuses."""

    backend = "onnxruntime"

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto,
        providers: Sequence[str] = ("cpu",),
        *,
        optimization: str = "all",
        provider_options: dict[str, dict[str, Any]] | None = None,
        optimized_model_path: str | os.PathLike | None = None,
        intra_op_threads: int | None = None,
    ):
        super().__init__()
        if optimization not in OPTIMIZATION_LEVELS:
            raise UserError(f"unknown optimization level {optimization!r}; choose from {', '.join(OPTIMIZATION_LEVELS)}")
        if not providers:
            raise UserError("no provider requested; give at least one of cpu, cuda, tensorrt")
        self.model = model
        self.requested = [provider_name(p) for p in providers]
        self.optimization = optimization
        self.provider_options = provider_options or {}
        self.optimized_model_path = optimized_model_path
        self.intra_op_threads = intra_op_threads
        self.session: Any = None

    @property
    def name(self) -> str:
        short = {v: k for k, v in PROVIDERS.items()}
        return f"onnxruntime[{','.join(short.get(p, p) for p in self.requested)}]"

    def _activate(self) -> None:
        ort = require("onnxruntime", "the ONNX Runtime runner")
        available = ort.get_available_providers()
        for prov in self.requested:
            if prov not in available:
                raise ProviderError(
                    f"{prov} is not in this onnxruntime build (it has {', '.join(available)}); "
                    + ("install onnxruntime-gpu (CUDA 13) in place of onnxruntime" if prov != PROVIDERS["cpu"] else "reinstall onnxruntime")
                )
        options = ort.SessionOptions()
        options.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[self.optimization]
        if self.optimized_model_path is not None:
            options.optimized_model_filepath = str(self.optimized_model_path)
        if self.intra_op_threads is not None:
            options.intra_op_num_threads = self.intra_op_threads
        options.log_severity_level = 3
        source = _session_source(self.model)
        providers = [(p, self.provider_options.get(p, {})) for p in self.requested]
        try:
            self.session = ort.InferenceSession(source, options, providers=providers)
        except Exception as exc:
            raise UserError(f"ONNX Runtime cannot load the model: {_one_line(exc)}") from None
        actual = self.session.get_providers()
        missing = [p for p in self.requested if p not in actual]
        if missing:
            raise ProviderError(
                f"requested {', '.join(missing)} but the session runs on {', '.join(actual)}: ONNX Runtime fell back "
                "because the provider could not load (for CUDA: CUDA 13 and cuDNN 9 libraries on the library path; "
                "for TensorRT: libnvinfer); refusing to report CPU numbers as GPU numbers"
            )
        self.actual_providers = actual

    def _deactivate(self) -> None:
        self.session = None

    def input_types(self) -> dict[str, tuple[str, list[Any]]]:
        """Each input's dtype name and shape (ints, or strings for dynamic dims)."""
        return {i.name: (_ORT_TYPE_NAMES.get(i.type, i.type), list(i.shape)) for i in self.session.get_inputs()}

    def output_names(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ort = require("onnxruntime", "the ONNX Runtime runner")
        from onnx import TensorProto

        expected = self.input_types()
        unknown = sorted(set(feed) - set(expected))
        missing = sorted(set(expected) - set(feed))
        if unknown or missing:
            raise InputError(f"inputs do not match the model: missing {missing}, unexpected {unknown}; "
                             f"the model takes {sorted(expected)}")
        binding = self.session.io_binding()
        keep_alive = []
        for name, array in feed.items():
            want_dtype, want_shape = expected[name]
            array = np.ascontiguousarray(array)
            got = _array_dtype_name(array)
            if got != want_dtype:
                raise InputError(f"input {name!r} is {got} but the model wants {want_dtype}; convert it first")
            if len(want_shape) != array.ndim or any(
                isinstance(w, int) and w != g for w, g in zip(want_shape, array.shape)
            ):
                raise InputError(f"input {name!r} has shape {list(array.shape)} but the model wants {want_shape}")
            if array.dtype == _BF16:
                value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), TensorProto.BFLOAT16)
            else:
                value = ort.OrtValue.ortvalue_from_numpy(array)
            keep_alive.append((array, value))
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names():
            binding.bind_output(name, "cpu")
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:
            raise UserError(f"ONNX Runtime failed to run the model: {_one_line(exc)}") from None
        return {name: ortvalue_to_numpy(v) for name, v in zip(self.output_names(), binding.get_outputs())}


def ortvalue_to_numpy(value: Any) -> np.ndarray:
    """A CPU ``OrtValue`` as a numpy array that owns its memory (bfloat16 as ml_dtypes)."""
    if value.data_type() != "tensor(bfloat16)":
        return np.array(value.numpy(), copy=True)
    shape = tuple(value.shape())
    count = int(np.prod(shape)) if shape else 1
    buffer = (ctypes.c_uint16 * count).from_address(value.data_ptr()) if count else (ctypes.c_uint16 * 0)()
    return np.array(np.ctypeslib.as_array(buffer), copy=True).reshape(shape).view(_BF16)


def _array_dtype_name(array: np.ndarray) -> str:
    try:
        return dtype_name(array.dtype)
    except UserError:
        return str(array.dtype)


def _session_source(model: str | os.PathLike | bytes | onnx.ModelProto) -> str | bytes:
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString()
    if isinstance(model, bytes):
        return model
    from rmsnorm_deploy.modelio import check_model_file

    return str(check_model_file(Path(model)))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:400]
