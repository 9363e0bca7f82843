"""Lazy imports of optional dependencies, with the fix in the error message."""

from __future__ import annotations

import importlib
from types import ModuleType

from rmsnorm_deploy.errors import MissingDependencyError

_INSTALL_HINTS = {
    "onnxruntime": "pip install 'rmsnorm-deploy[onnxruntime]' (CPU) or 'rmsnorm-deploy[onnxruntime-gpu]' (CUDA 13)",
    "tensorrt": "use the Docker image (docker/README.md) or pip install 'rmsnorm-deploy[tensorrt]' on a machine "
    "that reaches NVIDIA's package index",
    "triton": "pip install 'rmsnorm-deploy[triton]'",
    "transformers": "pip install 'rmsnorm-deploy[hf]'",
    "llguidance": "pip install 'rmsnorm-deploy[serve]' (or pip install llguidance)",
    "safetensors": "pip install 'rmsnorm-deploy[hf]'",
    # nvidia-pytriton pins numpy<2 although it runs with numpy 2 here (serving/triton/pytriton_env.py): no-deps install
    "pytriton": "pip install 'rmsnorm-deploy[serve]' && pip install --no-deps nvidia-pytriton==0.7.0",
    "tritonclient": "pip install 'rmsnorm-deploy[serve]'",
    "prometheus_client": "pip install 'rmsnorm-deploy[serve]'",
    "tokenizers": "pip install 'rmsnorm-deploy[hf]' (transformers brings tokenizers)",
    "gguf": "pip install 'rmsnorm-deploy[gguf]'",
    "accelerate": "pip install 'rmsnorm-deploy[gguf]'",
}


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise a one-line error naming ``feature`` and the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        hint = _INSTALL_HINTS.get(top, f"pip install {top}")
        raise MissingDependencyError(f"{feature} needs {top}, which is not installed ({exc}); {hint}") from None
