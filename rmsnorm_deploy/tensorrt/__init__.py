"""TensorRT: engines built from our ONNX graphs, their inspection, and the fused RMSNorm plugin.

``tensorrt`` is imported lazily inside each function, so this package imports without it.
"""
