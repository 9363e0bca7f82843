"""Model types near the families written here that ``--target onnxruntime`` refuses, each with why:
layers whose state is not a KV cache, or code that is not in transformers (the exporter never runs
a checkpoint's own code). Their norms may be RMS; their graphs are not the Llama family's."""

_LINEAR_ATTENTION = ("its linear-attention (Gated DeltaNet) layers keep a recurrent state, not a KV cache; "
                     "use --target portable")
_SHORT_CONVOLUTION = ("its short-convolution layers keep a convolution state, not a KV cache; "
                      "use --target portable")
_REMOTE_CODE = "its modeling code is not in transformers (remote code, which the exporter never runs)"

REFUSED = {
    "lfm2": _SHORT_CONVOLUTION,
    "lfm2_moe": _SHORT_CONVOLUTION,
    "qwen3_next": _LINEAR_ATTENTION,
    "qwen3_5": _LINEAR_ATTENTION,
    "qwen3_5_text": _LINEAR_ATTENTION,
    "qwen3_5_moe": _LINEAR_ATTENTION,
    "qwen3_5_moe_text": _LINEAR_ATTENTION,
    "internlm2": _REMOTE_CODE,
    "chatglm": _REMOTE_CODE,
}
