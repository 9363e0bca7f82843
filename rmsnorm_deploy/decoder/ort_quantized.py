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

A projection whose input the recipe smooths (``int8-smooth``: ``quant_smoothing``) reads its input times
the smoothing factor [K] (one Mul per input, shared by the projections that read it), and its weight's
input rows are divided by the factor (as the graph stores it) before they are quantized.

A per-channel width (``Width.per_channel``) is int8 rows [N, K] with a scale per row and a smoothing
factor per input feature, multiplied by ``MatMulInteger`` on the input rounded to int8 per row
(``quantize.channel_head`` is the same arithmetic, node for node); the rows are stored as the lookup
reads them, and the MatMul reads them through a Transpose that ONNX Runtime folds into a constant
when the session loads. The lookup is Gather, Cast, times the row's scale, times the smoothing.
ONNX Runtime's int8 GEMM runs u8 x s8 products, which saturate in int16 on x86-64 CPUs without
VNNI unless the session sets ``session.x64quantprecision`` (our sessions do on such CPUs:
``runners.int8_gemm``).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from onnx import TensorProto

from rmsnorm_deploy.contract.dtypes import onnx_type
from rmsnorm_deploy.decoder.ort_model import EMBED_OUTPUT, MS_DOMAIN
from rmsnorm_deploy.decoder.quant_recipes import Width
from rmsnorm_deploy.decoder.quantize import CHANNEL_INVERSE_127, CHANNEL_TINY, QuantizedLinear, quantize_channel


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
    _smoothed: dict[str, tuple[str, str, np.ndarray]] | None = None
    _float32_inputs: dict[str, str] | None = None
    lm: Any
    dims: Any
    ids: str
    prefix: str
    _row_blocks: Any
    _path: Any
    _emit: Any
    i64: Any

    def _lm_path(self, module: torch.nn.Module) -> str:
        """``module``'s path in the causal LM (the keys of the measured tables)."""
        if self._lm_paths is None:
            self._lm_paths = {id(m): p for p, m in self.lm.named_modules()}
        return self._lm_paths.get(id(module), "")

    def _importance(self, linears: list[torch.nn.Module]) -> np.ndarray | None:
        """The measured mean squared input of these Linears (one input: fused ones share it), if any."""
        table = self.quantization.importance if self.quantization is not None else None
        if not table or not linears:
            return None
        return table.get(self._lm_path(linears[0]))

    def _measured_smoothing(self, linears: list[torch.nn.Module], k: int) -> np.ndarray | None:
        """The measured smoothing [K] of these Linears' shared input (float32, checked), or None where none
        was measured; the Linears fed one input must share one factor."""
        table = self.quantization.smoothing if self.quantization is not None else None
        got = [(table or {}).get(self._lm_path(lin)) for lin in linears]
        if all(g is None for g in got):
            return None
        what = ", ".join(self._lm_path(lin) for lin in linears)
        if any(g is None or not np.array_equal(g, got[0]) for g in got):
            raise ValueError(f"the projections {what} read one input but were not measured one smoothing")
        factors = np.asarray(got[0], np.float32)
        if factors.shape != (k,) or not np.all(np.isfinite(factors)) or not np.all(factors > 0):
            raise ValueError(f"the smoothing of {what} is not {k} positive finite factors")
        return factors

    def _smoothing(self, linear: torch.nn.Module, k: int) -> np.ndarray:
        """The measured smoothing factor [K] of a per-channel Linear's input; ones where none was measured."""
        factors = self._measured_smoothing([linear], k)
        return np.ones(k, np.float32) if factors is None else factors

    def _block_smoothing(self, linears: list[torch.nn.Module], k: int) -> np.ndarray | None:
        """The measured smoothing [K] of MatMulNBits projections' shared input, as the graph stores it
        (its dtype), or None where none was measured."""
        factors = self._measured_smoothing(linears, k)
        if factors is None:
            return None
        stored = factors.astype(self.w.np_dtype)
        if not (np.all(np.isfinite(stored)) and np.all(stored > 0)):
            raise ValueError(f"the smoothing of {self._lm_path(linears[0])} does not fit in {self.w.dtype}")
        return stored

    def _smoothed_input(self, x: str, factors: np.ndarray, name: str, base: str) -> tuple[str, str]:
        """``x`` times ``factors`` (one Mul per input; projections reading the same input share it) and the
        factors' initializer."""
        if self._smoothed is None:
            self._smoothed = {}
        if x not in self._smoothed:
            init = self.w.init(f"{name}_smoothing", np.ascontiguousarray(factors))
            self._smoothed[x] = (init, self.w.one("Mul", [x, init], f"{base}/smoothed"), factors)
        init, smoothed, first = self._smoothed[x]
        if not np.array_equal(first, factors):
            raise ValueError(f"{name}: its input is smoothed by another projection's different factors")
        return smoothed, init

    def _channel_weight(self, name: str, names: list[str], sizes: list[int], k: int,
                        smoothing: np.ndarray) -> tuple[str, str, str]:
        """The int8 rows [N, K] (streamed to the sink), their scales [N] and the smoothing [K], float32."""
        scales: list[np.ndarray] = []

        def rows_of() -> Iterator[np.ndarray]:
            for _, rows in self._row_blocks(names, sizes, k):
                q, s = quantize_channel(rows.detach().float().numpy(), smoothing)
                scales.append(s)
                yield q

        table = self.w.blocks(f"{name}_Q8c", (sum(sizes), k), np.int8, rows_of())
        return (table, self.w.init(f"{name}_channel_scales", np.concatenate(scales).astype(np.float32)),
                self.w.init(f"{name}_smoothing", np.ascontiguousarray(smoothing, np.float32)))

    def _matmul_channel(self, name: str, x: str, linears: list[torch.nn.Linear], names: list[str], base: str,
                        out: str | None, width: Width) -> str:
        """``quantize.channel_head`` as nodes: the input times the smoothing, rounded to int8 per row
        (its scale ``max(max|row| / 127, tiny)``), MatMulInteger with the int8 rows (transposed, folded
        at load), cast to float32, times the row's scale, times each output's; in float32 whatever the
        graph's dtype (cast at both ends)."""
        k, sizes = int(linears[0].in_features), [int(lin.out_features) for lin in linears]
        shared = self.shared_head
        if shared is not None and [self._path(lin) for lin in linears] == [shared.parts[0][0]]:
            lin = shared
        else:
            table, scales, smooth = self._channel_weight(name, names, sizes, k, self._smoothing(linears[0], k))
            lin = QuantizedLinear(table, scales, k, sum(sizes), tuple(
                (self._path(m), size) for m, size in zip(linears, sizes)), width, smoothing=smooth)
        self.quantized.append(lin)
        one = self.w.one
        f32 = self.w.np_dtype == np.float32
        x32 = x if f32 else one("Cast", [x], f"{base}/to_float32", to=TensorProto.FLOAT)
        xs = one("Mul", [x32, lin.smoothing], f"{base}/smoothed")
        top = one("ReduceMax", [one("Abs", [xs], f"{base}/abs"), self.i64(f"{base}/last", [-1])], f"{base}/row_max",
                  keepdims=1)
        step = one("Max", [one("Mul", [top, self.w.init(f"{base}/inverse_127", CHANNEL_INVERSE_127)],
                               f"{base}/row_scale"), self.w.init(f"{base}/tiny", CHANNEL_TINY)], f"{base}/row_step")
        rounded = one("Round", [one("Div", [xs, step], f"{base}/divided")], f"{base}/rounded")
        q = one("Cast", [one("Add", [rounded, self.w.init(f"{base}/offset", np.float32(128))], f"{base}/offset")],
                f"{base}/int8_rows", to=TensorProto.UINT8)
        rows_t = one("Transpose", [lin.packed], f"{base}/rows_t", perm=[1, 0])
        acc = one("MatMulInteger", [q, rows_t, self.w.init(f"{base}/zero", np.uint8(128))], f"{base}/int32")
        scaled_rows = one("Mul", [one("Cast", [acc], f"{base}/sums", to=TensorProto.FLOAT), step], f"{base}/times_row")
        if f32:
            return self._emit("Mul", [scaled_rows, lin.scales], base, out)
        y = one("Mul", [scaled_rows, lin.scales], f"{base}/times_column")
        return self._emit("Cast", [y], base, out, to=onnx_type(self.w.dtype))

    def _quantized_weight(self, name: str, names: list[str], sizes: list[int], k: int, width: Width, *,
                          flat: bool = False, linears: list[torch.nn.Module] = (),  # type: ignore[assignment]
                          smoothing: np.ndarray | None = None) -> tuple[str, str, str, str]:
        """ONNX Runtime's quantizer on blocks of output rows (independent columns of [K, N]): the
        packed blocks go to the sink as they are made, then the scales, zero points and offsets
        ("" where the width has none). ``flat``: packed as [N, K * bits / 8] (GatherBlockQuantized's
        shape; the same bytes). ``smoothing``: each row divided by it (in float32, then the graph's dtype)."""
        assert self.quantizer is not None and self.quantization is not None
        block = self.quantization.block_size
        n, blocks = sum(sizes), -(-k // block)
        scales: list[np.ndarray] = []
        zeros: list[np.ndarray] = []
        offsets: list[np.ndarray] = []

        importance = self._importance(linears)

        def packed_blocks() -> Iterator[np.ndarray]:
            divisor = None if smoothing is None else torch.from_numpy(smoothing.astype(np.float32))
            for _, rows in self._row_blocks(names, sizes, k):
                if divisor is not None:
                    # as the reference divides them: the graph's dtype, float32, the graph's dtype
                    rows = (rows.detach().to(self.w.torch_dtype).float() / divisor).to(self.w.torch_dtype)
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
        # float32 whatever the graph's dtype (:meth:`_nbits`); a float16 graph's are its float16 scales, exactly
        scale = self.w.blocks(f"{name}_scales", (n, blocks), np.float32, [s.astype(np.float32) for s in scales])
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
        if width.per_channel:
            return self._matmul_channel(name, x, linears, names, base, out, width)
        k, sizes = int(linears[0].in_features), [int(lin.out_features) for lin in linears]
        n, block = sum(sizes), self.quantization.block_size
        shared = self.shared_head
        if shared is not None and [self._path(lin) for lin in linears] == [shared.parts[0][0]]:
            shape = self.i64(f"{name}_shape", [n, -(-k // block), block * width.bits // 8])
            packed = self.w.one("Reshape", [shared.packed, shape], f"{base}/packed_view")
            self.quantized.append(shared)
            if shared.smoothing:
                x = self.w.one("Mul", [x, shared.smoothing], f"{base}/smoothed")
            inputs = [x, packed, shared.scales] + ([shared.zero_points] if shared.zero_points else [])
            return self._nbits(inputs, base, out, self.quantization.node_attributes(k, n, width.bits))
        factors = self._block_smoothing(linears, k)
        smoothing = ""
        if factors is not None:
            if width.offsets:
                raise ValueError(f"{name}: a smoothed input and block offsets are not written together")
            x, smoothing = self._smoothed_input(x, factors, name, base)
        packed, scale, zero, offsets = self._quantized_weight(name, names, sizes, k, width, linears=linears,
                                                              smoothing=factors)
        self.quantized.append(QuantizedLinear(packed, scale, k, n, tuple(
            (self._path(lin), size) for lin, size in zip(linears, sizes)), width, zero, offsets=offsets,
            smoothing=smoothing))
        attrs = self.quantization.node_attributes(k, n, width.bits)
        if not offsets:
            return self._nbits([x, packed, scale] + ([zero] if zero else []), base, out, attrs)
        grid = self._nbits([x, packed, scale], base, None, attrs)
        added = self.w.one("MatMul", [self._block_sums(x, k, base), offsets], f"{base}/offsets")
        return self._emit("Add", [grid, added], base, out)

    def _nbits(self, inputs: list[str], base: str, out: str | None, attrs: dict[str, int]) -> str:
        """One MatMulNBits, in float32 whatever the graph's dtype: a float16 graph casts its input to float32
        and the product back. ONNX Runtime 1.32 CPU runs a float16 MatMulNBits whose input it computes in
        float32 (after a float16 op it has no kernel for, such as the SiLU before the down projection) as a
        float32 one, its scales cast by a node at run time, and at accuracy level 4 its kernel then returns
        wrong values (measured: the whole output's magnitude off; constant scales are right). Float32 scales
        and input leave nothing to cast; the float32 input is the float16 value exactly, and the product is
        rounded once to float16, as the float16 kernel rounds it."""
        if self.w.np_dtype == np.float32:
            return self._emit("MatMulNBits", inputs, base, out, **attrs)
        if self._float32_inputs is None:
            self._float32_inputs = {}
        x = inputs[0]
        if x not in self._float32_inputs:  # gate and up read one input: one Cast
            self._float32_inputs[x] = self.w.one("Cast", [x], f"{base}/to_float32", to=TensorProto.FLOAT)
        y = self.w.one("MatMulNBits", [self._float32_inputs[x], *inputs[1:]], f"{base}/float32", domain=MS_DOMAIN,
                       **attrs)
        return self._emit("Cast", [y], base, out, to=onnx_type(self.w.dtype))

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
        if width is None or width.offsets or (
                not width.per_channel and int(embed.weight.shape[1]) % self.quantization.block_size):
            return None
        return width

    def _quantized_lookup(self, embed: torch.nn.Module, name: str, width: Width) -> str:
        """The embedding quantized once at the head's width, looked up by GatherBlockQuantized;
        the head (``_matmul_nbits``) reads the same packed weight."""
        vocab, hidden = (int(d) for d in embed.weight.shape)
        if width.per_channel:
            return self._channel_lookup(embed, name, width)
        head = self.lm.get_output_embeddings()
        factors = self._block_smoothing([head], hidden)
        packed, scales, zero, _ = self._quantized_weight(f"{self.prefix}model.embed_tokens.weight", [name], [vocab],
                                                      hidden, width, flat=True, smoothing=factors)
        smooth = "" if factors is None else self.w.init(f"{self.prefix}lm_head_smoothing", factors)
        self.shared_head = QuantizedLinear(packed, scales, hidden, vocab, ((self._path(head), vocab),), width, zero,
                                           self._path(embed), smoothing=smooth)
        f32 = self.w.np_dtype == np.float32
        rows = self.w.one("GatherBlockQuantized", [packed, self.ids, scales] + ([zero] if zero else []),
                          EMBED_OUTPUT if f32 and not smooth else "embed/rows", domain=MS_DOMAIN, gather_axis=0,
                          quantize_axis=1, block_size=self.quantization.block_size, bits=width.bits)
        if not f32:  # the scales are float32 (:meth:`_nbits`), so are the rows
            rows = self.w.one("Cast", [rows], "embed/rows_cast" if smooth else EMBED_OUTPUT,
                              to=onnx_type(self.w.dtype))
        # the rows are the head's, divided by its input's smoothing: times it, the embedding's own
        return self.w.one("Mul", [rows, smooth], EMBED_OUTPUT) if smooth else rows

    def _channel_lookup(self, embed: torch.nn.Module, name: str, width: Width) -> str:
        """The embedding quantized once per channel (the head's rows, smoothed as the head's input is):
        Gather of the int8 rows, Cast, times the row's scale, times the smoothing (``quantize.dequantize_channel``);
        the head (``_matmul_channel``) reads the same rows."""
        vocab, hidden = (int(d) for d in embed.weight.shape)
        head = self.lm.get_output_embeddings()
        table, scales, smooth = self._channel_weight(f"{self.prefix}model.embed_tokens.weight", [name], [vocab], hidden,
                                                     self._smoothing(head, hidden))
        self.shared_head = QuantizedLinear(table, scales, hidden, vocab, ((self._path(head), vocab),), width,
                                           embedding=self._path(embed), smoothing=smooth)
        one = self.w.one
        rows = one("Cast", [one("Gather", [table, self.ids], "embed/int8_rows")], "embed/rows", to=TensorProto.FLOAT)
        row_scales = one("Unsqueeze", [one("Gather", [scales, self.ids], "embed/row_scales"),
                                       self.i64("embed/last", [-1])], "embed/row_scales_3d")
        scaled = one("Mul", [rows, row_scales], "embed/times_row")
        if self.w.np_dtype == np.float32:
            return one("Mul", [scaled, smooth], EMBED_OUTPUT)
        return one("Cast", [one("Mul", [scaled, smooth], "embed/smoothed")], EMBED_OUTPUT, to=onnx_type(self.w.dtype))
