"""Llama: the graph every other family is written against (pre-norm, q/k/v and gate/up projections apart)."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("llama")
