"""The family table: one row per case ``--target onnxruntime`` writes, each a tiny random config
(2 layers, hidden 64, vocabulary 256; ``hf.from_config`` moves every norm gain off its initial
value) that exercises what its family module writes. ``tests/decoder/test_families.py`` holds
every row to transformers; adding a family is its module and a row here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rmsnorm_deploy.exporter.hf import TINY_CONFIGS

_BASE = TINY_CONFIGS["llama"]
#: Special tokens inside the tiny vocabulary, for configs whose defaults lie outside it.
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
#: The sliding window of the windowed rows: the past-window test prompts longer than it.
WINDOW = 8


@dataclasses.dataclass(frozen=True)
class FamilyRow:
    """One tiny model of a family and what its graph must hold."""

    name: str  # the test id
    config: dict[str, Any]
    norms: int  # norm modules of the config, every one our exact node in the graph
    window: int | None = None  # its sliding window: the past-window test prompts past it
    genai: bool = False  # onnxruntime-genai 0.18 runs the folder (it knows the model type)

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])


def _config(model_type: str, **fields: Any) -> dict[str, Any]:
    return {**_BASE, **_TOKENS, "model_type": model_type, **fields}


ROWS: list[FamilyRow] = [
    FamilyRow("llama", _config("llama"), norms=5, genai=True),
    FamilyRow("mistral", _config("mistral", sliding_window=None), norms=5, genai=True),
    FamilyRow("mistral-window", _config("mistral", sliding_window=WINDOW), norms=5, window=WINDOW, genai=True),
    FamilyRow("qwen2", _config("qwen2"), norms=5, genai=True),
    FamilyRow("qwen2-window", _config("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
              norms=5, window=WINDOW, genai=True),
    FamilyRow("qwen3", _config("qwen3", head_dim=16), norms=9, genai=True),
    FamilyRow("olmo2", _config("olmo2"), norms=9),
    FamilyRow("gemma", _config("gemma", head_dim=16), norms=5, genai=True),
    # Weights large enough (initializer_range 0.2) that both caps bend the scores and logits (without
    # the attention cap the logits move by 0.9, without the final one by 8): a cap left out fails.
    # query_pre_attn_scalar 24, not head_dim 16: the attention scale is the module's.
    FamilyRow("gemma2", _config("gemma2", head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "full_attention"], initializer_range=0.2,
                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
              norms=9, window=WINDOW, genai=True),
    FamilyRow("gemma3", _config("gemma3_text", head_dim=16, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "full_attention"]),
              norms=13, window=WINDOW, genai=True),
]
