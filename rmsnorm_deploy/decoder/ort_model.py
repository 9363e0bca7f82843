"""What the ONNX Runtime decoder graph needs from a model, read from its module tree and config.

The dimensions (:class:`DecoderDims`), the LM head its forward uses, where a residual ``Add``
and the norm after it may be one ``SkipSimplifiedLayerNormalization``, and the metadata the graph
carries: each read from the model, never guessed, and a one-line refusal (:class:`OrtDecoderError`)
for anything the writer (``ort_builder``) cannot write exactly. Nothing here needs the weights of the projections: a
module tree whose Linear and Embedding weights are on the meta device (a streamed export,
``streaming``) is read the same way. The rotary tables are ``ort_rotary``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx
import torch
from onnx import helper

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.decoder.convention import (
    ATTENTION_MASK,
    CACHE_KIND,
    CONVENTION,
    INPUT_IDS,
    INPUT_KINDS,
    POSITION_IDS,
)
from rmsnorm_deploy.decoder.families import FAMILIES, Family, family_of
from rmsnorm_deploy.decoder.families import refusal as family_refusal
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.graph.lowerings import refusal

#: The graph's opset: 21 has every op used here (GroupQueryAttention is com.microsoft 1).
OPSET = 21
MS_DOMAIN = "com.microsoft"
TARGET = "onnxruntime"
#: The embedding's output (Gemma's: the scaled one after it): names the builder writes and the
#: layer-by-layer check (``layer_parity``) reads, with :func:`residual_output`.
EMBED_OUTPUT, EMBED_SCALED_OUTPUT = "embed", "embed/scale"


def residual_output(prefix: str, layer: int) -> str:
    """The residual stream after decoder layer ``layer`` (``prefix``: the model's path in the module tree)."""
    return f"{prefix}model.layers.{layer}/mlp/residual"


def embedding_output(model: onnx.ModelProto) -> str:
    """The graph's embedding output: the scaled one where the model scales its embedding."""
    outputs = {o for node in model.graph.node for o in node.output}
    return EMBED_SCALED_OUTPUT if EMBED_SCALED_OUTPUT in outputs else EMBED_OUTPUT


class OrtDecoderError(UserError):
    """A model this builder cannot write exactly, with the reason in one line."""


@dataclasses.dataclass(frozen=True)
class DecoderDims:
    """What the graph needs from the config, each read from the model, never guessed."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    scale: float  # the attention's score scale (module.scaling)
    activation: str = "silu"  # the family's activation field of the config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)




# -- the module tree ----------------------------------------------------------------------
def causal_lm(loaded: LoadedModel) -> torch.nn.Module:
    model = getattr(loaded.module, "model", None)
    config = getattr(model, "config", None)
    if model is None or config is None or not hasattr(model, "get_output_embeddings"):
        raise OrtDecoderError(f"{loaded.name}: --target onnxruntime writes Hugging Face causal LMs "
                              f"({', '.join(sorted(FAMILIES))}); this model is not one")
    return model


def model_family(lm: torch.nn.Module) -> Family:
    """The family of ``lm`` (a transformers ``*ForCausalLM``), or a one-line refusal."""
    config = lm.config
    model_type = str(getattr(config, "model_type", ""))
    family = family_of(config)
    if family is None:
        raise OrtDecoderError(family_refusal(model_type))
    reason = family.refusal(config)
    if reason:
        raise OrtDecoderError(f"{model_type}: {reason}")
    return family


def decoder_dims(lm: torch.nn.Module, family: Family) -> DecoderDims:
    """The dimensions of ``lm``, read from its config and first attention module."""
    config = lm.config
    layers = lm.model.layers
    attn = layers[0].self_attn
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(attn, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads)
    return DecoderDims(
        model_type=family.model_type, layers=len(layers), hidden=int(config.hidden_size), heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, vocab=int(config.vocab_size),
        max_positions=int(config.max_position_embeddings), scale=float(attn.scaling),
        activation=family.activation(config),
    )


def lm_head_of(lm: torch.nn.Module) -> tuple[torch.Tensor, str]:
    """The LM head the model's forward uses (``get_output_embeddings()``): its [vocab, hidden]
    weight and its path. Never chosen by matching a Linear's output size to the vocabulary."""
    head = lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise OrtDecoderError(f"the model's output embedding is a {type(head).__name__}, not a Linear")
    if head.bias is not None:
        raise OrtDecoderError("an LM head with a bias is not written by --target onnxruntime yet")
    path = next((p for p, m in lm.named_modules() if m is head), "lm_head")
    embed = lm.get_input_embeddings()
    if embed is not None and head.weight is embed.weight:
        path = f"{path} (tied to {next(p for p, m in lm.named_modules() if m is embed)})"
    return head.weight, path


#: The op that adds the residual and normalizes in one kernel (ONNX Runtime's CPU and CUDA).
SKIP_NORM_OP = "SkipSimplifiedLayerNormalization"


def skip_refusal(spec: RMSNormSpec, dtype: str) -> str | None:
    """Why ``s = x + skip; norm(s)`` cannot be one ``SkipSimplifiedLayerNormalization`` exactly, or ``None``.

    ONNX Runtime 1.32 never fuses ``Add`` into ``SimplifiedLayerNormalization`` itself (its
    ``SkipLayerNormFusion`` matches ``LayerNormalization`` only), so the graph writes the op; it
    is written where it computes what the ``ort`` lowering of the spec computes after an exact
    ``Add``: float32 activations (the kernel normalizes the float32 sum; in float16 the model
    normalizes the sum rounded to float16 and the kernel does not), the gain a plain weight over
    the last dim, epsilon inside the square root, float32 accumulation.
    """
    reason = refusal("ort", spec, spec.upcasts(dtype), OPSET)
    if reason:
        return reason
    if dtype != "float32":
        return (f"{SKIP_NORM_OP} normalizes the float32 sum of its inputs; a {dtype} model normalizes the sum "
                f"rounded to {dtype}")
    if spec.gain != "weight":
        return f"{SKIP_NORM_OP} multiplies by a weight; this spec's gain is {spec.gain!r}"
    if spec.normalized_dims != 1:
        return f"{SKIP_NORM_OP} normalizes the last dim; this spec normalizes the last {spec.normalized_dims}"
    return None


def skip_norm_node(spec: RMSNormSpec, inputs: list[str], outputs: list[str], *, name: str) -> onnx.NodeProto:
    """``SkipSimplifiedLayerNormalization(input, skip, weight) -> (y, [sum])`` for ``spec``
    (check :func:`skip_refusal` first). ``outputs``: ``[y]`` or ``[y, sum]`` (``sum`` may be "")."""
    y, *rest = outputs
    outs = [y, "", "", rest[0]] if rest and rest[0] else [y]
    return helper.make_node(SKIP_NORM_OP, inputs, outs, name=name, domain=MS_DOMAIN, epsilon=float(spec.epsilon))



def kv_cache_metadata(dims: DecoderDims, dtype: str, *, share_buffer: bool, max_length: int,
                      head: str, rotary_switch: int | None = None, recompute_past: int | None = None) -> dict[str, Any]:
    """The ``kv_cache`` entry of the metadata: the convention's fields (the keys of
    ``decoder.convention.KVCacheLayout``), the target, its buffer mode and the LM head used."""
    return {
        "convention": CONVENTION,
        "target": TARGET,
        "past_present_share_buffer": bool(share_buffer),
        "num_layers": dims.layers,
        "num_heads": dims.heads,
        "kv_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_size": dims.hidden,
        "vocab_size": dims.vocab,
        "max_length": int(max_length),
        "dtype": dtype,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"},
        "lm_head": head,
        # LongRoPE (decoder.convention.KVCacheLayout): written where the model has them
        **({"rotary_switch": int(rotary_switch)} if rotary_switch is not None else {}),
        **({"recompute_past": int(recompute_past)} if recompute_past is not None else {}),
    }


def inputs_metadata(dims: DecoderDims, dtype: str, share_buffer: bool, vocab: int) -> dict[str, dict[str, Any]]:
    cache = "max_length" if share_buffer else "past"
    meta: dict[str, dict[str, Any]] = {
        INPUT_IDS: {"dtype": "int64", "shape": ["batch", "sequence"], "kind": INPUT_KINDS[INPUT_IDS], "high": int(vocab)},
        ATTENTION_MASK: {"dtype": "int64", "shape": ["batch", "total"], "kind": INPUT_KINDS[ATTENTION_MASK]},
        POSITION_IDS: {"dtype": "int64", "shape": ["batch", "sequence"], "kind": INPUT_KINDS[POSITION_IDS]},
    }
    for i in range(dims.layers):
        for kind in ("key", "value"):
            meta[f"past_key_values.{i}.{kind}"] = {"dtype": dtype, "shape": ["batch", dims.kv_heads, cache, dims.head_dim],
                                                   "kind": CACHE_KIND}
    return meta

