"""ONNX Runtime runner: CPU, CUDA and TensorRT execution providers, never a silent fallback.

onnxruntime-gpu asked for CUDA without the CUDA libraries logs an error and runs the whole
model on the CPU. This runner compares the providers the session really uses with the ones
that were asked for and raises :class:`ProviderError` naming what is missing.

bfloat16 has no numpy dtype in ONNX Runtime's Python API: inputs go in as ``OrtValue``s made
from a uint16 view, outputs come back through an ``IOBinding`` and are read from memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Sequence

import ml_dtypes
import numpy as np
import onnx

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.errors import InputError, ProviderError, UserError, one_line
from rmsnorm_deploy.optional import require
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


def short_provider_name(full: str) -> str:
    """ONNX Runtime's provider name to ours (``CUDAExecutionProvider`` -> ``cuda``)."""
    return {v: k for k, v in PROVIDERS.items()}.get(full, full)


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
    """Runs an ONNX model with ONNX Runtime on the requested providers, or refuses.

    ``providers`` are short names (``cpu``, ``cuda``, ``tensorrt``) or ONNX Runtime's, in
    priority order; every one of them must be in the session ONNX Runtime creates, or
    :class:`ProviderError` says what is missing. ``provider_options`` maps a provider (short
    or full name) to its options, e.g. ``{"cuda": {"device_id": "1"}}``.
    """

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
        self.requested = list(dict.fromkeys(provider_name(p) for p in providers))
        self.optimization = optimization
        self.provider_options = {provider_name(k): {str(a): str(b) for a, b in v.items()}
                                 for k, v in (provider_options or {}).items()}
        unused = sorted(set(self.provider_options) - set(self.requested))
        if unused:
            raise UserError(f"options given for {', '.join(unused)}, which was not requested; requested: "
                            f"{', '.join(self.requested)}")
        self.optimized_model_path = optimized_model_path
        self.intra_op_threads = intra_op_threads
        self.session: Any = None
        self.actual_providers: list[str] = []

    @property
    def name(self) -> str:
        return f"onnxruntime[{','.join(short_provider_name(p) for p in self.requested)}]"

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
        # enable_fallback=0: ONNX Runtime's Python layer would otherwise retry a failing
        # TensorRT or CUDA session on other providers and only print that it did.
        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(captured):
                self.session = ort.InferenceSession(source, options, providers=providers, enable_fallback=0)
        except Exception as exc:
            failing = [p for p in self.requested if p != PROVIDERS["cpu"]]
            if failing and _looks_like_provider_failure(exc):
                raise ProviderError(f"{', '.join(failing)} failed to start: {one_line(exc)}; "
                                    + _why_provider_cannot_load(failing[0])) from None
            raise UserError(f"ONNX Runtime cannot load the model: {one_line(exc)}") from None
        actual = self.session.get_providers()
        missing = [p for p in self.requested if p not in actual]
        if missing:
            self.session = None
            raise ProviderError(
                f"requested {', '.join(missing)} but ONNX Runtime created a session on {', '.join(actual)}: "
                f"{_why_provider_cannot_load(missing[0])}; refusing to report CPU numbers as GPU numbers"
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
            raise UserError(f"ONNX Runtime failed to run the model: {one_line(exc)}") from None
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
    from rmsnorm_deploy.graph.onnx_file import check_model_file

    return str(check_model_file(Path(model)))


#: The shared library that holds each GPU provider, inside onnxruntime/capi.
_PROVIDER_LIBRARIES = {
    "CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
    "TensorrtExecutionProvider": "libonnxruntime_providers_tensorrt.so",
}
_LIBRARY_HINTS = {
    "libcuda.so": "the NVIDIA driver",
    "libcudart.so": "the CUDA 13 runtime",
    "libcublas": "cuBLAS (CUDA 13)",
    "libcurand": "cuRAND (CUDA 13)",
    "libcufft": "cuFFT (CUDA 13)",
    "libcudnn": "cuDNN 9",
    "libnvinfer": "TensorRT",
    "libnvonnxparser": "TensorRT's ONNX parser",
}


def _why_provider_cannot_load(provider: str) -> str:
    """Why ONNX Runtime could not start ``provider`` here: missing libraries or no GPU."""
    missing = missing_provider_libraries(provider)
    if missing:
        named = ", ".join(f"{lib} ({_hint(lib)})" for lib in missing)
        return (f"{_PROVIDER_LIBRARIES[provider]} cannot load, missing {named}; install them (e.g. from NVIDIA's "
                "CUDA 13/cuDNN 9 packages) on the library path, or use the Docker image")
    if provider in _PROVIDER_LIBRARIES and not _gpu_visible():
        return "its libraries load but no NVIDIA GPU is visible (no /dev/nvidia0; in a container pass --gpus all)"
    return "the provider's libraries load; see ONNX Runtime's log (set ORT_LOGGING_LEVEL or run with log severity 0)"


def missing_provider_libraries(provider: str) -> list[str]:
    """The shared libraries a GPU provider needs that the dynamic loader cannot find."""
    library = _PROVIDER_LIBRARIES.get(provider)
    if library is None:
        return []
    try:
        import onnxruntime
    except ImportError:
        return []
    path = Path(onnxruntime.__file__).parent / "capi" / library
    if not path.exists():
        return [library]
    ldd = shutil.which("ldd")
    if ldd:
        try:
            out = subprocess.run([ldd, str(path)], capture_output=True, text=True, timeout=30).stdout
            return [line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line]
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:  # without ldd: the loader names the first missing library
        ctypes.CDLL(str(path.parent / "libonnxruntime_providers_shared.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(path))
    except OSError as exc:
        return [str(exc).split(":")[0].strip()]
    return []


def _hint(library: str) -> str:
    return next((what for prefix, what in _LIBRARY_HINTS.items() if library.startswith(prefix)), "a dependency")


def _gpu_visible() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/dev/dxg").exists()


def _looks_like_provider_failure(exc: BaseException) -> bool:
    text = str(exc)
    return any(k in text for k in ("Please install", "Failed to load library", "provider_bridge", "EP Error",
                                   "RegisterTensorRTPluginsAsCustomOps", "Failed to create"))


def set_onnxruntime_log_level(default: int = 4) -> None:
    """Silence ONNX Runtime's own console log (CLI use): its failures become our one-line errors.

    ``RMSNORM_DEPLOY_ORT_LOG_LEVEL`` (0 verbose .. 4 fatal) overrides ``default`` to see it again.
    """
    ort = require("onnxruntime", "the ONNX Runtime runner")
    level = os.environ.get("RMSNORM_DEPLOY_ORT_LOG_LEVEL", "")
    ort.set_default_logger_severity(int(level) if level.isdigit() and int(level) <= 4 else default)
