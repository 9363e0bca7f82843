"""The rotary tables of the ONNX Runtime decoder graph: :func:`rotary_tables`.

The cos/sin tables GroupQueryAttention reads, as the model's ``rotary_emb`` computes them, one pair
per table the layers read: the file holds each table's ``inv_freq`` (:func:`rotary_frequencies`) and
the nodes that turn positions into cos/sin, which ONNX Runtime folds into the tables when the
session loads (:func:`_table_nodes`). Partial rotary (Phi-4-mini: 96 of 128
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
from onnx import helper, numpy_helper

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


def rotary_frequencies(lm: torch.nn.Module, dims: DecoderDims, layer_type: str | None = None, *,
                       long: bool = False) -> tuple[np.ndarray, float]:
    """The float32 ``inv_freq`` [rotary_dim / 2] and ``attention_scaling`` the model's ``rotary_emb``
    turns positions with. ``layer_type``: Gemma3's rotary has one ``{layer_type}_inv_freq`` per
    attention type. LongRoPE (:func:`longrope_switch`): the short frequencies, or with ``long`` the
    long ones, each from transformers' own functions (the long ones as ``dynamic_rope_update``
    computes them); its ``inv_freq`` buffer holds whichever the last forward used, so it is not read.
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
    scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
    return inv_freq.detach().float().cpu().numpy(), scaling


def _table_nodes(w: GraphWriter, dims: DecoderDims, base: str, frequencies: list[np.ndarray],
                 scaling: float) -> tuple[str, str]:
    """cos/sin [len(frequencies) * max_positions, rotary_dim / 2]: positions 0..max_positions - 1
    times each ``inv_freq`` (stacked in order), as transformers computes them in float32 (an outer
    product: one rounding, the same as this Mul), times ``attention_scaling``, in the graph dtype.

    Computed by the graph from constants, not stored: ONNX Runtime folds them into one table each
    when the session loads, so a step reads a table as before, while the file holds ``inv_freq``
    alone (Gemma 3 270M: 67 MB of tables for its 32768 positions and two rotary kinds, a quarter of
    its 4-bit file)."""
    def f32(name: str, value: Any) -> str:
        return w.init(f"{base}/{name}", np.asarray(value, dtype=np.float32))

    def scalar(name: str, value: float) -> str:  # Range takes 0-d inputs; initializers here are written 1-d
        return w.one("Constant", [], f"{base}/{name}", value=numpy_helper.from_array(np.array(value, np.float32)))

    positions = w.one("Range", [scalar("start", 0.0), scalar("limit", dims.max_positions), scalar("delta", 1.0)],
                      f"{base}/positions")
    column = w.one("Unsqueeze", [positions, w.init(f"{base}/axes", np.array([1], dtype=np.int64))],
                   f"{base}/position_column")
    angles = [w.one("Mul", [column, f32(f"inv_freq{i}", freqs[None, :])], f"{base}/angles{i}")
              for i, freqs in enumerate(frequencies)]
    angle = angles[0] if len(angles) == 1 else w.one("Concat", angles, f"{base}/angles", axis=0)
    tables = []
    for op in ("Cos", "Sin"):
        table = w.one(op, [angle], f"{base}/{op.lower()}")
        if scaling != 1.0:
            table = w.one("Mul", [table, f32("attention_scaling", scaling)], f"{base}/{op.lower()}_scaled")
        if w.np_dtype != np.float32:
            table = w.one("Cast", [table], f"{base}/{op.lower()}_{w.dtype}", to=helper.np_dtype_to_tensor_dtype(
                w.np_dtype))
        tables.append(table)
    return tables[0], tables[1]


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
        frequencies, scaling = rotary_frequencies(lm, dims, kind)
        switch = longrope_switch(lm, kind)
        if switch is None:
            caches[kind] = _table_nodes(w, dims, f"rotary/cache{tag}", [frequencies], scaling)
            continue
        if switch_of_graph not in (None, switch):
            raise OrtDecoderError(f"LongRoPE tables switch at {switch_of_graph} and {switch}; one switch is written")
        switch_of_graph = switch
        long_frequencies, _ = rotary_frequencies(lm, dims, kind, long=True)
        base = f"rotary/longrope{tag}"

        def i64(name: str, value: int) -> str:
            return w.init(f"{base}/{name}", np.array([value], dtype=np.int64))

        longest = w.one("ReduceMax", [lengths], f"{base}/longest_row", keepdims=1)  # [1]
        is_long = w.one("Greater", [longest, i64("switch", switch)], f"{base}/is_long")
        start = w.one("Where", [is_long, i64("long_start", dims.max_positions), i64("short_start", 0)],
                      f"{base}/start")
        end, axes = w.one("Add", [start, total], f"{base}/end"), i64("axes", 0)
        stacked = _table_nodes(w, dims, f"rotary/cache_short_long{tag}", [frequencies, long_frequencies], scaling)
        caches[kind] = tuple(  # type: ignore[assignment]
            w.one("Slice", [table, start, end, axes], f"{base}/{name}") for name, table in zip(("cos", "sin"), stacked))
    return caches, switch_of_graph
