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
    #: the q/k norms apply to the rotated q and k (HunYuan), not before the rotary embedding (Qwen3):
    #: the graph then rotates outside GroupQueryAttention, whose own rotary comes after its inputs
    qk_norms_after_rotary: bool = False
    #: the rotary embedding rotates adjacent pairs (GLM's ``rotate_half``: Ernie 4.5), not the two halves
    rotary_interleaved: bool = False
    #: ``self_attn``'s per-head attention sink logits (gpt-oss: a learned extra column of each head's
    #: softmax, dropped after it), GroupQueryAttention's ``head_sink``; or ``None``
    sinks: str | None = None
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

    def recompute_past(self, config: Any) -> int | None:
        """The cache length past which transformers' ``generate`` drops its cache once and runs the
        whole sequence again (Phi-3's ``prepare_inputs_for_generation``), or ``None``."""
        return None

    # -- scales and caps ------------------------------------------------------------------------
    def embedding_scale(self, lm: torch.nn.Module) -> torch.Tensor | None:
        """The factor the embedding's output is multiplied by, or ``None``: a 0-d tensor in the dtype the
        model multiplies in (Gemma: a buffer in the weight's dtype; Granite: a Python float, which torch
        applies in float32 to a float16 tensor, rounding once)."""
        return None

    def residual_scale(self, config: Any) -> float | None:
        """The factor each sublayer's output is multiplied by before the residual add (Granite), or ``None``
        (a Python float: applied in float32, as torch applies it to a float16 tensor)."""
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
    def make_mlp(self, b: Any, i: int, layer: torch.nn.Module, x: str, base: str) -> str:
        """Layer ``i``'s MLP on ``x`` written by ``b`` (the ``ort_builder.OrtDecoderBuilder``, which calls
        this with itself): the dense gated MLP, ``down(act(gate(x)) * up(x))``."""
        return b.make_dense_mlp(layer.mlp, x, base)


@dataclasses.dataclass(frozen=True)
class MoEFamily(Family):
    """A family whose MLPs are (some or all) mixtures of experts, as transformers 5 stores them: a
    router (a ``weight`` [experts, hidden], maybe a ``bias``) and the experts' fused 3-D parameters
    ``gate_up_proj`` / ``down_proj`` (``*_bias`` where ``expert_bias``). Every routing written here is
    ``softmax(logits)``, the top ``k``, renormalized over them where :meth:`normalize_routing` says:
    ``com.microsoft.MoE``'s own (``ort_moe``); top-k of the logits then a softmax over them (gpt-oss)
    is the same numbers, the softmax's denominator taken over k values instead of all."""

    #: the MoE block's router and experts (attributes of ``layer.mlp``)
    router: str = "gate"
    experts: str = "experts"
    #: ``gate_up_proj`` [E, hidden, 2I] and ``down_proj`` [E, I, hidden] (gpt-oss), not [E, 2I, hidden], [E, hidden, I]
    experts_transposed: bool = False
    #: ``gate_up_proj``'s 2I outputs alternate gate and up (gpt-oss), not all gates then all ups
    gate_up_interleaved: bool = False
    expert_bias: bool = False
    #: how checkpoints store the experts apart (``weights.SafetensorsTensors`` fuses them on read):
    #: ``(block, gate, up, down)`` in ``{layer}.{block}.experts.{e}.{gate}.weight``; ``None``: stored fused
    checkpoint_experts: tuple[str, str, str, str] | None = None

    def sparse(self, config: Any, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts (else the dense MLP)."""
        return True

    def top_k(self, config: Any) -> int:
        return int(config.num_experts_per_tok)

    def normalize_routing(self, config: Any) -> bool:
        """Whether the top-k routing weights are divided by their sum (Mixtral: always)."""
        return True

    def swiglu(self, config: Any) -> tuple[float, float, float | None]:
        """``(alpha, beta, limit)`` of the experts' ``G * sigmoid(alpha * G) * (L + beta)`` with ``G``, ``L``
        the gate and up clamped to ``limit`` (``None``: no clamp); SiLU-gated experts are ``(1, 0, None)``."""
        return 1.0, 0.0, None

    def refusal(self, config: Any) -> str | None:
        if self.swiglu(config) == (1.0, 0.0, None) and self.activation(config) != "silu":
            return f"experts with activation {self.activation(config)!r} are not written (MoE's SwiGLU is SiLU-gated)"
        return super().refusal(config)

    def make_mlp(self, b: Any, i: int, layer: torch.nn.Module, x: str, base: str) -> str:
        if self.sparse(b.lm.config, i):
            return b.make_moe_mlp(layer.mlp, x, base)
        return super().make_mlp(b, i, layer, x, base)
