"""Gemma: Llama's graph with ``1 + w`` norm gains (found by detection), GELU (tanh) and the embedding
scaled by sqrt(hidden). :class:`Gemma` holds what Gemma 2 and 3 share with it: the scale."""

from __future__ import annotations

import torch

from rmsnorm_deploy.decoder.families.base import Family, LayerNorms

#: Gemma 2 and 3: a norm on each sublayer's input and on its output (sandwich).
SANDWICH = LayerNorms(attn_in="input_layernorm", attn_out="post_attention_layernorm",
                      mlp_in="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm")


class Gemma(Family):
    def embedding_scale(self, lm: torch.nn.Module) -> torch.Tensor | None:
        # *TextScaledWordEmbedding: sqrt(hidden) is a float32 buffer, rounded to the weight's dtype in
        # forward (bfloat16: 55.4256 -> 55.5), so the graph multiplies by that rounded value.
        embed = lm.get_input_embeddings()
        return embed.embed_scale.detach().to(embed.weight.dtype).reshape(())


FAMILY = Gemma("gemma")
