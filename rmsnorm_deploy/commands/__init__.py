"""One module per ``rmsnorm-deploy`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``.

===========  ==================================================================================
export       a preset or Hugging Face folder to ONNX, with parity (``exporter.plan`` checks first)
validate     a model on each backend against its source or float64 oracle
audit        every norm reduction, its dtype and placement, as written and after ONNX Runtime
parity       the standalone model of each lowering in ONNX Runtime CPU
build        a strongly typed TensorRT engine
check_trt    what a TensorRT version's parser imports, without TensorRT
generate     tokens from a KV-cache model (``serving.generate``), with its timings
serve        Triton Inference Server (embedded through PyTriton) in front of ONNX Runtime
triton_repo  a model repository for the standalone Triton Inference Server
env          versions, GPU, providers, TensorRT and the plugin
===========  ==================================================================================
"""
