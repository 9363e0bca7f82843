"""Qwen3: Llama's graph with a per-head RMS norm on q and on k before the rotary embedding."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("qwen3", qk_norms=("q_norm", "k_norm"))
