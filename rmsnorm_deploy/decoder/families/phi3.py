"""Phi-3, Phi-3.5-mini, Phi-4-mini: Llama's graph with one fused [q; k; v] and one fused [gate; up]
Linear; LongRoPE's two rotary tables and partial rotary (Phi-4-mini: 96 of 128 dims) come from
``ort_rotary``, the sliding window (Phi-3-mini-4k: 2047) from the base family."""

from __future__ import annotations

from typing import Any

from rmsnorm_deploy.decoder.families.base import Family


class Phi3(Family):
    def recompute_past(self, config: Any) -> int | None:
        # Phi3ForCausalLM.prepare_inputs_for_generation: once the sequence reaches
        # original_max_position_embeddings + 1 with at most that many tokens cached, the cache is
        # dropped and the whole sequence runs again (LongRoPE's long table for every token).
        past = getattr(config, "original_max_position_embeddings", None)
        return int(past) if past is not None and past < config.max_position_embeddings else None


FAMILY = Phi3("phi3", qkv=("qkv_proj",), gate_up=("gate_up_proj",))

REFUSED = {
    "phimoe": "Phi-3.5-MoE normalizes with LayerNorm (mean and bias), not RMSNorm; use --target portable",
    "phi3small": "Phi-3-small normalizes with LayerNorm, not RMSNorm, and its block-sparse attention is remote "
                 "code transformers does not ship",
    "phi": "Phi-1/Phi-2 normalize with LayerNorm, not RMSNorm; use --target portable",
}
