"""Mixtral: Mistral's attention (its sliding window, every layer, from the base family) and a
mixture of SiLU-gated experts in every layer, the top-k routing weights renormalized."""

from rmsnorm_deploy.decoder.families.base import MoEFamily

FAMILY = MoEFamily("mixtral", checkpoint_experts=("block_sparse_moe", "w1", "w3", "w2"))
