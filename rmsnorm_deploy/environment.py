"""What this machine has: versions, GPU, providers. Optional pieces are reported, never imported eagerly."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import shutil
import subprocess
from typing import Any

from rmsnorm_deploy.errors import UserError


def package_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect() -> dict[str, Any]:
    import torch

    from rmsnorm_deploy import __version__

    info: dict[str, Any] = {
        "rmsnorm-deploy": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch.cuda": torch.version.cuda or "none (CPU build)",
        "cuda.available": torch.cuda.is_available(),
        "onnx": package_version("onnx"),
        "onnxscript": package_version("onnxscript"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info["driver"] = _nvidia_driver()
    ort_dist = next((d for d in ("onnxruntime-gpu", "onnxruntime") if package_version(d) != "not installed"), None)
    info["onnxruntime"] = f"{ort_dist} {package_version(ort_dist)}" if ort_dist else "not installed"
    if ort_dist:
        try:
            ort = importlib.import_module("onnxruntime")
            info["onnxruntime.providers"] = ", ".join(ort.get_available_providers())
        except Exception as exc:  # a broken install is worth seeing, not crashing on
            info["onnxruntime.providers"] = f"import failed: {exc}"
    for dist in ("tensorrt", "triton", "transformers"):
        info[dist] = package_version(dist)
    return info


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


def require_gpu(info: dict[str, Any]) -> None:
    if not info.get("cuda.available"):
        raise UserError(
            "no CUDA GPU is visible; run the container with `docker run --gpus all ...` on a machine with the NVIDIA "
            "Container Toolkit"
        )
