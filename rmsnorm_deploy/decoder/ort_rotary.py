"""The rotary tables of the ONNX Runtime decoder graph: :func:`rotary_tables`.

The cos/sin tables GroupQueryAttention reads, exactly as the model's ``rotary_emb`` computes them
(:func:`rotary_caches`), one pair per table the layers read. Partial rotary (Phi-4-mini: 96 of 128
dims) is GroupQueryAttention's narrower table. LongRoPE (Phi-3.5-mini, Phi-4-mini) has a short and a
long table: transformers rotates a forward's tokens with the long one once ``max(position_ids) + 1``
of the batch passes ``original_max_position_embeddings`` (:func:`longrope_switch`), for every row;
the graph decides the same from the longest row's length and slices the run's rows from the tables
stacked [short; long], so a run copies only those rows (an ``If`` returning a whole table copies
all of it: 12 ms a run for a 131072 x 48 float32 table, against 0.3 ms for the 4096 rows of a
4096-token run). What transformers' ``generate`` adds at the switch (Phi-3 runs the whole sequence
again) is the decode loop's (``loop.decode_steps``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rmsnorm_deploy.decoder.ort_model import DecoderDims, OrtDecoderError
from rmsnorm_deploy.decoder.ort_writer import GraphWriter

#: GroupQueryAttention (ONNX Runtime 1.32 CPU) takes cos/sin caches [positions, n] with n a multiple of 8 and
#: at most head_dim / 2, and rotates the first 2n dims of each head (measured exact: the rest pass through).
GQA_ROTARY_MULTIPLE = 16


def _rotary_module(lm: torch.nn.Module, layer_type: str | None) -> tuple[Any, str, str]:
    """The model's ``rotary_emb``, the prefix of its per-type buffers and the table's rope type."""
    rotary = getattr(lm.model, "rotary_emb", None)
    prefix = f"{layer_type}_" if layer_type else ""
    if not isinstance(getattr(rotary, f"{prefix}inv_freq", None), torch.Tensor):
        raise OrtDecoderError(f"the model has no rotary_emb.{prefix}inv_freq; --target onnxruntime writes rotary models")
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type, "default")
    return rotary, prefix, str(rope_type)


def longrope_switch(lm: torch.nn.Module, layer_type: str | None = None) -> int | None:
    """LongRoPE's ``original_max_position_embeddings``, or ``None`` for a table that never changes.

    transformers (``dynamic_rope_update``) rotates every token of a forward with the long
    frequencies when ``max(position_ids) + 1`` of the whole batch exceeds it, else with the short
    ones; tokens already in the cache keep the rotation they were stored with."""
    if _rotary_module(lm, layer_type)[2] != "longrope":
        return None
    params = lm.config.rope_parameters
    return int((params[layer_type] if layer_type else params)["original_max_position_embeddings"])


def rotary_caches(lm: torch.nn.Module, dims: DecoderDims, dtype: np.dtype, layer_type: str | None = None, *,
                  long: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, rotary_dim / 2] exactly as the model's ``rotary_emb`` computes them
    (float32 ``inv_freq`` times positions, times ``attention_scaling``), in the model dtype.
    ``layer_type``: Gemma3's rotary has one ``{layer_type}_inv_freq`` per attention type.
    LongRoPE (:func:`longrope_switch`): the short table, or with ``long`` the long one, each from
    transformers' own functions (the long one as ``dynamic_rope_update`` computes it); its
    ``inv_freq`` buffer holds whichever the last forward used, so it is not read.
    Partial rotary (Phi-4-mini: 96 of 128 dims): the narrower table rotates the first dims only."""
    rotary, prefix, rope_type = _rotary_module(lm, layer_type)
    if rope_type == "dynamic":
        raise OrtDecoderError("dynamic rotary scaling changes with the sequence length; use --target portable")
    if rope_type == "longrope":
        inv_freq = getattr(rotary, f"{prefix}original_inv_freq")
        if long:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            switch = longrope_switch(lm, layer_type)
            inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](lm.config, None, seq_len=switch + 1, layer_type=layer_type)
    elif long:
        raise OrtDecoderError(f"a {rope_type!r} rotary embedding has no long table")
    else:
        inv_freq = getattr(rotary, f"{prefix}inv_freq")
    rotary_dim = inv_freq.numel() * 2
    if rotary_dim > dims.head_dim or (rotary_dim < dims.head_dim and rotary_dim % GQA_ROTARY_MULTIPLE):
        raise OrtDecoderError(f"the rotary embedding turns {rotary_dim} of {dims.head_dim} dims; GroupQueryAttention "
                              f"rotates part of a head only in multiples of {GQA_ROTARY_MULTIPLE} dims "
                              "(use --target portable)")
    positions = torch.arange(dims.max_positions, dtype=torch.float32)
    # transformers: (inv_freq[:, None] @ position_ids[None, :]).T, in float32: an outer product.
    freqs = (inv_freq.float()[:, None] @ positions[None, :]).T
    scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return cos.numpy().astype(dtype), sin.numpy().astype(dtype)


def rotary_tables(w: GraphWriter, lm: torch.nn.Module, dims: DecoderDims, kinds: list[str | None], lengths: str,
                  total: str) -> tuple[dict[str | None, tuple[str, str]], int | None]:
    """The cos/sin inputs of GroupQueryAttention per rotary table in ``kinds`` (a layer's table: its
    layer type where the model keeps one per type, ``None`` for the one table, ``""`` for none), and
    the LongRoPE switch or ``None``. ``lengths``: the rows' lengths [batch] (last position + 1);
    ``total``: the mask's width [1] (every position of the run is below it)."""
    caches: dict[str | None, tuple[str, str]] = {}
    switch_of_graph: int | None = None
    for kind in dict.fromkeys(kinds):
        if kind == "":
            continue
        tag = f"_{kind}" if kind else ""
        cos, sin = rotary_caches(lm, dims, w.np_dtype, kind)
        switch = longrope_switch(lm, kind)
        if switch is None:
            caches[kind] = (w.init(f"cos_cache{tag}", cos), w.init(f"sin_cache{tag}", sin))
            continue
        if switch_of_graph not in (None, switch):
            raise OrtDecoderError(f"LongRoPE tables switch at {switch_of_graph} and {switch}; one switch is written")
        switch_of_graph = switch
        long_cos, long_sin = rotary_caches(lm, dims, w.np_dtype, kind, long=True)
        base = f"rotary/longrope{tag}"

        def i64(name: str, value: int) -> str:
            return w.init(f"{base}/{name}", np.array([value], dtype=np.int64))

        longest = w.one("ReduceMax", [lengths], f"{base}/longest_row", keepdims=1)  # [1]
        is_long = w.one("Greater", [longest, i64("switch", switch)], f"{base}/is_long")
        start = w.one("Where", [is_long, i64("long_start", dims.max_positions), i64("short_start", 0)],
                      f"{base}/start")
        end, axes = w.one("Add", [start, total], f"{base}/end"), i64("axes", 0)
        caches[kind] = tuple(  # type: ignore[assignment]
            w.one("Slice", [w.init(f"{name}_cache_short_long{tag}", np.concatenate([short, long])), start, end, axes],
                  f"{base}/{name}")
            for name, short, long in (("cos", cos, long_cos), ("sin", sin, long_sin)))
    return caches, switch_of_graph
