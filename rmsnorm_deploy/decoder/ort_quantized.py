"""The quantized weights of the ONNX Runtime decoder graph: :class:`QuantizedWeights`, a part of
``ort_builder.OrtDecoderBuilder``.

Each weight the ``--quantize`` recipe names a width for (``quant_recipes``) is quantized by ONNX
Runtime's quantizers (``quantize``) in blocks of output rows, streamed to the writer's sink, and
multiplied by one ``com.microsoft.MatMulNBits``. A head tied to the embedding and quantized is
quantized once: the packed weight is written [vocab, hidden * bits / 8], the shape
``com.microsoft.GatherBlockQuantized`` looks rows up in, and the head's MatMulNBits reads the same
initializer through a Reshape to its [vocab, hidden / block, block * bits / 8] (ONNX Runtime 1.32's
MatMulNBits takes no other shape, and GatherBlockQuantized wants its scales of the data's rank;
both read the scales [vocab, hidden / block] and the zero points as they are). The lookup is exact
against the dequantized weights (both kernels compute ``(q - zero_point) * scale`` in float32).
A fitted width's block offsets are added after its MatMulNBits: the input's sums over each block
(Reshape, ReduceSum) times the offsets [K / block, N] (MatMul), the input padded to whole blocks
first where K is not a multiple of the block.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from rmsnorm_deploy.decoder.ort_model import EMBED_OUTPUT, MS_DOMAIN
from rmsnorm_deploy.decoder.quant_recipes import Width
from rmsnorm_deploy.decoder.quantize import QuantizedLinear


class QuantizedWeights:
    """MatMulNBits projections and the tied quantized embedding, for ``OrtDecoderBuilder``
    (which holds ``quantization``, ``quantizer``, ``quantized``, ``shared_head``, the writer ``w``)."""

    w: Any
    quantization: Any
    quantizer: Any
    quantized: list[QuantizedLinear]
    shared_head: QuantizedLinear | None
    _lm_paths: dict[int, str] | None = None
    _sums: dict[str, str] | None = None
    lm: Any
    dims: Any
    ids: str
    prefix: str
    _row_blocks: Any
    _path: Any
    _emit: Any
    i64: Any

    def _importance(self, linears: list[torch.nn.Module]) -> np.ndarray | None:
        """The measured mean squared input of these Linears (one input: fused ones share it), if any."""
        table = self.quantization.importance if self.quantization is not None else None
        if not table or not linears:
            return None
        if self._lm_paths is None:
            self._lm_paths = {id(m): p for p, m in self.lm.named_modules()}
        return table.get(self._lm_paths.get(id(linears[0]), ""))

    def _quantized_weight(self, name: str, names: list[str], sizes: list[int], k: int, width: Width, *,
                          flat: bool = False, linears: list[torch.nn.Module] = ()) -> tuple[str, str, str, str]:  # type: ignore[assignment]
        """ONNX Runtime's quantizer on blocks of output rows (independent columns of [K, N]): the
        packed blocks go to the sink as they are made, then the scales, zero points and offsets
        ("" where the width has none). ``flat``: packed as [N, K * bits / 8] (GatherBlockQuantized's
        shape; the same bytes)."""
        assert self.quantizer is not None and self.quantization is not None
        block = self.quantization.block_size
        n, blocks = sum(sizes), -(-k // block)
        scales: list[np.ndarray] = []
        zeros: list[np.ndarray] = []
        offsets: list[np.ndarray] = []

        importance = self._importance(linears)

        def packed_blocks() -> Iterator[np.ndarray]:
            for _, rows in self._row_blocks(names, sizes, k):
                got = self.quantizer(self.w.cast_transposed(rows), width, importance)
                scales.append(got.scales)
                if got.zero_points is not None:
                    zeros.append(got.zero_points)
                if got.offsets is not None:
                    offsets.append(got.offsets)
                yield got.packed.reshape(len(got.packed), -1) if flat else got.packed

        blob = block * width.bits // 8
        shape = (n, blocks * blob) if flat else (n, blocks, blob)
        packed = self.w.blocks(f"{name}_Q{width.bits}", shape, np.uint8, packed_blocks())
        scale = self.w.blocks(f"{name}_scales", (n, blocks), self.w.np_dtype, scales)
        zero = self.w.blocks(f"{name}_zero_points", (n, zeros[0].shape[1]), np.uint8, zeros) if zeros else ""
        offset = (self.w.init(f"{name}_offsets", np.ascontiguousarray(np.concatenate(offsets).T, self.w.np_dtype))
                  if offsets else "")
        return packed, scale, zero, offset

    def _matmul_nbits(self, name: str, x: str, linears: list[torch.nn.Linear], names: list[str], base: str,
                      out: str | None, width: Width) -> str:
        """One MatMulNBits; the LM head tied to a quantized embedding reads the embedding's packed
        weight, viewed [N, K/block, block*bits/8] by a Reshape (MatMulNBits takes no other shape;
        ONNX Runtime folds the Reshape of a constant when it loads the graph)."""
        assert self.quantization is not None
        k, sizes = int(linears[0].in_features), [int(lin.out_features) for lin in linears]
        n, block = sum(sizes), self.quantization.block_size
        shared = self.shared_head
        if shared is not None and [self._path(lin) for lin in linears] == [shared.parts[0][0]]:
            shape = self.i64(f"{name}_shape", [n, -(-k // block), block * width.bits // 8])
            packed = self.w.one("Reshape", [shared.packed, shape], f"{base}/packed_view")
            self.quantized.append(shared)
            inputs = [x, packed, shared.scales] + ([shared.zero_points] if shared.zero_points else [])
            return self._emit("MatMulNBits", inputs, base, out, **self.quantization.node_attributes(k, n, width.bits))
        packed, scale, zero, offsets = self._quantized_weight(name, names, sizes, k, width, linears=linears)
        self.quantized.append(QuantizedLinear(packed, scale, k, n, tuple(
            (self._path(lin), size) for lin, size in zip(linears, sizes)), width, zero, offsets=offsets))
        attrs = self.quantization.node_attributes(k, n, width.bits)
        if not offsets:
            return self._emit("MatMulNBits", [x, packed, scale] + ([zero] if zero else []), base, out, **attrs)
        grid = self._emit("MatMulNBits", [x, packed, scale], base, None, **attrs)
        added = self.w.one("MatMul", [self._block_sums(x, k, base), offsets], f"{base}/offsets")
        return self._emit("Add", [grid, added], base, out)

    def _block_sums(self, x: str, k: int, base: str) -> str:
        """``x``'s sums over each block of K (padded with zeros to whole blocks), made once per input:
        projections reading the same input (gate and up) share them."""
        if self._sums is None:
            self._sums = {}
        if x not in self._sums:
            block = self.quantization.block_size
            blocks = -(-k // block)
            if blocks * block != k:
                x_padded = self.w.one("Pad", [x, self.i64(f"{base}/pad", [0, 0, 0, 0, 0, blocks * block - k])],
                                      f"{base}/pad")
            else:
                x_padded = x
            split = self.w.one("Reshape", [x_padded, self.i64(f"{base}/blocks", [0, 0, blocks, block])],
                               f"{base}/blocks")
            self._sums[x] = self.w.one("ReduceSum", [split, self.i64(f"{base}/last", [-1])], f"{base}/block_sums",
                                       keepdims=0)
        return self._sums[x]

    def _tied_head_width(self, embed: torch.nn.Module) -> Width | None:
        """The head's width when the head is the embedding's weight and quantized, and the lookup
        can read the head's packing (GatherBlockQuantized needs whole blocks along the hidden size,
        and no block offsets: those are added after a MatMul); else None: the embedding is written in the
        graph's dtype."""
        head = self.lm.get_output_embeddings()
        if self.quantization is None or getattr(head, "weight", None) is not embed.weight:
            return None
        width = self.quantization.width("head", self.dims.layers, self.dims.layers)
        if width is None or int(embed.weight.shape[1]) % self.quantization.block_size or width.offsets:
            return None
        return width

    def _quantized_lookup(self, embed: torch.nn.Module, name: str, width: Width) -> str:
        """The embedding quantized once at the head's width, looked up by GatherBlockQuantized;
        the head (``_matmul_nbits``) reads the same packed weight."""
        vocab, hidden = (int(d) for d in embed.weight.shape)
        packed, scales, zero, _ = self._quantized_weight(f"{self.prefix}model.embed_tokens.weight", [name], [vocab],
                                                      hidden, width, flat=True)
        head = self.lm.get_output_embeddings()
        self.shared_head = QuantizedLinear(packed, scales, hidden, vocab, ((self._path(head), vocab),), width, zero,
                                           self._path(embed))
        return self.w.one("GatherBlockQuantized", [packed, self.ids, scales] + ([zero] if zero else []), EMBED_OUTPUT,
                          domain=MS_DOMAIN, gather_axis=0, quantize_axis=1, block_size=self.quantization.block_size,
                          bits=width.bits)
