"""TensorRT: engines built from our ONNX graphs, their inspection, and the fused RMSNorm plugin.

``tensorrt`` is imported lazily inside each function, so this package imports without it.

==========  ===================================================================================
compat      static check (no TensorRT): what a TensorRT version's ONNX parser imports, and fixes
profiles    optimization profiles from the model's dynamic dims, its metadata and ``--profile``;
            prefill and decode profiles for KV-cache graphs
prepare     the graph given to the parser: functions inlined per overload, or mapped to the plugin
precision   which TensorRT layers implement each norm, and the dtype its reduction runs in
sidecar     the JSON beside each engine (TensorRT version, GPU, profile, plugin, hashes)
runner      ``TensorRTRunner``: a built engine, its sidecar checked before deserializing;
            ``TensorRTStep``: one step of a KV-cache engine for ``decoder.loop``
build       ``build_engine``: parse, check, build, inspect, write (the ``build`` command)
runtime     shared TensorRT pieces: logger, plugin loading, dtype names
progress    the build progress bar fed by ``IProgressMonitor``
plugin_loader  ``load_plugin``: the plugin registered with TensorRT (``_qdp`` or a library)
_qdp        the plugin's ``tensorrt.plugin`` registration (imported only with TensorRT)
==========  ===================================================================================
"""
