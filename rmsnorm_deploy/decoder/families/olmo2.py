"""OLMo2: each norm on its sublayer's output (``h + norm(f(h))``), q/k norms over all heads."""

from rmsnorm_deploy.decoder.families.base import Family, LayerNorms

FAMILY = Family("olmo2", qk_norms=("q_norm", "k_norm"),
                norms=LayerNorms(attn_in=None, attn_out="post_attention_layernorm", mlp_in=None,
                                 mlp_out="post_feedforward_layernorm"))
