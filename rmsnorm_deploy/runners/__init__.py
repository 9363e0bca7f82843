"""Runners: one signature, ``infer(feed) -> outputs``, for every backend.

A runner is a context manager (``with OnnxRuntimeRunner(path) as r: r.infer(feed)``), as in
Polygraphy: ``activate`` loads the backend and ``deactivate`` frees it. Backends load lazily,
so a missing optional dependency is a clear error at activation, not at import.

=================  ==========================================================================
base               ``Runner``: the activate/infer/deactivate template every runner follows
onnxruntime        ``OnnxRuntimeRunner``: CPU, CUDA and TensorRT providers, bf16 through IOBinding,
                   never a silent provider fallback
tensorrt           ``TensorRTRunner``: a built engine, its sidecar checked before deserializing;
                   ``TensorRTStep``: one step of a KV-cache engine (prefill and decode profiles)
                   for the decode loop, ``generate``
torch              ``TorchRunner``: a PyTorch module (a rebuilt source) in its dtype or float64
kv_decoder         ``decode_loop``: the one decode loop of a KV-cache graph (mask, positions, token
                   choice, end-of-sequence, timings) over a backend's step; ``OrtStep``: ONNX
                   Runtime's step through IOBinding, separate or shared past/present buffers;
                   ``KVDecoderRunner``: greedy decoding in an ONNX Runtime CPU session
transformers_step  ``TransformersStep``: a transformers causal LM with its own cache as the decode
                   loop's step; ``transformers_steps`` (greedy or fed tokens: each step's logits)
                   and ``transformers_generate``: the reference every KV-cache graph is held to
=================  ==========================================================================
"""

from rmsnorm_deploy.runners.base import Runner

__all__ = ["Runner"]
