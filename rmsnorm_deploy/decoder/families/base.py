"""What the ONNX Runtime decoder writer knows of one model family: :class:`Family`.

A family is a record of its architecture's facts (the names of its projections, fused or not;
which norms sit where in a layer; its q/k norms) plus the methods the writer (``ort_builder``)
calls where checkpoints of a family differ by their config (sliding windows, rotary tables,
softcaps, multipliers) or where its graph is not the Llama family's (a mixture-of-experts MLP).
The writer never asks the module tree what a model is: it asks its family.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

#: Activation names (the config's ``activation_field``) the dense MLP is written for.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class LayerNorms:
    """A decoder layer's norms by place (attribute names on the layer; ``None``: no norm there).

    Llama: ``h + attn(attn_in(h))``, then ``h + mlp(mlp_in(h))``. Gemma 2/3 add ``attn_out`` and
    ``mlp_out`` on each sublayer's output (sandwich); OLMo2 has only those two (``h + norm(f(h))``).
    """

    attn_in: str | None = "input_layernorm"
    attn_out: str | None = None
    mlp_in: str | None = "post_attention_layernorm"
    mlp_out: str | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    """One transformers ``model_type`` as the ONNX Runtime graph writes it (module docstring)."""

    model_type: str
    #: ``self_attn``'s projections: three Linears, or one fused [q; k; v] Linear (Phi-3)
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    o_proj: str = "o_proj"
    #: ``self_attn``'s q/k norms (Qwen3: per head; OLMo2: over all heads), or ``None``
    qk_norms: tuple[str, str] | None = None
    #: ``mlp``'s gate and up projections: two Linears, or one fused [gate; up] Linear (Phi-3)
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    down: str = "down_proj"
    #: the config field naming the MLP's activation
    activation_field: str = "hidden_act"
    norms: LayerNorms = LayerNorms()
    #: the final norm on ``lm.model``
    final_norm: str = "norm"

    # -- checks ---------------------------------------------------------------------------------
    def refusal(self, config: Any) -> str | None:
        """Why a checkpoint of this family cannot be written exactly, or ``None``. The base refuses
        what no hook of this family writes: an unknown activation, softcaps, bidirectional attention."""
        act = self.activation(config)
        if act not in ACTIVATIONS:
            return f"activation {act!r} is not written by --target onnxruntime (it writes {', '.join(ACTIVATIONS)})"
        for field, value in (("attn_logit_softcapping", self.attention_softcap(config)),
                             ("final_logit_softcapping", self.final_softcap(config))):
            if value is None and getattr(config, field, None) is not None:
                return f"{field} ({getattr(config, field)}) is not written for {self.model_type} models"
        if getattr(config, "use_bidirectional_attention", False):
            return "bidirectional attention is not a causal decoder; use --target portable"
        return None

    def activation(self, config: Any) -> str:
        return str(getattr(config, self.activation_field, None))

    # -- per layer ------------------------------------------------------------------------------
    def window(self, config: Any, layer: int) -> int | None:
        """How many tokens layer ``layer`` attends to, itself included (transformers' sliding window),
        or ``None`` for every token: ``config.layer_types`` says which layers slide where it exists,
        else every layer slides when ``sliding_window`` is set (Mistral)."""
        size = getattr(config, "sliding_window", None)
        if size is None or not getattr(config, "use_sliding_window", True):
            return None
        types = getattr(config, "layer_types", None)
        if types is not None and types[layer] != "sliding_attention":
            return None
        return None if size >= config.max_position_embeddings else int(size)

    def rotary_kind(self, lm: torch.nn.Module, layer: int) -> str | None:
        """The rotary table layer ``layer`` reads: its layer type where ``rotary_emb`` keeps one
        ``{type}_inv_freq`` per type (Gemma 3), else ``None`` (one table)."""
        types = getattr(lm.config, "layer_types", None)
        rotary = getattr(lm.model, "rotary_emb", None)
        if types is None or not isinstance(getattr(rotary, f"{types[layer]}_inv_freq", None), torch.Tensor):
            return None
        return str(types[layer])

    def rotates(self, config: Any, layer: int) -> bool:
        """Whether layer ``layer`` rotates q and k (SmolLM3 leaves some layers without RoPE)."""
        return True

    # -- scales and caps ------------------------------------------------------------------------
    def embedding_scale(self, lm: torch.nn.Module) -> torch.Tensor | None:
        """The factor the embedding's output is multiplied by (a 0-d tensor in the weight's dtype), or ``None``."""
        return None

    def residual_scale(self, config: Any) -> float | None:
        """The factor each sublayer's output is multiplied by before the residual add (Granite), or ``None``."""
        return None

    def logits_divisor(self, config: Any) -> float | None:
        """What the LM head's output is divided by (Granite's ``logits_scaling``), or ``None``."""
        return None

    def attention_softcap(self, config: Any) -> float | None:
        """``cap * tanh(score / cap)`` on the attention scores (Gemma 2), or ``None``. GroupQueryAttention's
        ``softcap`` caps the scores after its ``scale``, where transformers caps them (measured exact on
        ONNX Runtime 1.32 CPU: the gemma2 row of the family table)."""
        return None

    def final_softcap(self, config: Any) -> float | None:
        """``cap * tanh(logits / cap)`` on the logits (Gemma 2), or ``None``."""
        return None

    # -- graph parts ----------------------------------------------------------------------------
    def make_mlp(self, b: Any, layer: torch.nn.Module, x: str, base: str) -> str:
        """The layer's MLP on ``x`` written by ``b`` (the ``ort_builder.OrtDecoderBuilder``, which calls
        this with itself): the dense gated MLP, ``down(act(gate(x)) * up(x))``."""
        return b.make_dense_mlp(layer.mlp, x, base)
