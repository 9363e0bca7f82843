"""The ONNX Runtime decoder graph written part by part: :class:`OrtDecoderBuilder`.

Like onnxruntime-genai's model builder, one method per part of the model (``make_prelude``,
``make_rotary``, ``make_embedding``, ``make_norm``, ``make_residual_norm``, ``make_attention``,
``make_mlp``, ``make_layers``, ``make_lm_head``, ``make_model``); the graph they write is described
in ``ort_graph``. The builder walks the module tree of the model for its structure and reads
every projection's and the embedding's weights from a tensor source (``weights``): the modules
themselves, or the safetensors files of a checkpoint whose module tree holds no weights
(``streaming``). Norm weights come from the detected norms, whose specs were confirmed bit for
bit on the real modules.

Projections are one MatMul on the fused weights, or with ``quantization`` one
``com.microsoft.MatMulNBits`` whose weights ONNX Runtime's quantizer packed (``quantize``). Large
weights (the embedding, the LM head) are cast or quantized in blocks of rows or columns, each
block handed to the writer's sink as it is made (``ort_writer``): with an external-data sink no
weight is ever whole in memory. A mixture-of-experts MLP is written by ``ort_moe``.

Long: the one writer of every family's graph, a method per part; what is one family's own lives in
``families`` (and a mixture of experts in ``ort_moe``), so this grows only with the graph's parts.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from rmsnorm_deploy.contract.dtypes import dtype_name, onnx_type
from rmsnorm_deploy.decoder.convention import ORT_DTYPES
from rmsnorm_deploy.decoder.ort_model import (
    EMBED_OUTPUT,
    EMBED_SCALED_OUTPUT,
    MS_DOMAIN,
    OPSET,
    TARGET,
    OrtDecoderError,
    causal_lm,
    decoder_dims,
    model_family,
    inputs_metadata,
    kv_cache_metadata,
    lm_head_of,
    residual_output,
    skip_norm_node,
    skip_refusal,
)
from rmsnorm_deploy.decoder.ort_rotary import rotary_tables
from rmsnorm_deploy.decoder.ort_writer import ExternalData, GraphWriter, InMemory
from rmsnorm_deploy.decoder.ort_moe import make_moe
from rmsnorm_deploy.decoder.ort_quantized import QuantizedWeights
from rmsnorm_deploy.decoder.quant_recipes import role_of
from rmsnorm_deploy.decoder.quantize import Quantization, QuantizedLinear, WeightQuantizer, metadata_entry
from rmsnorm_deploy.decoder.quantize import QuantizedExperts
from rmsnorm_deploy.decoder.weights import ModuleTensors, TensorSource, parameter_names
from rmsnorm_deploy.exporter.detect import Detection, detect_norms
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.graph.function import rmsnorm_node
from rmsnorm_deploy.graph.lowerings import lower_model, refusal
from rmsnorm_deploy.graph.metadata import ModelMetadata, tool_versions
from rmsnorm_deploy.graph.standalone import ir_version_for

#: Bytes of float32 one block of rows of a large weight may take while it is cast or quantized.
BLOCK_BYTES = 64 * 2**20
#: The same for a block of columns (an unquantized LM head, transposed): each block reads every
#: row of the stored weight, so the blocks are larger and fewer.
COLUMN_BLOCK_BYTES = 256 * 2**20


class OrtDecoderBuilder(QuantizedWeights):
    """Writes the decoder graph of one Llama-family causal LM (see the module docstring).

    ``loaded``: the model (its module tree; weights on the meta device when ``tensors`` holds
    them). ``detection``: its norms, found and confirmed (done here when not given). Raises
    :class:`OrtDecoderError` for a model or option it cannot write exactly.
    """

    def __init__(self, loaded: LoadedModel, *, tensors: TensorSource | None = None, lowering: str = "function",
                 share_buffer: bool = False, max_length: int | None = None,
                 quantization: Quantization | None = None, sink: InMemory | ExternalData | None = None,
                 detection: Detection | None = None):
        self.dtype = dtype_name(loaded.dtype)
        if self.dtype not in ORT_DTYPES:
            raise OrtDecoderError(f"--target onnxruntime writes {', '.join(ORT_DTYPES)} graphs (GroupQueryAttention "
                                  f"has no {self.dtype} CPU kernel); export {self.dtype} with --target portable")
        self.loaded, self.lm = loaded, causal_lm(loaded)
        self.family = model_family(self.lm)
        self.dims = decoder_dims(self.lm, self.family)
        self.max_length = int(max_length or self.dims.max_positions)
        if not 1 <= self.max_length <= self.dims.max_positions:
            raise OrtDecoderError(f"max_length {self.max_length} is outside the model's 1..{self.dims.max_positions} "
                                  "positions")
        self.detection = detection or detect_norms(loaded.module, dtype=self.dtype)
        self.norms = {n.path: n for n in self.detection.norms}
        for norm in self.detection.norms:
            reason = refusal(lowering, norm.spec, norm.spec.upcasts(self.dtype), OPSET)
            if reason:
                raise OrtDecoderError(f"cannot lower norm {norm.path!r} to {lowering!r}: {reason}")
        self.lowering, self.share_buffer, self.quantization = lowering, share_buffer, quantization
        self.paths = {id(m): p for p, m in loaded.module.named_modules()}
        self.prefix = f"{self.paths[id(self.lm)]}." if self.paths[id(self.lm)] else ""
        self.tensor_names = parameter_names(self.lm)
        self.tensors = tensors if tensors is not None else ModuleTensors(self.lm)
        self.w = GraphWriter(self.dtype, sink)
        self.quantizer = WeightQuantizer(quantization.block_size) if quantization is not None else None
        self.quantized: list[QuantizedLinear] = []
        self.quantized_experts: list[QuantizedExperts] = []
        #: the tied embedding's packed weight, written once by make_embedding for the head to read
        self.shared_head: QuantizedLinear | None = None
        #: the float embedding table a tied, unquantized head multiplies by (its Transpose, MatMul)
        self.tied_table = ""
        self.used_norms: list[str] = []
        # The ort lowering writes ONNX Runtime's ops: there the residual Add goes into the norm's op.
        self.skip_fusion = lowering == "ort"
        config = self.lm.config
        self.windows = [self.family.window(config, i) for i in range(self.dims.layers)]
        self.rotary_kinds = [self.family.rotary_kind(self.lm, i) if self.family.rotates(config, i) else ""
                             for i in range(self.dims.layers)]
        self.head_path = ""

    # -- the whole graph --------------------------------------------------------------------
    def build(self) -> onnx.ModelProto:
        """The graph: prelude, rotary tables, embedding, layers, final norm, LM head."""
        self.make_prelude()
        self.make_rotary()
        x = self.make_layers(self.make_embedding())
        self.make_lm_head(x)
        missing = [p for p in self.norms if p not in self.used_norms]
        if missing:
            raise OrtDecoderError(f"{len(missing)} detected norm(s) are not on the graph's path "
                                  f"({', '.join(missing[:3])}); this model's structure is not the Llama family's")
        return self.make_model()

    # -- weights ------------------------------------------------------------------------------
    def _tensor_name(self, param: torch.Tensor, what: str) -> str:
        name = self.tensor_names.get(id(param))
        if name is None:
            raise OrtDecoderError(f"{what}: its weight is not a parameter of the model")
        check = getattr(self.tensors, "check", None)
        if check is not None:  # a checkpoint on disk: untrusted, checked against the module tree
            check(name, tuple(param.shape), what)
        return name

    def _path(self, module: torch.nn.Module) -> str:
        return self.paths[id(module)]

    def _row_blocks(self, names: list[str], sizes: list[int], width: int) -> Iterator[tuple[int, torch.Tensor]]:
        """The rows of the tensors ``names`` stacked ([sum(sizes), width]), in blocks of at most
        :data:`BLOCK_BYTES` as float32: (first row, block)."""
        step = max(1, BLOCK_BYTES // (4 * width))
        total, offsets = sum(sizes), [int(v) for v in np.cumsum([0, *sizes])]
        for start in range(0, total, step):
            stop = min(total, start + step)
            pieces = [self.tensors.rows(name, max(start, lo) - lo, min(stop, hi) - lo)
                      for name, lo, hi in zip(names, offsets[:-1], offsets[1:]) if lo < stop and start < hi]
            yield start, torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]

    def _transposed_blocks(self, names: list[str], rows: int, width: int) -> Iterator[np.ndarray]:
        """``cat(W_i).T`` ([width, rows]) in blocks of its rows: columns of the stacked weights."""
        step = max(1, COLUMN_BLOCK_BYTES // (4 * rows))
        for start in range(0, width, step):
            stop = min(width, start + step)
            pieces = [self.tensors.columns(name, start, stop) for name in names]
            block = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
            yield self.w.cast_transposed(block)

    def make_linear(self, name: str, x: str, linears: list[torch.nn.Linear], base: str, *,
                    quantize: bool = True, out: str | None = None) -> str:
        """``x @ cat(W_i).T (+ bias)`` for Linear modules on the same input: one MatMul, or one
        MatMulNBits at the width the ``--quantize`` recipe names for this weight (its role and
        layer read from ``name``: ``quant_recipes.role_of``), unless ``quantize`` is False."""
        what = f"{name} ({', '.join(self._path(lin) for lin in linears)})"
        names = [self._tensor_name(lin.weight, what) for lin in linears]
        k, sizes = int(linears[0].in_features), [int(lin.out_features) for lin in linears]
        width = None
        if self.quantization is not None and quantize:
            role, layer = role_of(name)
            width = self.quantization.width(role, layer, self.dims.layers)
        if width is not None:
            y = self._matmul_nbits(name, x, linears, names, base, out, width)
        else:
            weight = self.w.blocks(name, (k, sum(sizes)), self.w.np_dtype, self._transposed_blocks(names, sum(sizes), k))
            y = self._emit("MatMul", [x, weight], base, out)
        return self._bias(base, y, linears) if out is None else y

    def _emit(self, op: str, inputs: list[str], base: str, out: str | None, **attrs: Any) -> str:
        if out is None:
            return self.w.one(op, inputs, base, domain=MS_DOMAIN if op == "MatMulNBits" else "", **attrs)
        self.w.nodes.append(helper.make_node(op, inputs, [out], name=self.w.name(f"{base}/{op}"),
                                             domain=MS_DOMAIN if op == "MatMulNBits" else None, **attrs))
        return out

    def _bias(self, name: str, x: str, linears: list[torch.nn.Linear]) -> str:
        biases = [lin.bias for lin in linears]
        if all(b is None for b in biases):
            return x
        if any(b is None for b in biases):
            raise OrtDecoderError(f"{name}: some fused projections have a bias and some do not")
        what = f"{name} bias"
        values = torch.cat([self.tensors.get(self._tensor_name(b, what)) for b in biases])
        return self.w.one("Add", [x, self.w.weight(f"{name}.bias", values)], name)

    # -- parts --------------------------------------------------------------------------------
    def make_prelude(self) -> None:
        """Each row's chunk of ``input_ids`` valid tokens first, as GroupQueryAttention reads them.

        GroupQueryAttention keeps each row's cache compact: its valid tokens first, its length
        seqlens_k + 1 = sum(attention_mask), positions = index in the row. The convention pads
        on the left, so the chunk's tokens are reordered valid tokens first before the embedding
        and the final hidden state put back in the input's order before the LM head: a TopK of
        the 0/1 mask with ONNX's tie rule (equal values keep index order; for left padding a
        rotation by the padding), and back by the inverse permutation, the ascending order of
        those indices. Positions then equal cumsum(attention_mask) - 1, which is what the
        convention's position_ids hold (the input is accepted; GQA's rotary derives the same).
        """
        w = self.w
        one_1d, axes1 = self.i64("one_1d", [1]), self.i64("axes_1", [1])
        seq_1d = w.one("Shape", ["input_ids"], "mask/seq_1d", start=1, end=2)
        total_1d = self.total_1d = w.one("Shape", ["attention_mask"], "mask/total_1d", start=1, end=2)
        self.chunk_bounds = (w.one("Sub", [total_1d, seq_1d], "mask/past_1d"), total_1d)
        chunk = w.one("Slice", ["attention_mask", *self.chunk_bounds, axes1], "mask/chunk")
        _, to_compact = w.node("TopK", [chunk, seq_1d], "mask/to_compact", outputs=2, axis=1, largest=1, sorted=1)
        _, self.back = w.node("TopK", [to_compact, seq_1d], "mask/to_original", outputs=2, axis=1, largest=0, sorted=1)
        self.ids = w.one("GatherElements", ["input_ids", to_compact], "mask/input_ids_compact", axis=1)
        self.to_compact, self.positions = to_compact, None
        self.lengths = w.one("ReduceSum", ["attention_mask", axes1], "mask/lengths", keepdims=0)  # [batch]
        self.seqlens = w.one("Cast", [w.one("Sub", [self.lengths, one_1d], "mask/seqlens64")], "mask/seqlens_k",
                             to=TensorProto.INT32)
        # GroupQueryAttention's total_sequence_length: a scalar or, as here, a one-element vector.
        self.total_i32 = w.one("Cast", [total_1d], "mask/total_sequence_length", to=TensorProto.INT32)

    def i64(self, name: str, value: Any) -> str:
        return self.w.init(f"const/{name}", np.array(value, dtype=np.int64))

    def make_rotary(self) -> None:
        """One cos/sin pair per rotary table the layers read (Gemma3: local and global attention;
        ``""``: a layer without rotary, no table); LongRoPE's picked per run (``ort_rotary``)."""
        self.caches, self.rotary_switch = rotary_tables(self.w, self.lm, self.dims, self.rotary_kinds, self.lengths,
                                                        self.total_1d)

    def make_embedding(self) -> str:
        """Gather from the embedding, written in blocks of rows; the family's scale after it (Gemma).
        A head tied to the embedding and quantized: the weight is quantized once, at the head's
        width, looked up by ``GatherBlockQuantized`` and multiplied by the head's MatMulNBits."""
        embed = self.lm.get_input_embeddings()
        name = self._tensor_name(embed.weight, "the input embedding")
        vocab, hidden = (int(d) for d in embed.weight.shape)
        width = self._tied_head_width(embed)
        if width is not None:
            x = self._quantized_lookup(embed, name, width)
        else:
            table = self.w.blocks(f"{self.prefix}model.embed_tokens.weight", (vocab, hidden), self.w.np_dtype,
                                  (self.w.cast(rows) for _, rows in self._row_blocks([name], [vocab], hidden)))
            x = self.w.one("Gather", [table, self.ids], EMBED_OUTPUT)
            if getattr(self.lm.get_output_embeddings(), "weight", None) is embed.weight:
                self.tied_table = table
        scale = self.family.embedding_scale(self.lm)
        if scale is not None:
            x = self.scalar_op("Mul", x, scale.detach().cpu().numpy(), "embed/scale", EMBED_SCALED_OUTPUT,
                               const=f"{self.prefix}model.embed_tokens.embed_scale")
        return x

    def make_norm(self, module: torch.nn.Module, x: str, out: str | None = None) -> str:
        """Our exact ``rmsnorm_deploy::RMSNorm`` node for a detected norm."""
        path = self._path(module)
        found = self.norms.get(path)
        if found is None:
            raise OrtDecoderError(f"{path}: not a detected RMSNorm; the graph writes every norm as its exact spec")
        inputs = [x] + ([self.w.weight(f"{path}.weight", found.weight)] if found.spec.has_gain else [])
        y = out or self.w.name(f"{path}/output")
        self.w.nodes.append(rmsnorm_node(found.spec, self.dtype, inputs, [y], name=path))
        self.used_norms.append(path)
        return y

    def make_residual_norm(self, module: torch.nn.Module, hidden: str, branch: str, base: str, *,
                           keep_sum: bool = True) -> tuple[str, str]:
        """``s = hidden + branch`` and ``norm(s)``: (normalized, s). With the ``ort`` lowering one
        ``SkipSimplifiedLayerNormalization`` (its fourth output is ``s``), else ``Add`` and our node."""
        path = self._path(module)
        found = self.norms.get(path)
        if not self.skip_fusion or found is None or skip_refusal(found.spec, self.dtype) is not None:
            total = self.w.one("Add", [hidden, branch], base)
            return self.make_norm(module, total), total
        y, total = self.w.name(f"{path}/output"), self.w.name(base) if keep_sum else ""
        self.w.nodes.append(skip_norm_node(found.spec, [hidden, branch, self.w.weight(f"{path}.weight", found.weight)],
                                           [y, total], name=path))
        self.used_norms.append(path)
        return y, total

    def make_head_norm(self, module: torch.nn.Module | None, x: str, heads: int, base: str) -> str:
        """A q/k norm: per head (Qwen3's, a weight of head_dim): [B, S, H*D] -> [B, S, H, D] -> norm ->
        back; or over all heads (OLMo2's, a weight of H*D): the norm on [B, S, H*D] as it is."""
        if module is None:
            return x
        head_dim = self.dims.head_dim
        weight = getattr(module, "weight", None)
        width = int(weight.numel()) if isinstance(weight, torch.Tensor) else head_dim
        if width == heads * head_dim and width != head_dim:
            return self.make_norm(module, x)
        if width != head_dim:
            raise OrtDecoderError(f"{base}: a q/k norm over {width} values is neither per head ({head_dim}) nor over "
                                  f"all {heads} heads ({heads * head_dim})")
        to_heads = self.w.init(f"{base}/heads_shape", np.array([0, 0, heads, head_dim], dtype=np.int64))
        flat = self.w.init(f"{base}/flat_shape", np.array([0, 0, heads * head_dim], dtype=np.int64))
        y = self.make_norm(module, self.w.one("Reshape", [x, to_heads], f"{base}/to_heads"))
        return self.w.one("Reshape", [y, flat], f"{base}/flat")

    def make_attention(self, i: int, layer: torch.nn.Module, x: str, base: str) -> str:
        """Fused Q/K/V, the q/k norms where the family has them, GroupQueryAttention with the layer's
        rotary table, window and softcap inside and the K/V heads unrepeated, the output projection."""
        attn, dims, family = layer.self_attn, self.dims, self.family
        qkv = self.make_linear(f"{base}.self_attn.qkv_proj.weight", x, [getattr(attn, n) for n in family.qkv],
                               f"{base}/attn/qkv")
        kind = self.rotary_kinds[i]
        rotary = list(self.caches[kind]) if kind != "" else []
        if family.qk_norms is not None:
            q_size, kv_size = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
            split = self.w.init(f"{base}/attn/split", np.array([q_size, kv_size, kv_size], dtype=np.int64))
            q, k, v = self.w.node("Split", [qkv, split], f"{base}/attn/split", outputs=3, axis=-1)
            if family.qk_norms_after_rotary and rotary:  # the norms read rotated q and k: rotate here
                q, k = (self.rotate(t, rotary, f"{base}/attn/{n}") for t, n in ((q, "q"), (k, "k")))
                rotary = []
            q_norm, k_norm = (getattr(attn, n) for n in family.qk_norms)
            q = self.make_head_norm(q_norm, q, dims.heads, f"{base}/attn/q")
            k = self.make_head_norm(k_norm, k, dims.kv_heads, f"{base}/attn/k")
            qkv_inputs = [q, k, v]
        else:
            qkv_inputs = [qkv, "", ""]  # packed
        window, softcap, do_rotary = self.windows[i], family.attention_softcap(self.lm.config), int(bool(rotary))
        if family.sinks is not None:  # head_sink is input 11, after cos, sin, position_ids, attention_bias
            sinks = self.tensors.get(self._tensor_name(getattr(attn, family.sinks), f"{base}.self_attn.{family.sinks}"))
            rotary = (rotary or ["", ""]) + ["", "", self.w.weight(f"{base}.self_attn.{family.sinks}", sinks)]
        gqa_out = self.w.node(
            "GroupQueryAttention",
            qkv_inputs + [f"past_key_values.{i}.key", f"past_key_values.{i}.value", self.seqlens, self.total_i32,
                          *rotary],
            f"{base}/attn/gqa", outputs=3, domain=MS_DOMAIN,
            num_heads=dims.heads, kv_num_heads=dims.kv_heads, scale=dims.scale, do_rotary=do_rotary,
            rotary_interleaved=int(family.rotary_interleaved),
            # local_window_size counts the query itself, as transformers' sliding_window does (measured:
            # window - 1 is 0.1 off on the logits from the first token past the window).
            local_window_size=-1 if window is None else window,
            **({"softcap": float(softcap)} if softcap is not None else {}),
        )
        # The present outputs carry the convention's names.
        gqa_node = self.w.nodes[-1]
        gqa_node.output[1], gqa_node.output[2] = f"present.{i}.key", f"present.{i}.value"
        return self.make_linear(f"{base}.self_attn.o_proj.weight", gqa_out[0], [getattr(attn, family.o_proj)],
                                f"{base}/attn/o_proj")

    def rotate(self, x: str, cache: list[str], base: str) -> str:
        """``com.microsoft.RotaryEmbedding`` on ``x`` [B, S, H * D] at each compact token's position: GQA's
        own rotation, written before it where a norm reads the rotated q and k (HunYuan)."""
        if self.positions is None:  # cumsum(mask) - 1 over the chunk, in GQA's order (padding: 0)
            w = self.w
            pos = w.one("Sub", [w.one("CumSum", ["attention_mask", self.i64("axis_1", 1)], "positions/cumsum"),
                                self.i64("one", 1)], "positions/all")
            pos = w.one("Max", [pos, self.i64("zero", 0)], "positions/clipped")
            chunk = w.one("Slice", [pos, *self.chunk_bounds, self.i64("axes_1_pos", [1])], "positions/chunk")
            self.positions = w.one("GatherElements", [chunk, self.to_compact], "positions/compact", axis=1)
        return self.w.one("RotaryEmbedding", [x, self.positions, *cache], f"{base}/rotary", domain=MS_DOMAIN,
                          interleaved=int(self.family.rotary_interleaved))

    def make_dense_mlp(self, mlp: torch.nn.Module, x: str, base: str) -> str:
        """``down(act(gate(x)) * up(x))``. Gate and up apart are two MatMuls on the same input, not one
        fused MatMul and a Split: the Split copies both halves every step, and ONNX Runtime runs two
        MatMuls as fast as one. A fused [gate; up] Linear (Phi-3) is one MatMul and a Split."""
        family = self.family
        if len(family.gate_up) == 1:
            fused = self.make_linear(f"{base}.mlp.gate_up_proj.weight", x, [getattr(mlp, family.gate_up[0])],
                                     f"{base}/mlp/gate_up")
            gate, up = self.w.node("Split", [fused], f"{base}/mlp/split", outputs=2, axis=-1, num_outputs=2)
        else:
            gate_proj, up_proj = (getattr(mlp, n) for n in family.gate_up)
            gate = self.make_linear(f"{base}.mlp.gate_proj.weight", x, [gate_proj], f"{base}/mlp/gate")
            up = self.make_linear(f"{base}.mlp.up_proj.weight", x, [up_proj], f"{base}/mlp/up")
        gated = self.w.one("Mul", [self.make_activation(gate, f"{base}/mlp"), up], f"{base}/mlp/gated")
        return self.make_linear(f"{base}.mlp.down_proj.weight", gated, [getattr(mlp, family.down)],
                                f"{base}/mlp/down")

    def make_moe_mlp(self, mlp: torch.nn.Module, x: str, base: str) -> str:
        """A mixture-of-experts MLP of a ``MoEFamily`` (``ort_moe``): router, then one MoE / QMoE node."""
        return make_moe(self, self.family, mlp, x, base)

    def make_activation(self, x: str, base: str) -> str:
        """The family's activation of ``x`` (one of ``families.ACTIVATIONS``)."""
        if self.dims.activation == "gelu_pytorch_tanh":
            return self.w.one("Gelu", [x], f"{base}/gelu", approximate="tanh")
        return self.w.one("Mul", [x, self.w.one("Sigmoid", [x], f"{base}/sigmoid")], f"{base}/silu")

    def scalar_op(self, op: str, x: str, value: np.ndarray, base: str, out: str | None = None, *,
                  const: str | None = None) -> str:
        """``op(x, value)`` for a 0-d ``value`` in the dtype torch computes in: a value in the model dtype
        (Gemma's embedding scale) in the model dtype; a float32 one (a Python float: torch's float32
        math for a float16 tensor) in float32, ``x`` cast to it and the result cast back, rounded once."""
        const = self.w.init(const or f"{base}/value", np.asarray(value))
        if np.asarray(value).dtype == self.w.np_dtype:
            return self._node_to(op, [x, const], base, out)
        up = self.w.one("Cast", [x], f"{base}/to_float32", to=TensorProto.FLOAT)
        return self._node_to("Cast", [self.w.one(op, [up, const], f"{base}/float32")], f"{base}/to_model_dtype", out,
                             to=onnx_type(self.dtype))

    def _scaled(self, x: str, scale: float | None, base: str) -> str:
        """``x * scale`` (a Python float: in float32), or ``x`` where there is no scale."""
        return x if scale is None else self.scalar_op("Mul", x, np.float32(scale), base)

    def make_layers(self, hidden: str) -> str:
        """Every decoder layer and the final norm: the normalized last hidden state.

        Per layer ``h + attn_out(attn(attn_in(h)))`` then ``h + mlp_out(mlp(mlp_in(h)))``, each norm
        where the family has it (``families.LayerNorms``). A sublayer's output is added to the residual
        stream by the norm after it, where there is one: with the ``ort`` lowering the add and the norm
        are one kernel."""
        norms, config = self.family.norms, self.lm.config
        residual_scale = self.family.residual_scale(config)
        pending: str | None = None  # the last sublayer's output, not yet added to the residual stream
        for i, layer in enumerate(self.lm.model.layers):
            base = f"{self.prefix}model.layers.{i}"
            for part, norm_in, norm_out in (("attn", norms.attn_in, norms.attn_out),
                                            ("mlp", norms.mlp_in, norms.mlp_out)):
                total = residual_output(self.prefix, i - 1) if part == "attn" else f"{base}/attn/residual"
                if pending is None:  # the embedding: nothing to add yet
                    x = self.make_norm(getattr(layer, norm_in), hidden) if norm_in else hidden
                elif norm_in:
                    x, hidden = self.make_residual_norm(getattr(layer, norm_in), hidden, pending, total)
                else:
                    x = hidden = self.w.one("Add", [hidden, pending], total)
                if part == "attn":
                    out = self.make_attention(i, layer, x, base)
                else:
                    out = self.family.make_mlp(self, i, layer, x, base)
                if norm_out:
                    out = self.make_norm(getattr(layer, norm_out), out)
                pending = self._scaled(out, residual_scale, f"{base}/{part}/residual_scale")
        assert pending is not None
        last = residual_output(self.prefix, self.dims.layers - 1)
        x, _ = self.make_residual_norm(getattr(self.lm.model, self.family.final_norm), hidden, pending, last,
                                       keep_sum=False)
        return x

    def make_lm_head(self, x: str) -> None:
        """The hidden state back in the input's order (each row of the head is computed alone: the
        hidden size is moved, not the vocabulary), then the LM head the forward uses, then the family's
        divisor and softcap -> ``logits``."""
        head_weight, self.head_path = lm_head_of(self.lm)
        head = self.lm.get_output_embeddings()
        back_3d = self.w.one("Unsqueeze", [self.back, self.i64("axes_last", [-1])], "mask/to_original_3d")
        x = self.w.one("GatherND", [x, back_3d], "final_norm/to_original", batch_dims=1)
        config = self.lm.config
        divisor, cap = self.family.logits_divisor(config), self.family.final_softcap(config)
        out = "logits" if divisor is None and cap is None else None
        if self.tied_table and (self.quantization is None or not self.quantization.head):
            y = self._tied_float_head(x, out)
        else:
            y = self.make_linear(f"{self.prefix}lm_head.weight", x, [head], "lm_head", out=out)
        if divisor is not None:  # Python floats in the config: float32 math (scalar_op)
            y = self.scalar_op("Div", y, np.float32(divisor), "lm_head/divide", "logits" if cap is None else None)
        if cap is not None:  # cap * tanh(y / cap), in transformers' order
            t = self.w.one("Tanh", [self.scalar_op("Div", y, np.float32(cap), "lm_head/softcap/div")],
                           "lm_head/softcap/tanh")
            self.scalar_op("Mul", t, np.float32(cap), "lm_head/softcap/mul", "logits")

    def _tied_float_head(self, x: str, out: str | None) -> str:
        """``x @ E.T`` on the embedding's own [vocab, hidden] initializer, stored once: a
        ``Transpose`` of it, which ONNX Runtime folds into a [hidden, vocab] constant when the session
        loads, then ``MatMul``. Measured on real SmolLM2 decode (2 threads, 16 interleaved rounds):
        7 % less time a step than ``Gemm(transB=1)`` on the table as stored."""
        table = self.w.one("Transpose", [self.tied_table], "lm_head/table_t", perm=[1, 0])
        return self._node_to("MatMul", [x, table], "lm_head/matmul", out)

    def _node_to(self, op: str, inputs: list[str], base: str, out: str | None, **attrs: Any) -> str:
        """One node whose output is ``out`` (a graph output's fixed name) or a fresh name."""
        if out is None:
            return self.w.one(op, inputs, base, **attrs)
        self.w.nodes.append(helper.make_node(op, inputs, [out], name=self.w.name(base), **attrs))
        return out

    def make_model(self) -> onnx.ModelProto:
        """Inputs and outputs in the convention, the norms lowered, the metadata written."""
        dims, elem = self.dims, onnx_type(self.dtype)
        cache_len = "max_length" if self.share_buffer else "past"
        present_len = "max_length" if self.share_buffer else "total"
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence"]),
        ]
        outputs = [helper.make_tensor_value_info("logits", elem, ["batch", "sequence", dims.vocab])]
        for i in range(dims.layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", elem,
                                                            ["batch", dims.kv_heads, cache_len, dims.head_dim]))
                outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", elem,
                                                             ["batch", dims.kv_heads, present_len, dims.head_dim]))
        graph = helper.make_graph(self.w.nodes, f"{self.loaded.name}-kv-{TARGET}", inputs, outputs, self.w.inits)
        model = helper.make_model(graph, producer_name="rmsnorm-deploy",
                                  opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
        model.ir_version = ir_version_for(model.opset_import)
        model = lower_model(model, self.lowering)
        max_len = self.max_length
        ModelMetadata(
            specs=self.detection.specs, lowering=self.lowering, dtype=self.dtype, source=self.loaded.source,
            inputs=inputs_metadata(dims, self.dtype, self.share_buffer, self.loaded.vocab_size),
            dims={"batch": [1, 1, 8], "sequence": [1, 1, max_len], "past": [0, 0, max_len - 1],
                  "total": [1, 1, max_len]},
            versions=tool_versions(),
            kv_cache=kv_cache_metadata(dims, self.dtype, share_buffer=self.share_buffer, max_length=max_len,
                                       head=self.head_path, rotary_switch=self.rotary_switch,
                                       recompute_past=self.family.recompute_past(self.lm.config)),
            quantization=(metadata_entry(self.quantization, self.quantized, self.quantized_experts)
                          if self.quantization is not None else None),
        ).write(model)
        return model
