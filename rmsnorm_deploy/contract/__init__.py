"""The numerics contract: what an RMSNorm computes, and how close a run must come to it.

===========  ================================================================================
spec         ``RMSNormSpec``: epsilon and its placement, normalized dims, gain, rounding order,
             accumulation dtype, an optional gate and groups; named specs (llama, gemma, torch,
             ..., the gated ones apart) and ``parse_spec``
formula      the formula, written once against a small ops protocol
reference    the formula evaluated in torch (``reference``, bit-equal to the modules) and in
             float64 (``oracle``)
tolerances   the one tolerance table, keyed by (check, backend, dtype), each with its reason
compare      ``compare()``: max/mean/p99 abs and rel error, ULPs, NaN/Inf mismatches
dtypes       dtype names and conversions between numpy, torch and ONNX
inputs       seeded activations, stress values, gains and token ids
===========  ================================================================================
"""
