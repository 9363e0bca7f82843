"""Gemma 2: Gemma's embedding scale, sandwich norms, sliding and full layers alternating
(``layer_types``), a softcap on the attention scores (GroupQueryAttention's ``softcap``) and one on
the logits; the attention's scale is ``query_pre_attn_scalar ** -0.5``, read from the module."""

from __future__ import annotations

from typing import Any

from rmsnorm_deploy.decoder.families.gemma import SANDWICH, Gemma


class SoftcappedGemma(Gemma):
    """Gemma 2 and 3: ``cap * tanh(x / cap)`` on the attention scores and on the logits, where the
    config sets a cap (Gemma 3's are ``None`` by default, but its modeling code applies them)."""

    def attention_softcap(self, config: Any) -> float | None:
        return getattr(config, "attn_logit_softcapping", None)

    def final_softcap(self, config: Any) -> float | None:
        return getattr(config, "final_logit_softcapping", None)


FAMILY = SoftcappedGemma("gemma2", activation_field="hidden_activation", norms=SANDWICH)
