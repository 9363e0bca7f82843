"""Ministral: Qwen2's graph; its sliding layers come from ``layer_types`` (the base family)."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("ministral")
