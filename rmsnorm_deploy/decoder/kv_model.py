"""A causal LM as a module over the flat tensors of the KV-cache convention (``kv_cache.py``).

:class:`KVCacheLM` takes the ONNX inputs as keyword arguments (``input_ids``,
``attention_mask``, ``position_ids``, ``past_key_values.{i}.key`` / ``.value``) and returns a
dict keyed by the ONNX outputs (``logits``, ``present.{i}.key`` / ``.value``), so the module
exported, the module compared at export time and its float64 run all speak the graph's names.

For a transformers model it builds a ``DynamicCache`` from the past tensors (each layer
updated once with its past: a cache of length ``past``, 0 allowed), calls the model with
``cache=`` and its ``attention_mask``. The cache is built without the model's config, so every
layer is a full layer: a sliding-window layer (Gemma) would crop its present below
``past + sequence``, and the convention gives every layer the same length; the window itself
is applied by the attention mask, as transformers does for full caches (transformers 5 builds the causal mask with the past
and the left padding from it, under ``torch.export`` too) and reads each layer's keys and
values back as the presents. The preset stack (``blocks.Transformer``) has its own cache path
(``Transformer.forward_cached``).

:class:`PositionalKVCacheLM` is the same module with positional inputs and a list of past
tensors, the form ``torch.onnx.export`` flattens into the ONNX input names.
"""

from __future__ import annotations

from typing import Any

import torch

from rmsnorm_deploy.contract.inputs import token_ids
from rmsnorm_deploy.decoder.convention import (
    ATTENTION_MASK,
    BATCH,
    INPUT_IDS,
    LOGITS,
    PAST,
    POSITION_IDS,
    SEQUENCE,
    TOTAL,
    KVCacheLayout,
    layout_of,
    position_ids_for,
)
from rmsnorm_deploy.errors import UserError


class KVCacheLM(torch.nn.Module):
    """``forward(**feed) -> {logits, present.*}`` around a transformers causal LM or a preset stack."""

    def __init__(self, model: torch.nn.Module, layout: KVCacheLayout):
        super().__init__()
        self.model = model
        self.layout = layout

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if hasattr(self.model, "forward_cached"):  # the preset stack
            return self.model.forward_cached(input_ids, attention_mask, position_ids, past)
        from transformers import DynamicCache

        cache = DynamicCache()  # full layers: a sliding-window layer would crop its present (Gemma)
        for i in range(self.layout.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=True)
        cache = getattr(out, "cache", None) or cache
        presents: list[torch.Tensor] = []
        for layer in cache.layers[: self.layout.num_layers]:
            presents += [layer.keys, layer.values]
        return out.logits, presents

    def forward(self, **feed: torch.Tensor) -> dict[str, torch.Tensor]:
        lay = self.layout
        missing = [n for n in lay.input_names() if n not in feed]
        if missing:
            raise UserError(f"the KV-cache model needs inputs {missing[:3]}")
        logits, presents = self.step(feed[INPUT_IDS], feed[ATTENTION_MASK], feed[POSITION_IDS],
                                     [feed[n] for n in lay.past_names()])
        return {LOGITS: logits, **dict(zip(lay.present_names(), presents))}


class PositionalKVCacheLM(torch.nn.Module):
    """:class:`KVCacheLM` with positional inputs and the past as one list (for ``torch.onnx.export``)."""

    def __init__(self, kv: KVCacheLM):
        super().__init__()
        self.kv = kv

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                past_key_values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        logits, presents = self.kv.step(input_ids, attention_mask, position_ids, list(past_key_values))
        return (logits, *presents)


def export_args(feed: dict[str, torch.Tensor], layout: KVCacheLayout) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The positional example arguments of :class:`PositionalKVCacheLM` and their dynamic shapes."""
    from torch.export import Dim

    batch, seq, past, total = Dim(BATCH), Dim(SEQUENCE), Dim(PAST, min=0), Dim(TOTAL)
    args = (feed[INPUT_IDS], feed[ATTENTION_MASK], feed[POSITION_IDS], [feed[n] for n in layout.past_names()])
    shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
              [{0: batch, 2: past} for _ in layout.past_names()])
    return args, shapes


def example_feed(layout: KVCacheLayout, *, batch: int, sequence: int, past: int, vocab: int, seed: int,
                 dtype: torch.dtype, left_pad: int = 0) -> dict[str, torch.Tensor]:
    """A seeded feed of the convention: token ids, a mask whose first row is left-padded by
    ``left_pad`` slots, positions from the mask, and random past keys and values."""
    import numpy as np


    total = past + sequence
    mask = np.ones((batch, total), dtype=np.int64)
    if left_pad:
        mask[0, : min(left_pad, total - 1)] = 0
    ids = token_ids((batch, sequence), vocab, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    feed = {INPUT_IDS: torch.from_numpy(ids), ATTENTION_MASK: torch.from_numpy(mask),
            POSITION_IDS: torch.from_numpy(position_ids_for(mask, sequence))}
    for name in layout.past_names():
        feed[name] = torch.randn((batch, layout.kv_heads, past, layout.head_dim), generator=gen).to(dtype)
    return feed


def kv_source(module: torch.nn.Module, meta: Any) -> torch.nn.Module:
    """The PyTorch source of a graph: for a KV-cache graph (metadata ``kv_cache``), the rebuilt
    model over the flat past/present tensors of its convention; any other module as it is."""
    if not getattr(meta, "kv_cache", None):
        return module
    return KVCacheLM(module.model, layout_of(meta)).eval()
