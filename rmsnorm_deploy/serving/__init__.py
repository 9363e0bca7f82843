"""Serving exported models: generation with a KV cache.

==========  ====================================================================================
generate    ``KVCacheModel`` and ``generate``: greedy or seeded sampling over a KV-cache graph
            (``export --kv-cache``) in ONNX Runtime, past/present kept in ONNX Runtime's memory
            through IOBinding; timings (prefill ms, decode ms per token, tokens/s)
==========  ====================================================================================
"""
