"""Mistral: Llama's graph; its sliding window (every layer) comes from the base family."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("mistral")
