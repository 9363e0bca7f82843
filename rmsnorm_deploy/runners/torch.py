"""Torch runner: an ``nn.Module`` behind the runner interface, on the CPU or a CUDA GPU.

The module is what :func:`rmsnorm_deploy.exporter.rebuild.rebuild_source` returns: its ``forward``
takes the ONNX inputs as keyword arguments and returns a dict keyed by the ONNX output
names. numpy goes in and comes out (bfloat16 as ``ml_dtypes.bfloat16``).

``dtype="float64"`` runs a float64 copy of the module: parameters and floating inputs are
widened, and every submodule that carries an :class:`RMSNormSpec` (``SpecRMSNorm``, the
standalone source) accumulates in float64, so its norms evaluate the float64 oracle.
Modules that cast to float32 themselves (HF's norms do) stay float32 at those points.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np

from rmsnorm_deploy.contract.dtypes import dtype_name, to_numpy, to_torch, torch_dtype
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import ProviderError, UserError
from rmsnorm_deploy.runners.base import Runner

DEVICES = ("cpu", "cuda")


class TorchRunner(Runner):
    """Runs ``module(**feed)`` under ``torch.inference_mode`` on ``device``."""

    backend = "torch"

    def __init__(self, module: Any, *, device: str = "cpu", dtype: str | None = None):
        super().__init__()
        if device not in DEVICES and not device.startswith("cuda:"):
            raise UserError(f"unknown torch device {device!r}; choose cpu or cuda")
        self.module = module
        self.device = device
        self.dtype = dtype_name(dtype) if dtype is not None else None
        self._active_module: Any = None

    @property
    def name(self) -> str:
        suffix = f",{self.dtype}" if self.dtype == "float64" else ""
        return f"torch[{self.device}{suffix}]"

    def _activate(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                build = f"torch {torch.__version__}" + ("" if torch.version.cuda else " is a CPU-only build")
                raise ProviderError(f"torch runner on {self.device} requested but torch sees no CUDA GPU ({build}); "
                                    "run on a machine with a GPU and a CUDA build of torch, or use --device cpu")
        module = self.module
        if self.dtype == "float64":
            module = float64_copy(module)
        elif self.dtype is not None:
            module = copy.deepcopy(module).to(_torch_dtype(self.dtype))
        self._active_module = module.to(self.device).eval()

    def _deactivate(self) -> None:
        self._active_module = None
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        tensors = {}
        for name, array in feed.items():
            tensor = to_torch(np.ascontiguousarray(array))
            if self.dtype == "float64" and tensor.is_floating_point():
                tensor = tensor.to(torch.float64)
            tensors[name] = tensor.to(self.device)
        with torch.inference_mode():
            try:
                outputs = self._active_module(**tensors)
            except TypeError as exc:
                raise UserError(f"the torch module does not take these inputs ({sorted(feed)}): {exc}") from None
        if isinstance(outputs, torch.Tensor):
            raise UserError("the torch module returned a bare tensor; it must return a dict keyed by output name")
        return {name: to_numpy(value) for name, value in outputs.items()}


def float64_copy(module: Any) -> Any:
    """A float64 copy of ``module`` whose RMSNorm specs accumulate in float64 (their oracle)."""
    import torch


    wide = copy.deepcopy(module).to(torch.float64)
    for sub in wide.modules():
        spec = getattr(sub, "spec", None)
        if isinstance(spec, RMSNormSpec):
            sub.spec = dataclasses.replace(spec, accumulation="float64")
    return wide


def _torch_dtype(name: str) -> Any:

    return torch_dtype(name)
