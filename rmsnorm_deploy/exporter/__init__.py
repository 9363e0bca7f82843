"""From a PyTorch model to an ONNX graph whose every norm is its exact spec.

Model sources (``loaded_model``, ``blocks``, ``presets``, ``hf``, ``hf_files``, ``gguf``, ``rebuild``), norm detection
(``detect``, ``probing``, ``gated``, ``placement``, ``norm_contract``), tracing (``torch_op``, ``surgery``, ``fusions``,
``upcast``) and the export run (``plan``, ``pipeline``, ``parity``, ``routing``). The KV-cache decoder
built on it is ``rmsnorm_deploy.decoder``.

=============  ==============================================================================
plan           ``plan_export``: options, model name and output paths checked once; defaults
pipeline       ``run_export``: detect, run, export, canonicalize, check, save, parity
detect         norms of a module mapped to specs and confirmed bit for bit; ``--norm-spec``
probing        the spec of an unknown norm class, found by running it against every candidate
placement      where each norm stands in the module run eagerly; compared with the graph's
norm_contract  each norm of a graph against the source's: spec field by field, precision, gain
               values, norms dropped or added (``validate --source``)
gated          gated norms of the hybrid families and Gemma3n/Gemma4's norms: known classes,
               the gate input of a confirmation, candidate gated specs for probing
torch_op       the ``torch.library`` op carrying a spec, and its ONNX translation
surgery        swapping submodules, silencing torch.onnx, freeing weights
fusions        rewrite rules for ``--fuse-attention``: opset-23 Attention and RotaryEmbedding
upcast         the float64 run of a model (norms swapped for their oracle)
parity         export-time parity: ONNX Runtime CPU against PyTorch and float64
routing        routing ties: a failed parity of a graph with TopK nodes (MoE routers) checked
               for a top-k choice that went the other way, with PyTorch's routing imposed
loaded_model   ``LoadedModel``: a module with its name, dtype, vocabulary and source
blocks         the pre-norm LLaMA-style block and stack
presets        model presets as TOML (``models/``; ``preset_files/`` ships in the package)
hf             Hugging Face folders (config.json + safetensors), no Hub access; a GGUF file read
               as its converted folder, the metadata recording the file
hf_files       a model folder's files as untrusted input: links kept inside the folder or its
               hub-cache repository, the one JSON reader of side files, config and token checks
gguf           GGUF files (llama.cpp, Ollama): which file MODEL names, its checks, the float32
               Hugging Face folder transformers' GGUF loader converts it into, cached by SHA-256
rebuild        the PyTorch source of an exported model, rebuilt from its metadata
=============  ==============================================================================
"""
