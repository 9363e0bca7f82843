"""Helium: Llama's graph with GLM's interleaved rotary embedding (adjacent pairs rotated)."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("helium", rotary_interleaved=True)
