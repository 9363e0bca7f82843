"""The KV-cache decoder: one graph for prefill and decode, its files, and the loop that runs it.

From ``export MODEL --kv-cache`` to ``generate``, in the order the data flows:

==================  ===========================================================================
convention          the KV-cache I/O convention (names, shapes, dtypes, ``CONVENTION``), the graph
                    targets, ``KVCacheLayout`` in the metadata and its checks
export              ``DecoderOptions`` and ``plan_decoder_export``: which graph, checked once;
                    ``run_decoder_export`` / ``export_decoder`` write it
kv_model            ``KVCacheLM``: a causal LM over the flat past/present tensors (what the portable
                    graph traces, and a KV-cache graph's rebuilt source)
portable            ``KVExport``: the portable graph through the norm export pipeline (feeds, export
                    call, metadata, serving files)
ort_graph           ``--target onnxruntime``: the graph (fused QKV, GroupQueryAttention, exact norm
                    nodes, optionally int8/int4 MatMulNBits) and ``build_decoder``, its entry point
families            one module per model family that graph writes (projection names, norm places,
                    windows, rotary tables, softcaps, multipliers, MoE), found by the package
ort_model           what that graph needs from a model: dimensions, LM head, refusals,
                    its metadata; read from the module tree, never from the projections' weights
ort_builder         ``OrtDecoderBuilder``: the graph written part by part (``make_embedding``,
                    ``make_attention``, ``make_mlp``, ``make_norm``, ``make_lm_head`` ...)
ort_moe             a mixture-of-experts MLP: the router's MatMul and one ``com.microsoft.MoE`` (``QMoE``
                    when quantized), what their CPU kernels compute and where they are exact
ort_rotary          the rotary tables GroupQueryAttention reads: partial rotary, LongRoPE's two tables and
                    the run's rows sliced from the one its switch picks
ort_quantized       the builder's quantized weights: MatMulNBits per the recipe's widths, a per-channel head
                    by MatMulInteger on int8 rows, and a tied quantized head and embedding stored once
ort_writer          ``GraphWriter``: unique names, and the initializers kept in memory or appended to
                    the external-data file block by block (``ExternalData``)
weights             tensor sources the builder reads: the modules, or a checkpoint's safetensors files
                    (sharded, memory-mapped, block by block)
quant_recipes       ``--quantize`` recipes: each weight's width (bits, zero points, quantizer) by its
                    role and layer (int8, int4, int4-mixed: llama.cpp Q4_K_M's layout, ...)
quant_sensitivity   ``--quantize int4-auto``: each projection's 4-bit output error measured on a
                    calibration text, the 8-bit units chosen within a size budget, a head's smoothing
quant_smoothing     ``--quantize int8-smooth``: each projection input's per-feature smoothing, chosen on the
                    calibration set by the 8-bit kernel's output error, before it rounds the input to int8
quantize            ``--quantize``: ONNX Runtime's weight-only quantizers per tensor, what MatMulNBits
                    computes (dequantized weights, int8 activations) and the reference built from it
streaming           a Hugging Face folder opened without its weights (parameters on the meta device,
                    the norms' real gains) for an export whose memory does not grow with the model
ort_parity          the graph's norm audit and its per-step parity with transformers (with the
                    dequantized weights for a quantized graph) and what quantization cost
layer_parity        the parity of a model too large to load whole: each layer alone on the graph's own
                    residual stream, then the final logits, one layer of weights in memory at a time
ort_export          ``export --kv-cache --target onnxruntime``: written streaming, audited, published,
                    checked
genai_config        ``genai_config.json`` and the Hugging Face config and tokenizer files beside a model
loop                ``decode_loop``: the one decode loop (mask, positions, token choice, end of
                    sequence, timings) over a backend's step
ort_step            ``OrtStep``: ONNX Runtime's step through IOBinding (separate or shared cache, or
                    the serving engine's slots); ``KVDecoderRunner``: greedy decoding in a CPU session
speculative         ``Speculator``: speculative decoding inside that loop (prompt lookup or a draft
                    model proposes, one run checks several tokens, the cache rolled back, k adapted)
transformers_step   ``TransformersStep``: transformers with its own cache as the loop's step; the
                    reference every KV-cache graph is held to
generate            ``KVCacheModel`` and ``generate``/``stream``: greedy or seeded sampling over an
                    exported folder, prompts checked against the model, special tokens from its folder,
                    ``SpeculationOptions`` (``generate --speculative``)
perplexity          ``perplexity``: llama-perplexity's scheme (chunks from an empty cache, second half
                    scored, float64 log-softmax) or sliding windows (``--stride``) over token ids, on
                    any KV-cache folder
kv_folders          the KV-cache folders ``perplexity`` reads, told apart by their files: ours
                    (``KVCacheModel``), onnxruntime-genai's builder's and optimum's (``ForeignKVModel``)
divergence          ``divergence``: KL divergence, top-1 agreement and both perplexities of a model
                    against a reference (another export, or transformers) at perplexity's positions;
                    what ``export --quantize`` reports quantization cost on text
genai_client        ``genai_greedy``: onnxruntime-genai's own greedy tokens from an export folder
                    (optional dependency, loaded lazily)
==================  ===========================================================================

TensorRT's step of this loop (``TensorRTStep``) lives with the TensorRT runner (``tensorrt.runner``).
"""
