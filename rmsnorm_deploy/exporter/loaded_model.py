"""A model ready to export: the module, where it came from, and its token-id signature.

Every language model this project exports has one ONNX signature: ``input_ids`` (int64,
``[batch, seq]``) in, ``logits`` (``[batch, seq, vocab]``, the model dtype) out. Presets and
Hugging Face models are wrapped in :class:`TokenLogits` so that the module exported, the
module compared at export time and the module ``sources.rebuild_source`` returns all take the
ONNX inputs as keyword arguments and return a dict keyed by the ONNX output names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

INPUT_NAME = "input_ids"
OUTPUT_NAME = "logits"


class TokenLogits(torch.nn.Module):
    """``forward(input_ids) -> {"logits": model(input_ids)}`` around a model returning logits.

    Module paths under it start with ``model.``, which the wrapped model's own names do not:
    ``module_path_prefix`` says so, and messages name modules without it (``detect.model_path``).
    """

    module_path_prefix = "model."

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {OUTPUT_NAME: self.logits(input_ids)}


@dataclasses.dataclass
class LoadedModel:
    """A model in its export dtype, eval mode, and the facts the pipeline writes about it."""

    name: str  # short name: the default output folder export/<name>/...
    module: TokenLogits
    dtype: str
    source: dict[str, Any]  # metadata.source: enough for sources.rebuild_source
    vocab_size: int
    max_seq_len: int
    description: str = ""
    #: The Hugging Face folder the weights, config and tokenizer files are read from (a GGUF file's
    #: converted folder); None for presets and models built from a config.
    folder: Path | None = None

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())  # parameters() yields tied ones once
