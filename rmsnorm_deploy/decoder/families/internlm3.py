"""InternLM3: transformers runs it as Llama (``LlamaForCausalLM``; ``qkv_bias``/``bias`` are
Llama's ``attention_bias``/``mlp_bias``, read from the modules)."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("internlm3")
