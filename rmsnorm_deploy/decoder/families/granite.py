"""Granite: Llama's graph with four multipliers from the config: the embedding's output times
``embedding_multiplier``, each sublayer's output times ``residual_multiplier`` before the residual
add, the attention scores times ``attention_multiplier`` (the module's ``scaling``, which the graph
reads as every family's), and the logits divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

import torch

from rmsnorm_deploy.decoder.families.base import Family


class Granite(Family):
    def embedding_scale(self, lm: torch.nn.Module) -> torch.Tensor | None:
        # GraniteModel: inputs_embeds * embedding_multiplier, a Python float (float32 math in float16)
        return torch.tensor(float(lm.model.embedding_multiplier), dtype=torch.float32)

    def residual_scale(self, config: Any) -> float | None:
        return float(config.residual_multiplier)

    def logits_divisor(self, config: Any) -> float | None:
        return float(config.logits_scaling)


FAMILY = Granite("granite")
