"""EXAONE 4: OLMo2's sublayer-output norms with per-head q/k norms (before the rotary embedding);
with a sliding window, only the sliding layers rotate (the global layers are NoPE)."""

from __future__ import annotations

from typing import Any

from rmsnorm_deploy.decoder.families.base import Family, LayerNorms


class Exaone4(Family):
    def rotates(self, config: Any, layer: int) -> bool:
        # Exaone4Attention: apply_rotary_pos_emb only when sliding_window is None or the layer slides
        return config.sliding_window is None or config.layer_types[layer] == "sliding_attention"


FAMILY = Exaone4("exaone4", qk_norms=("q_norm", "k_norm"),
                 norms=LayerNorms(attn_in=None, attn_out="post_attention_layernorm", mlp_in=None,
                                  mlp_out="post_feedforward_layernorm"))
