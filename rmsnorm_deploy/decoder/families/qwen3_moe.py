"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with mixture-of-experts MLPs on the layers
``decoder_sparse_step`` picks, except ``mlp_only_layers`` (dense); top-k renormalized where
``norm_topk_prob``."""

from __future__ import annotations

from typing import Any

from rmsnorm_deploy.decoder.families.base import MoEFamily


class Qwen3Moe(MoEFamily):
    def sparse(self, config: Any, layer: int) -> bool:
        # Qwen3MoeDecoderLayer's own rule
        return (layer not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (layer + 1) % config.decoder_sparse_step == 0)

    def normalize_routing(self, config: Any) -> bool:
        return bool(config.norm_topk_prob)


FAMILY = Qwen3Moe("qwen3_moe", qk_norms=("q_norm", "k_norm"),
                  checkpoint_experts=("mlp", "gate_proj", "up_proj", "down_proj"))
