"""ONNX graphs: the RMSNorm function, its lowerings, our metadata, model files and the audit.

===========  ================================================================================
function     the ``rmsnorm_deploy::RMSNorm`` node and its FunctionProto overloads, traced from
             the contract's formula
lowerings    how a norm node is written: function, plugin, inline, native, ort; ``refusal()``
standalone   ``rmsnorm_model``: a one-norm model for parity sweeps and benchmarks
metadata     ``ModelMetadata``: spec, lowering, dtype, source and dims stored in the model
onnx_file    ``load_onnx``/``save_onnx``: safe reads (external data kept in its folder) and
             atomic writes with the user's umask, weights streamed in one tensor at a time; a
             model and its report staged and published together under a folder lock
audit        every normalization reduction of any graph and the dtype it accumulates in: the
             pattern matchers (fused ops, our nodes, decomposed chains)
reductions   what the audit finds: ``Reduction``, ``NormTensors``, low-precision and broken ones
onnx_reading a graph as the audit reads it: functions inlined, dtypes and ranks, constants, attributes
quantized    every MatMul with constant weights and how they are held: a float dtype, or
             MatMulNBits' bits, block size and accuracy level (the dtype it computes in)
placement    where each norm stands (pre, post, sublayer_output, qk, final, other): the rules
             on an op graph, its ONNX side; a LayerNorm standing for an RMSNorm
===========  ================================================================================
"""
