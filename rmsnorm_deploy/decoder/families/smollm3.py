"""SmolLM3: Llama's graph without the rotary embedding in the layers ``no_rope_layers`` marks 0
(every ``no_rope_layer_interval``-th by default); with ``use_sliding_window``, those layers slide
(``layer_types``, read by the base family)."""

from __future__ import annotations

from typing import Any

from rmsnorm_deploy.decoder.families.base import Family


class SmolLM3(Family):
    def rotates(self, config: Any, layer: int) -> bool:
        return bool(config.no_rope_layers[layer])


FAMILY = SmolLM3("smollm3")
