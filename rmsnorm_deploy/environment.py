"""What this machine has, for ``rmsnorm-deploy env``: versions, GPU, driver, CUDA, ONNX Runtime
providers, TensorRT, Triton and our plugin. Optional pieces are imported inside the functions that
report on them, never when this module is imported, and a missing or broken piece is reported,
not raised. (Package versions and the memory budget every package may ask for are in ``resources``.)

ONNX Runtime lists a provider as *available* when its library is in the package, which says
nothing about whether it loads here: the CUDA and TensorRT providers are therefore probed with
a one-node session, and reported as loading only when the session really runs on them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import io
import platform
import shutil
import subprocess
from typing import Any

from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.resources import NOT_INSTALLED, __version__, package_version

#: ONNX Runtime providers that are probed with a session (the CPU provider always loads).
PROBED_PROVIDERS = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def collect() -> dict[str, Any]:
    """Everything ``rmsnorm-deploy env`` prints, in the order it prints it."""
    import torch

    info: dict[str, Any] = {
        "rmsnorm-deploy": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": torch.__version__,
        "torch.cuda": torch.version.cuda or "none (CPU build)",
        "cuda.available": torch.cuda.is_available(),
    }
    if info["cuda.available"]:
        info["gpu"] = "; ".join(_describe_gpu(torch, i) for i in range(torch.cuda.device_count()))
    else:
        info["cuda.error"] = _cuda_unavailable_reason(torch)
    info["driver"] = _nvidia_driver()
    info["cuda.driver_api"] = cuda_driver_api_version()
    info["cuda.runtime"] = cuda_runtime_version()

    ort_dist = next((d for d in ("onnxruntime-gpu", "onnxruntime") if package_version(d) != NOT_INSTALLED), None)
    info["onnxruntime"] = f"{ort_dist} {package_version(ort_dist)}" if ort_dist else NOT_INSTALLED
    if ort_dist:
        try:
            ort = importlib.import_module("onnxruntime")
            info["onnxruntime.providers"] = ", ".join(ort.get_available_providers())
            for short, provider in PROBED_PROVIDERS.items():
                info[f"onnxruntime.{short}_ep"] = probe_onnxruntime_provider(provider)
        except Exception as exc:  # a broken install is worth seeing, not crashing on
            info["onnxruntime.providers"] = f"import failed: {one_line(exc)}"

    tensorrt_version, tensorrt_module = _tensorrt()
    info["tensorrt"] = tensorrt_version
    info["tensorrt.plugin"] = plugin_status(tensorrt_module is not None)
    for dist in ("triton", "onnx", "onnxscript", "numpy", "ml_dtypes", "transformers"):
        info[dist] = package_version(dist)
    return info


def _describe_gpu(torch: Any, index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return f"{index}: {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"


def _cuda_unavailable_reason(torch: Any) -> str:
    """Why torch sees no GPU: its own words (no driver, driver too old, no device) when it has them."""
    if not torch.version.cuda:
        return "torch is a CPU build"
    try:
        torch.cuda.init()
    except Exception as exc:
        return one_line(exc)
    return "torch.cuda.is_available() is False"


def _nvidia_driver() -> str:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return "no nvidia-smi"
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "nvidia-smi failed"
    except (OSError, subprocess.TimeoutExpired):
        return "nvidia-smi failed"


def _cuda_version_text(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def cuda_driver_api_version() -> str:
    """The newest CUDA the installed driver supports (``cuDriverGetVersion``), or why it is unknown."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "not found (no libcuda.so.1: no NVIDIA driver visible)"
    version = ctypes.c_int(0)
    status = lib.cuDriverGetVersion(ctypes.byref(version))
    if status != 0:
        return f"cuDriverGetVersion failed (CUresult {status})"
    return _cuda_version_text(version.value)


def cuda_runtime_version() -> str:
    """The CUDA runtime library the loader resolves (``cudaRuntimeGetVersion``) and its path."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        status = lib.cudaRuntimeGetVersion(ctypes.byref(version))
        if status != 0:
            return f"{name}: cudaRuntimeGetVersion failed (cudaError {status})"
        return f"{_cuda_version_text(version.value)} ({_loaded_path('libcudart') or name})"
    return "not found (no libcudart on the library path)"


def _loaded_path(stem: str) -> str | None:
    """The file a loaded shared library came from, read from /proc/self/maps (Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if f"/{stem}" in path:
                    return path
    except OSError:
        pass
    return None


def probe_onnxruntime_provider(provider: str) -> str:
    """Whether a session asked to run on ``provider`` really runs on it, in one line."""
    from onnx import TensorProto, helper

    ort = importlib.import_module("onnxruntime")
    if provider not in ort.get_available_providers():
        return f"not in this build ({provider} is not among onnxruntime's providers)"
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.log_severity_level = 3
    printed = io.StringIO()
    try:
        # onnxruntime prints its fallback notice ("EP Error ...") instead of raising: keep it as the reason.
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            session = ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
            session.run(None, {"x": _ones(1, 4)})
    except Exception as exc:
        return f"fails: {one_line(exc)}"
    actual = session.get_providers()
    if actual and actual[0] == provider:
        return "loads"
    reason = next((line.strip() for line in printed.getvalue().splitlines() if "Error" in line), "")
    return f"falls back to {', '.join(actual)}" + (f": {reason[:300]}" if reason else "")


def _ones(*shape: int) -> Any:
    import numpy as np

    return np.ones(shape, dtype=np.float32)


def _tensorrt() -> tuple[str, Any]:
    """TensorRT's version and module, importing it only when it is installed."""
    try:
        if importlib.util.find_spec("tensorrt") is None:
            return NOT_INSTALLED, None
        module = importlib.import_module("tensorrt")
    except Exception as exc:  # not importable, or installed with libraries that do not load
        if package_version("tensorrt") == NOT_INSTALLED and isinstance(exc, ImportError):
            return NOT_INSTALLED, None
        return f"import failed: {one_line(exc)}", None
    return str(getattr(module, "__version__", package_version("tensorrt"))), module


def plugin_status(tensorrt_importable: bool) -> str:
    """Whether our TensorRT plugin loads here: ``loaded: ...``, ``absent (...)`` or ``error: ...``."""
    if not tensorrt_importable:
        return "absent (needs tensorrt, which is not importable here)"
    try:
        module = importlib.import_module("rmsnorm_deploy.tensorrt.plugin_loader")
    except ModuleNotFoundError as exc:
        if exc.name in ("rmsnorm_deploy.tensorrt.plugin", "rmsnorm_deploy.tensorrt.plugin_loader"):
            return "absent (this build of rmsnorm-deploy has no rmsnorm_deploy.tensorrt.plugin)"
        return f"error: {one_line(exc)}"
    except Exception as exc:
        return f"error: {one_line(exc)}"
    try:
        loaded = module.load_plugin()
    except Exception as exc:
        return f"error: {one_line(exc)}"
    return f"loaded: {_describe(loaded)}"


def _describe(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ", ".join(f"{f.name}={getattr(value, f.name)}" for f in dataclasses.fields(value))
    return str(value)


def require_gpu(info: dict[str, Any]) -> None:
    if not info.get("cuda.available"):
        reason = info.get("cuda.error")
        raise UserError(
            "no CUDA GPU is visible" + (f" ({reason})" if reason else "") + "; run the container with "
            "`docker run --gpus all ...` on a machine with the NVIDIA driver and the NVIDIA Container Toolkit"
        )
