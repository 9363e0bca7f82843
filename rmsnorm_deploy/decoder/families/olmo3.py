"""OLMo3: OLMo2's graph with sliding layers (``layer_types``) and a rotary table per layer type."""

from rmsnorm_deploy.decoder.families.base import Family, LayerNorms

FAMILY = Family("olmo3", qk_norms=("q_norm", "k_norm"),
                norms=LayerNorms(attn_in=None, attn_out="post_attention_layernorm", mlp_in=None,
                                 mlp_out="post_feedforward_layernorm"))
