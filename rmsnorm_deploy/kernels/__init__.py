"""Fused RMSNorm kernels derived from the spec (Triton), tested against the torch reference.

``triton_rmsnorm``: the kernel, its launcher and its ahead-of-time compilation (imports
triton). ``functional.rms_norm`` and ``module.TritonRMSNorm``: the torch-facing layers,
which import triton only when called.
"""
