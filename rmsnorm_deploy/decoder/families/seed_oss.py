"""Seed-OSS: Llama's graph; q/k/v biases (``attention_bias``) and the output projection's own
(``attention_out_bias``) are read from the modules."""

from rmsnorm_deploy.decoder.families.base import Family

FAMILY = Family("seed_oss")
