"""Gemma 3: sandwich norms with ``1 + w`` gains, per-head q/k norms, GELU (tanh), the embedding
scaled by sqrt(hidden), and a rotary table per attention type (local layers: ``rope_local_base_freq``)."""

from __future__ import annotations

import torch

from rmsnorm_deploy.decoder.families.base import Family, LayerNorms


class Gemma3(Family):
    def embedding_scale(self, lm: torch.nn.Module) -> torch.Tensor | None:
        # Gemma3TextScaledWordEmbedding: the scale is a buffer, rounded to the weight's dtype in forward.
        embed = lm.get_input_embeddings()
        return embed.embed_scale.detach().to(embed.weight.dtype).reshape(())


FAMILY = Gemma3("gemma3_text", qk_norms=("q_norm", "k_norm"), activation_field="hidden_activation",
                norms=LayerNorms(attn_in="input_layernorm", attn_out="post_attention_layernorm",
                                 mlp_in="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm"))
