"""Ernie 4.5: Llama's graph with GLM's interleaved rotary embedding (adjacent pairs rotated, the
rotation in float32) and, with ``use_bias``, biases on every projection (read from the modules)."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("ernie4_5", rotary_interleaved=True)
