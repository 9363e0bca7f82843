"""Small synthetic GGUF files for the tests: a random transformers model written the way llama.cpp does.

:func:`write_gguf` takes a random causal LM of the Llama, Qwen2, Qwen3 or Gemma 3 architectures and
undoes what transformers' GGUF loader (``modeling_gguf_pytorch_utils``, ``integrations/ggml.py``)
does on the way in: tensors get their GGUF names (``gguf``'s own tensor-name map, the one the loader
inverts), Llama's q/k projections get llama.cpp's rotary permutation, Gemma's norms are stored as
``1 + w``, and the config is written as the GGUF keys the loader reads. A byte-level BPE tokenizer
(256 byte tokens, two merges, BOS/EOS) and a chat template go into the metadata, so AutoTokenizer
loads from the file. Projections are stored quantized (``gguf.quants.quantize``) or in F32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

#: transformers ``model_type`` -> GGUF ``general.architecture``
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
MERGES = ["Ġ t", "h e"]
SPECIALS = ["<|bos|>", "<|eos|>"]
#: 256 byte tokens, the merged ones, the special ones
VOCAB = 256 + len(MERGES) + len(SPECIALS)
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def tiny_config(model_type: str) -> dict[str, Any]:
    """A tiny config of ``model_type`` (2 layers, hidden 64) whose vocabulary is the test tokenizer's."""
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                  bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1, model_type=model_type)
    if model_type == "qwen3":
        config["head_dim"] = 128  # the loader reads no key_length for qwen3: Qwen3Config's default it is
    if model_type == "gemma3_text":
        config["head_dim"] = 16
    if model_type == "gemma3_text":
        config.update(sliding_window=8, tie_word_embeddings=True)
    if model_type == "llama":
        config["tie_word_embeddings"] = False
    return config


def random_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A random float32 causal LM of ``tiny_config(model_type)``, norm gains moved off 1 (or 0)."""
    import transformers

    data = tiny_config(model_type)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
    return model


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


def _llama_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of a q/k projection (the loader's ``_reverse_permute_weights`` undoes it)."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(model: torch.nn.Module, path: Path, *, quantized: str | None = "Q8_0",
               tensor_override: dict[str, np.ndarray] | None = None, architecture: str | None = None) -> Path:
    """``model`` as a GGUF file at ``path``: norms and embeddings in F32, the projections in ``quantized``
    (a ``GGMLQuantizationType`` name; None: F32). ``tensor_override``: GGUF names -> arrays written
    instead (F64 and the like, for the refusals); ``architecture``: a different ``general.architecture``."""
    import gguf

    config = model.config
    arch = GGUF_ARCH[config.model_type]
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    writer.add_name(path.stem)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))  # Gemma 3: one per layer type
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config.sliding_window)

    merged = [m.replace(" ", "") for m in MERGES]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([*_byte_tokens(), *merged, *SPECIALS])
    writer.add_token_types([1] * (256 + len(merged)) + [3] * len(SPECIALS))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        weights = tensor.detach().to(torch.float32).numpy().copy()
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            weights = _llama_permute(weights, config.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            weights = _llama_permute(weights, config.num_key_value_heads)
        if arch == "gemma3" and "norm.weight" in hf_name:
            weights = weights + 1.0  # llama.cpp stores Gemma's 1 + w
        if tensor_override and gguf_name in tensor_override:
            writer.add_tensor(gguf_name, tensor_override[gguf_name])
        elif quantized and weights.ndim == 2 and "_proj." in hf_name:
            qtype = gguf.GGMLQuantizationType[quantized]
            writer.add_tensor(gguf_name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
