"""HunYuan dense: Llama's graph with per-head q/k norms (``query_layernorm``, ``key_layernorm``)
applied to q and k after the rotary embedding, so the graph rotates them before the norms and
GroupQueryAttention does not rotate; its ``ntk_alpha`` rotary is a static table."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("hunyuan_v1_dense", qk_norms=("query_layernorm", "key_layernorm"), qk_norms_after_rotary=True)
