"""Runners: one signature, ``infer(feed) -> outputs``, for ONNX Runtime and torch (TensorRT's is
``tensorrt.runner``, beside the engine code it needs).

A runner is a context manager (``with OnnxRuntimeRunner(path) as r: r.infer(feed)``), as in
Polygraphy: ``activate`` loads the backend and ``deactivate`` frees it. Backends load lazily,
so a missing optional dependency is a clear error at activation, not at import.

=================  ==========================================================================
base               ``Runner``: the activate/infer/deactivate template every runner follows
onnxruntime        ``OnnxRuntimeRunner``: CPU, CUDA and TensorRT providers, bf16 through IOBinding,
                   never a silent provider fallback
int8_gemm          when a session asks for ONNX Runtime's exact int8 GEMM (CPUs without VNNI)
torch              ``TorchRunner``: a PyTorch module (a rebuilt source) in its dtype or float64
=================  ==========================================================================
"""

from rmsnorm_deploy.runners.base import Runner

__all__ = ["Runner"]
