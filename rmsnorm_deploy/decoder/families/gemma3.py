"""Gemma 3: Gemma 2's graph (sandwich norms, softcaps where set) with per-head q/k norms and a rotary
table per attention type (local layers: ``rope_local_base_freq``, from the base family)."""

from rmsnorm_deploy.decoder.families.gemma import SANDWICH
from rmsnorm_deploy.decoder.families.gemma2 import SoftcappedGemma

FAMILY = SoftcappedGemma("gemma3_text", qk_norms=("q_norm", "k_norm"), activation_field="hidden_activation",
                         norms=SANDWICH)
