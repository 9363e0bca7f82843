"""Qwen2: Llama's graph with q/k/v biases (read from the modules); sliding layers from ``layer_types``."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("qwen2")
