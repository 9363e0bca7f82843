"""``TritonRMSNorm``: a drop-in ``SpecRMSNorm`` whose forward runs the fused Triton kernel."""

from __future__ import annotations

import torch

from rmsnorm_deploy.contract.reference import SpecRMSNorm
from rmsnorm_deploy.kernels.functional import rms_norm


class TritonRMSNorm(SpecRMSNorm):
    """Same parameters and state dict as :class:`SpecRMSNorm`; forward = :func:`rms_norm` (inference only)."""

    @classmethod
    def from_module(cls, module: SpecRMSNorm) -> TritonRMSNorm:
        """A kernel-backed copy of ``module`` (sharing its weight)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.spec = module.spec
        new.normalized_shape = module.normalized_shape
        if module.weight is not None:
            new.weight = module.weight
        else:
            new.register_parameter("weight", None)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.spec, x, self.weight)
