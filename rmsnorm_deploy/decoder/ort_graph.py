"""The ONNX Runtime decoder graph with a KV cache, written node by node from a model's modules.

``export --kv-cache --target onnxruntime`` writes this graph. It is not traced: like
onnxruntime-genai's model builder, it walks the module tree of a Llama-family causal LM
(``model.embed_tokens``, ``model.layers[i]``, ``model.norm`` and the module the model's
forward uses as its LM head, ``get_output_embeddings()``) and emits, per layer:

- the input norm as our exact ``rmsnorm_deploy::RMSNorm`` node (any lowering, see
  ``graph/lowerings.py``; ONNX Runtime fuses the ``function`` body into
  ``SimplifiedLayerNormalization``), its spec confirmed bit for bit by ``detect.py``;
- one fused Q/K/V ``MatMul`` (plus its bias where the model has one);
- Qwen3-style per-head q/k norms as our norm nodes (``Reshape`` to heads, norm, back);
- ``com.microsoft.GroupQueryAttention`` on the packed Q/K/V (separate q, k, v after Qwen3's
  norms) with rotary inside (``do_rotary=1``; cos/sin caches computed from the model's own
  ``rotary_emb.inv_freq`` and ``attention_scaling``) and the K/V heads unrepeated;
- the output projection and residual ``Add``, the post-attention norm, one fused gate/up
  ``MatMul``, the activation, the down projection and residual ``Add``.

Residual and norm. With the ``ort`` lowering (the norms are ONNX Runtime's ops) each residual
``Add`` and the norm after it are one ``com.microsoft.SkipSimplifiedLayerNormalization`` whose
fourth output is the residual sum, as onnxruntime-genai writes them: ONNX Runtime 1.32 does not
make that fusion itself (its ``SkipLayerNormFusion`` matches ``LayerNormalization`` only), so
with the ``function`` lowering our exact nodes stay and ONNX Runtime runs ``Add`` then its fused
``SimplifiedLayerNormalization``. :func:`skip_refusal` says where the fused op is not exact
(float16: it normalizes the unrounded sum); there the ``Add`` stays.

The I/O convention is the one optimum-onnx and onnxruntime-genai read: inputs ``input_ids``,
``attention_mask`` [batch, past + sequence], ``position_ids`` [batch, sequence] and
``past_key_values.{i}.key/value`` [batch, kv_heads, past, head_dim]; outputs ``logits`` and
``present.{i}.key/value`` [batch, kv_heads, past + sequence, head_dim].

Padding. GroupQueryAttention keeps each row's cache compact: a row's valid keys are its first
``seqlens_k + 1`` slots and its positions their indices (right padding). The convention pads on
the left, so the graph reorders each row's chunk of ``input_ids`` valid tokens first (a
``TopK`` of the chunk's mask, equal values kept in index order: for left padding a rotation by
the padding) before the embedding, and puts the final hidden state back in the input's order
before the LM head (each row of the head is computed alone); with
``seqlens_k = sum(attention_mask) - 1`` every valid token then sits at its position
``cumsum(attention_mask) - 1``, which is what the convention's ``position_ids`` hold (the input
is accepted and the same positions are derived). The present tensors hold each row's valid
keys first: they are this graph's own state, fed back unchanged, as every client does. The
result is transformers' masking and positions at any left padding, for 13 small index ops on
[batch, sequence] per step (onnxruntime-genai's graph has 6 and is right only for unpadded rows).

``share_buffer=True`` writes onnxruntime-genai's other mode: past and present are one
preallocated [batch, kv_heads, max_length, head_dim] buffer (bound to both with IOBinding),
``attention_mask`` still [batch, past + sequence]. The metadata's ``kv_cache`` entry says
which mode a graph uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from rmsnorm_deploy.contract.dtypes import dtype_name, numpy_dtype, onnx_type
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.decoder.convention import CONVENTION, ORT_DTYPES
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.detect import Detection, detect_norms
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.graph.function import rmsnorm_node
from rmsnorm_deploy.graph.lowerings import lower_model, refusal
from rmsnorm_deploy.graph.metadata import ModelMetadata, tool_versions
from rmsnorm_deploy.graph.standalone import ir_version_for

#: The graph's opset: 21 has every op used here (GroupQueryAttention is com.microsoft 1).
OPSET = 21
MS_DOMAIN = "com.microsoft"
TARGET = "onnxruntime"
#: model_type -> what the builder knows of it. Only these are written; others are refused.
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma3_text")
#: Families whose norms follow each sublayer (``h + norm(f(h))``) instead of preceding it.
POST_SUBLAYER_TYPES = ("olmo2",)
#: Activation names (config.hidden_act) the MLP is written for.
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class OrtDecoderError(UserError):
    """A model this builder cannot write exactly, with the reason in one line."""


@dataclasses.dataclass(frozen=True)
class DecoderDims:
    """What the graph needs from the config, each read from the model, never guessed."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    scale: float  # the attention's score scale (module.scaling)
    activation: str = "silu"  # config.hidden_act (hidden_activation for Gemma3)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class OrtDecoder:
    """The written graph and what was found on the way."""

    model: onnx.ModelProto
    dims: DecoderDims
    detection: Detection
    norm_nodes: int
    lm_head: str  # the module path of the LM head (or "tied: <embedding path>")


# -- the module tree ----------------------------------------------------------------------
def _causal_lm(loaded: LoadedModel) -> torch.nn.Module:
    model = getattr(loaded.module, "model", None)
    config = getattr(model, "config", None)
    if model is None or config is None or not hasattr(model, "get_output_embeddings"):
        raise OrtDecoderError(f"{loaded.name}: --target onnxruntime writes Hugging Face causal LMs "
                              f"({', '.join(SUPPORTED_TYPES)}); this model is not one")
    return model


def decoder_dims(lm: torch.nn.Module) -> DecoderDims:
    """The dimensions of ``lm`` (a transformers ``*ForCausalLM``), or a one-line refusal."""
    config = lm.config
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_TYPES:
        raise OrtDecoderError(f"--target onnxruntime does not write {model_type!r} models yet; it writes "
                              f"{', '.join(SUPPORTED_TYPES)} (use --target portable)")
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if act not in _ACTIVATIONS:
        raise OrtDecoderError(f"{model_type}: activation {act!r} is not written by --target onnxruntime "
                              f"(it writes {', '.join(_ACTIVATIONS)})")
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, field, None) is not None:
            raise OrtDecoderError(f"{model_type}: {field} ({getattr(config, field)}) is not written by --target "
                                  "onnxruntime yet; use --target portable")
    if getattr(config, "use_bidirectional_attention", False):
        raise OrtDecoderError(f"{model_type}: bidirectional attention is not a causal decoder; use --target portable")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        raise OrtDecoderError(f"{model_type}: sliding-window attention ({window}) is not written by "
                              "--target onnxruntime yet; use --target portable")
    layers = lm.model.layers
    attn = layers[0].self_attn
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(attn, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads)
    return DecoderDims(
        model_type=model_type, layers=len(layers), hidden=int(config.hidden_size), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, vocab=int(config.vocab_size), max_positions=int(config.max_position_embeddings),
        scale=float(attn.scaling), activation=str(act),
    )


def lm_head_of(lm: torch.nn.Module) -> tuple[torch.Tensor, str]:
    """The LM head the model's forward uses (``get_output_embeddings()``): its [vocab, hidden]
    weight and its path. Never chosen by matching a Linear's output size to the vocabulary."""
    head = lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise OrtDecoderError(f"the model's output embedding is a {type(head).__name__}, not a Linear")
    if head.bias is not None:
        raise OrtDecoderError("an LM head with a bias is not written by --target onnxruntime yet")
    path = next((p for p, m in lm.named_modules() if m is head), "lm_head")
    embed = lm.get_input_embeddings()
    if embed is not None and head.weight is embed.weight:
        path = f"{path} (tied to {next(p for p, m in lm.named_modules() if m is embed)})"
    return head.weight, path


def rotary_caches(lm: torch.nn.Module, dims: DecoderDims, dtype: np.dtype,
                  layer_type: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, head_dim / 2] exactly as the model's ``rotary_emb`` computes them
    (float32 ``inv_freq`` times positions, times ``attention_scaling``), in the model dtype.
    ``layer_type``: Gemma3's rotary has one ``{layer_type}_inv_freq`` per attention type."""
    rotary = getattr(lm.model, "rotary_emb", None)
    prefix = f"{layer_type}_" if layer_type else ""
    inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise OrtDecoderError(f"the model has no rotary_emb.{prefix}inv_freq; --target onnxruntime writes rotary models")
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type, "default")
    if rope_type == "dynamic":
        raise OrtDecoderError("dynamic rotary scaling changes with the sequence length; use --target portable")
    if inv_freq.numel() * 2 != dims.head_dim:
        raise OrtDecoderError(f"partial rotary embeddings ({inv_freq.numel() * 2} of {dims.head_dim} dims) are not "
                              "written by --target onnxruntime yet")
    positions = torch.arange(dims.max_positions, dtype=torch.float32)
    # transformers: (inv_freq[:, None] @ position_ids[None, :]).T, in float32: an outer product.
    freqs = (inv_freq.float()[:, None] @ positions[None, :]).T
    scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return cos.numpy().astype(dtype), sin.numpy().astype(dtype)


# -- the graph ----------------------------------------------------------------------------
class _Writer:
    """Nodes and initializers, with unique names."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.np_dtype = numpy_dtype(dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def name(self, base: str) -> str:
        name, i = base, 1
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def node(self, op: str, inputs: list[str], base: str, *, outputs: int = 1, domain: str = "", **attrs: Any) -> list[str]:
        outs = [self.name(f"{base}/out{i}" if outputs > 1 else base) for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.name(f"{base}/{op}"), domain=domain or None,
                                           **attrs))
        return outs

    def one(self, op: str, inputs: list[str], base: str, **attrs: Any) -> str:
        return self.node(op, inputs, base, **attrs)[0]

    def init(self, name: str, array: np.ndarray) -> str:
        name = self.name(name)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def weight(self, name: str, tensor: torch.Tensor) -> str:
        return self.init(name, tensor.detach().to(torch.float32 if self.dtype == "float32" else torch.float16)
                         .cpu().numpy().astype(self.np_dtype))

    def linear_t(self, name: str, *weights: torch.Tensor) -> str:
        """[in, out] of one or more nn.Linear weights ([out, in]) side by side: a fused MatMul."""
        w = torch.cat([t.detach() for t in weights], dim=0).T
        return self.weight(name, w)


def _bias(writer: _Writer, name: str, x: str, *linears: torch.nn.Linear) -> str:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return x
    if any(b is None for b in biases):
        raise OrtDecoderError(f"{name}: some fused projections have a bias and some do not")
    return writer.one("Add", [x, writer.weight(f"{name}.bias", torch.cat([b.detach() for b in biases]))], name)


#: The op that adds the residual and normalizes in one kernel (ONNX Runtime's CPU and CUDA).
SKIP_NORM_OP = "SkipSimplifiedLayerNormalization"


def skip_refusal(spec: RMSNormSpec, dtype: str) -> str | None:
    """Why ``s = x + skip; norm(s)`` cannot be one ``SkipSimplifiedLayerNormalization`` exactly, or ``None``.

    ONNX Runtime 1.32 never fuses ``Add`` into ``SimplifiedLayerNormalization`` itself (its
    ``SkipLayerNormFusion`` matches ``LayerNormalization`` only), so the graph writes the op; it
    is written where it computes what the ``ort`` lowering of the spec computes after an exact
    ``Add``: float32 activations (the kernel normalizes the float32 sum; in float16 the model
    normalizes the sum rounded to float16 and the kernel does not), the gain a plain weight over
    the last dim, epsilon inside the square root, float32 accumulation.
    """
    reason = refusal("ort", spec, spec.upcasts(dtype), OPSET)
    if reason:
        return reason
    if dtype != "float32":
        return (f"{SKIP_NORM_OP} normalizes the float32 sum of its inputs; a {dtype} model normalizes the sum "
                f"rounded to {dtype}")
    if spec.gain != "weight":
        return f"{SKIP_NORM_OP} multiplies by a weight; this spec's gain is {spec.gain!r}"
    if spec.normalized_dims != 1:
        return f"{SKIP_NORM_OP} normalizes the last dim; this spec normalizes the last {spec.normalized_dims}"
    return None


def skip_norm_node(spec: RMSNormSpec, inputs: list[str], outputs: list[str], *, name: str) -> onnx.NodeProto:
    """``SkipSimplifiedLayerNormalization(input, skip, weight) -> (y, [sum])`` for ``spec``
    (check :func:`skip_refusal` first). ``outputs``: ``[y]`` or ``[y, sum]`` (``sum`` may be "")."""
    y, *rest = outputs
    outs = [y, "", "", rest[0]] if rest and rest[0] else [y]
    return helper.make_node(SKIP_NORM_OP, inputs, outs, name=name, domain=MS_DOMAIN, epsilon=float(spec.epsilon))


def build_decoder(loaded: LoadedModel, *, lowering: str = "function", share_buffer: bool = False,
                  max_length: int | None = None) -> OrtDecoder:
    """The ONNX Runtime decoder graph of ``loaded`` (a transformers Llama-family causal LM).

    Raises :class:`OrtDecoderError` for a model or option it cannot write exactly.
    """
    dtype = dtype_name(loaded.dtype)
    if dtype not in ORT_DTYPES:
        raise OrtDecoderError(f"--target onnxruntime writes {', '.join(ORT_DTYPES)} graphs (GroupQueryAttention has no "
                              f"{dtype} CPU kernel); export {dtype} with --target portable")
    lm = _causal_lm(loaded)
    dims = decoder_dims(lm)
    detection = detect_norms(loaded.module, dtype=dtype)
    by_path = {n.path: n for n in detection.norms}
    for norm in detection.norms:
        reason = refusal(lowering, norm.spec, norm.spec.upcasts(dtype), OPSET)
        if reason:
            raise OrtDecoderError(f"cannot lower norm {norm.path!r} to {lowering!r}: {reason}")
    prefix = next(p for p, m in loaded.module.named_modules() if m is lm)
    prefix = f"{prefix}." if prefix else ""

    w = _Writer(dtype)
    elem = onnx_type(dtype)
    # The ort lowering writes ONNX Runtime's ops: there the residual Add goes into the norm's op.
    skip_fusion = lowering == "ort"
    used_norms: list[str] = []

    def norm(module: torch.nn.Module, x: str, out: str | None = None) -> str:
        path = next(p for p, m in loaded.module.named_modules() if m is module)
        found = by_path.get(path)
        if found is None:
            raise OrtDecoderError(f"{path}: not a detected RMSNorm; the graph writes every norm as its exact spec")
        inputs = [x] + ([w.weight(f"{path}.weight", found.weight)] if found.spec.has_gain else [])
        y = out or w.name(f"{path}/output")
        w.nodes.append(rmsnorm_node(found.spec, dtype, inputs, [y], name=path))
        used_norms.append(path)
        return y

    def residual_norm(module: torch.nn.Module, hidden: str, branch: str, base: str, *,
                      keep_sum: bool = True) -> tuple[str, str]:
        """``s = hidden + branch`` and ``norm(s)``: (normalized, s). With ``skip_fusion`` one
        ``SkipSimplifiedLayerNormalization`` (its fourth output is ``s``), else ``Add`` and our node."""
        path = next(p for p, m in loaded.module.named_modules() if m is module)
        found = by_path.get(path)
        if not skip_fusion or found is None or skip_refusal(found.spec, dtype) is not None:
            total = w.one("Add", [hidden, branch], base)
            return norm(module, total), total
        y, total = w.name(f"{path}/output"), w.name(base) if keep_sum else ""
        w.nodes.append(skip_norm_node(found.spec, [hidden, branch, w.weight(f"{path}.weight", found.weight)],
                                      [y, total], name=path))
        used_norms.append(path)
        return y, total

    # Prelude. GroupQueryAttention keeps each row's cache compact: its valid tokens first, its
    # length seqlens_k + 1 = sum(attention_mask), positions = index in the row. The convention pads
    # on the left, so the chunk's tokens are reordered valid tokens first before the embedding
    # (as GQA reads them) and the final hidden state put back in the input's order before the
    # LM head. Positions then equal cumsum(attention_mask) - 1, which is what the convention's
    # position_ids hold (the input is accepted; GQA's rotary derives the same positions).
    i64 = lambda name, value: w.init(f"const/{name}", np.array(value, dtype=np.int64))  # noqa: E731
    one_1d, axes1 = i64("one_1d", [1]), i64("axes_1", [1])
    seq_1d = w.one("Shape", ["input_ids"], "mask/seq_1d", start=1, end=2)
    total_1d = w.one("Shape", ["attention_mask"], "mask/total_1d", start=1, end=2)
    chunk = w.one("Slice", ["attention_mask", w.one("Sub", [total_1d, seq_1d], "mask/past_1d"), total_1d, axes1],
                  "mask/chunk")
    # The chunk's valid slots first, in order, then its padded slots: TopK of the 0/1 mask with
    # ONNX's tie rule (equal values keep index order); for left padding, a rotation by the padding.
    # The way back is the inverse permutation: the ascending order of those indices.
    _, to_compact = w.node("TopK", [chunk, seq_1d], "mask/to_compact", outputs=2, axis=1, largest=1, sorted=1)
    _, back = w.node("TopK", [to_compact, seq_1d], "mask/to_original", outputs=2, axis=1, largest=0, sorted=1)
    ids = w.one("GatherElements", ["input_ids", to_compact], "mask/input_ids_compact", axis=1)
    lengths = w.one("ReduceSum", ["attention_mask", axes1], "mask/lengths", keepdims=0)  # [batch]
    seqlens = w.one("Cast", [w.one("Sub", [lengths, one_1d], "mask/seqlens64")], "mask/seqlens_k",
                    to=TensorProto.INT32)
    # GroupQueryAttention's total_sequence_length: a scalar or, as here, a one-element vector.
    total_i32 = w.one("Cast", [total_1d], "mask/total_sequence_length", to=TensorProto.INT32)

    layer_types = list(getattr(lm.config, "layer_types", None) or [None] * dims.layers)
    caches: dict[str | None, tuple[str, str]] = {}
    for kind in dict.fromkeys(layer_types):  # one cos/sin pair per rotary (Gemma3: local and global)
        cos, sin = rotary_caches(lm, dims, w.np_dtype, kind if kind in _rotary_types(lm) else None)
        tag = f"_{kind}" if kind in _rotary_types(lm) else ""
        caches[kind] = (w.init(f"cos_cache{tag}", cos), w.init(f"sin_cache{tag}", sin))

    embed = lm.get_input_embeddings()
    hidden = w.one("Gather", [w.weight(f"{prefix}model.embed_tokens.weight", embed.weight), ids], "embed")
    embed_scale = getattr(embed, "embed_scale", None)
    if isinstance(embed_scale, torch.Tensor):
        # Gemma: embedding * embed_scale, the scale rounded to the weight's dtype first (as transformers does).
        scale = embed_scale.detach().to(embed.weight.dtype).reshape(())
        hidden = w.one("Mul", [hidden, w.weight(f"{prefix}model.embed_tokens.embed_scale", scale)], "embed/scale")
    q_size, kv_size = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    def attention(i: int, layer: torch.nn.Module, x: str, base: str) -> str:
        attn = layer.self_attn
        qkv = w.one("MatMul", [x, w.linear_t(f"{base}.self_attn.qkv_proj.weight", attn.q_proj.weight, attn.k_proj.weight,
                                               attn.v_proj.weight)], f"{base}/attn/qkv")
        qkv = _bias(w, f"{base}/attn/qkv", qkv, attn.q_proj, attn.k_proj, attn.v_proj)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is not None or k_norm is not None:
            split = w.init(f"{base}/attn/split", np.array([q_size, kv_size, kv_size], dtype=np.int64))
            q, k, v = w.node("Split", [qkv, split], f"{base}/attn/split", outputs=3, axis=-1)
            q = _head_norm(w, norm, q_norm, q, dims.heads, dims.head_dim, f"{base}/attn/q")
            k = _head_norm(w, norm, k_norm, k, dims.kv_heads, dims.head_dim, f"{base}/attn/k")
            qkv_inputs = [q, k, v]
        else:
            qkv_inputs = [qkv, "", ""]  # packed
        gqa_out = w.node(
            "GroupQueryAttention",
            qkv_inputs + [f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens, total_i32,
                          *caches[layer_types[i]]],
            f"{base}/attn/gqa", outputs=3, domain=MS_DOMAIN,
            num_heads=dims.heads, kv_num_heads=dims.kv_heads, scale=dims.scale, do_rotary=1, rotary_interleaved=0,
            local_window_size=-1,
        )
        # The present outputs carry the convention's names.
        gqa_node = w.nodes[-1]
        gqa_node.output[1], gqa_node.output[2] = f"present.{i}.key", f"present.{i}.value"
        o = w.one("MatMul", [gqa_out[0], w.linear_t(f"{base}.self_attn.o_proj.weight", attn.o_proj.weight)],
                  f"{base}/attn/o_proj")
        return _bias(w, f"{base}/attn/o_proj", o, attn.o_proj)

    def feed_forward(layer: torch.nn.Module, x: str, base: str) -> str:
        # Gate and up as two MatMuls on the same input, not one fused MatMul and a Split: the
        # Split copies both halves every step, and ONNX Runtime runs two MatMuls as fast as one.
        mlp = layer.mlp
        gate = w.one("MatMul", [x, w.linear_t(f"{base}.mlp.gate_proj.weight", mlp.gate_proj.weight)], f"{base}/mlp/gate")
        gate = _bias(w, f"{base}/mlp/gate", gate, mlp.gate_proj)
        up = w.one("MatMul", [x, w.linear_t(f"{base}.mlp.up_proj.weight", mlp.up_proj.weight)], f"{base}/mlp/up")
        up = _bias(w, f"{base}/mlp/up", up, mlp.up_proj)
        if dims.activation == "gelu_pytorch_tanh":
            act = w.one("Gelu", [gate], f"{base}/mlp/gelu", approximate="tanh")
        else:
            act = w.one("Mul", [gate, w.one("Sigmoid", [gate], f"{base}/mlp/sigmoid")], f"{base}/mlp/silu")
        down = w.one("MatMul", [w.one("Mul", [act, up], f"{base}/mlp/gated"),
                                w.linear_t(f"{base}.mlp.down_proj.weight", mlp.down_proj.weight)], f"{base}/mlp/down")
        return _bias(w, f"{base}/mlp/down", down, mlp.down_proj)

    if dims.model_type in POST_SUBLAYER_TYPES:
        # OLMo2: h = h + norm(attn(h)); h = h + norm(mlp(h)); the final norm. Each norm comes before
        # its Add, so there is no residual to fold into a norm.
        for i, layer in enumerate(lm.model.layers):
            base = f"{prefix}model.layers.{i}"
            hidden = w.one("Add", [hidden, norm(layer.post_attention_layernorm, attention(i, layer, hidden, base))],
                           f"{base}/attn/residual")
            hidden = w.one("Add", [hidden, norm(layer.post_feedforward_layernorm, feed_forward(layer, hidden, base))],
                           f"{base}/mlp/residual")
        x = norm(lm.model.norm, hidden)
    else:
        pending: str | None = None  # the MLP output of the layer before, not yet added to the residual stream
        sandwich = hasattr(lm.model.layers[0], "pre_feedforward_layernorm")
        for i, layer in enumerate(lm.model.layers):
            base = f"{prefix}model.layers.{i}"
            if pending is None:
                x = norm(layer.input_layernorm, hidden)
            else:
                x, hidden = residual_norm(layer.input_layernorm, hidden, pending,
                                          f"{prefix}model.layers.{i - 1}/mlp/residual")
            o = attention(i, layer, x, base)
            if sandwich:  # Gemma3: norms before and after each sublayer
                o = norm(layer.post_attention_layernorm, o)
                x, hidden = residual_norm(layer.pre_feedforward_layernorm, hidden, o, f"{base}/attn/residual")
                pending = norm(layer.post_feedforward_layernorm, feed_forward(layer, x, base))
            else:
                x, hidden = residual_norm(layer.post_attention_layernorm, hidden, o, f"{base}/attn/residual")
                pending = feed_forward(layer, x, base)  # added with the next norm
        assert pending is not None
        x, _ = residual_norm(lm.model.norm, hidden, pending, f"{prefix}model.layers.{dims.layers - 1}/mlp/residual",
                             keep_sum=False)
    head_weight, head_path = lm_head_of(lm)
    # Back to the input's order before the LM head (each row of the head is computed alone): the
    # hidden size is moved, not the vocabulary.
    back_3d = w.one("Unsqueeze", [back, i64("axes_last", [-1])], "mask/to_original_3d")
    x = w.one("GatherND", [x, back_3d], "final_norm/to_original", batch_dims=1)
    w.nodes.append(helper.make_node("MatMul", [x, w.linear_t(f"{prefix}lm_head.weight", head_weight)], ["logits"],
                                    name="lm_head/MatMul"))

    missing = [p for p in by_path if p not in used_norms]
    if missing:
        raise OrtDecoderError(f"{len(missing)} detected norm(s) are not on the graph's path ({', '.join(missing[:3])}); "
                              "this model's structure is not the Llama family's")
    cache_len = "max_length" if share_buffer else "past"
    present_len = "max_length" if share_buffer else "total"
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
    graph = helper.make_graph(w.nodes, f"{loaded.name}-kv-{TARGET}", inputs, outputs, w.inits)
    model = helper.make_model(graph, producer_name="rmsnorm-deploy",
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = ir_version_for(model.opset_import)
    model = lower_model(model, lowering)
    max_len = int(max_length or dims.max_positions)
    if not 1 <= max_len <= dims.max_positions:
        raise OrtDecoderError(f"max_length {max_len} is outside the model's 1..{dims.max_positions} positions")
    ModelMetadata(
        specs=detection.specs, lowering=lowering, dtype=dtype, source=loaded.source,
        inputs=_inputs_meta(dims, dtype, share_buffer, loaded.vocab_size),
        dims={"batch": [1, 1, 8], "sequence": [1, 1, max_len], "past": [0, 0, max_len - 1], "total": [1, 1, max_len]},
        versions=tool_versions(),
        kv_cache=kv_cache_metadata(dims, dtype, share_buffer=share_buffer, max_length=max_len, head=head_path),
    ).write(model)
    return OrtDecoder(model, dims, detection, len(used_norms), head_path)


def _rotary_types(lm: torch.nn.Module) -> tuple[str, ...]:
    """The layer types with their own rotary tables (Gemma3's ``{type}_inv_freq``); () for one table."""
    rotary = getattr(lm.model, "rotary_emb", None)
    kinds = getattr(rotary, "layer_types", None) or ()
    return tuple(k for k in kinds if isinstance(getattr(rotary, f"{k}_inv_freq", None), torch.Tensor))


def _head_norm(w: _Writer, norm: Any, module: torch.nn.Module | None, x: str, heads: int, head_dim: int,
               base: str) -> str:
    """A q/k norm: per head (Qwen3's, a weight of head_dim): [B, S, H*D] -> [B, S, H, D] -> norm ->
    back; or over all heads (OLMo2's, a weight of H*D): the norm on [B, S, H*D] as it is."""
    if module is None:
        return x
    weight = getattr(module, "weight", None)
    width = int(weight.numel()) if isinstance(weight, torch.Tensor) else head_dim
    if width == heads * head_dim and width != head_dim:
        return norm(module, x)
    if width != head_dim:
        raise OrtDecoderError(f"{base}: a q/k norm over {width} values is neither per head ({head_dim}) nor over "
                              f"all {heads} heads ({heads * head_dim})")
    to_heads = w.init(f"{base}/heads_shape", np.array([0, 0, heads, head_dim], dtype=np.int64))
    flat = w.init(f"{base}/flat_shape", np.array([0, 0, heads * head_dim], dtype=np.int64))
    y = norm(module, w.one("Reshape", [x, to_heads], f"{base}/to_heads"))
    return w.one("Reshape", [y, flat], f"{base}/flat")


def kv_cache_metadata(dims: DecoderDims, dtype: str, *, share_buffer: bool, max_length: int,
                      head: str) -> dict[str, Any]:
    """The ``kv_cache`` entry of the metadata: the convention's fields (the keys of
    ``decoder.convention.KVCacheLayout``), the target, its buffer mode and the LM head used."""
    return {
        "convention": CONVENTION,
        "target": TARGET,
        "past_present_share_buffer": bool(share_buffer),
        "num_layers": dims.layers,
        "num_heads": dims.heads,
        "kv_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_size": dims.hidden,
        "vocab_size": dims.vocab,
        "max_length": int(max_length),
        "dtype": dtype,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"},
        "lm_head": head,
    }


def _inputs_meta(dims: DecoderDims, dtype: str, share_buffer: bool, vocab: int) -> dict[str, dict[str, Any]]:
    cache = "max_length" if share_buffer else "past"
    meta: dict[str, dict[str, Any]] = {
        "input_ids": {"dtype": "int64", "shape": ["batch", "sequence"], "kind": "token_ids", "high": int(vocab)},
        "attention_mask": {"dtype": "int64", "shape": ["batch", "total"], "kind": "attention_mask"},
        "position_ids": {"dtype": "int64", "shape": ["batch", "sequence"], "kind": "position_ids"},
    }
    for i in range(dims.layers):
        for kind in ("key", "value"):
            meta[f"past_key_values.{i}.{kind}"] = {"dtype": dtype, "shape": ["batch", dims.kv_heads, cache, dims.head_dim],
                                                   "kind": "kv_cache"}
    return meta


# -- audit, parity and the export ---------------------------------------------------------
def audit_norms(model: onnx.ModelProto, norm_nodes: int) -> int:
    """As many RMSNorm reductions as norm nodes, every one accumulating in float32 or wider."""
    from rmsnorm_deploy.graph.audit import audit_model

    reductions = [r for r in audit_model(model) if r.kind in ("RMSNorm", "RMSNorm (skip)")]
    if len(reductions) != norm_nodes:
        raise OrtDecoderError(f"the graph holds {len(reductions)} RMSNorm reductions for {norm_nodes} norm nodes")
    low = [r for r in reductions if r.low_precision]
    if low:
        raise OrtDecoderError(f"{len(low)} RMSNorm reduction(s) accumulate in {low[0].accumulation} "
                              f"(first: {low[0].node}); they must stay in float32")
    return len(reductions)


@dataclasses.dataclass
class DecodeParity:
    """Per-step logits of the graph against transformers running with its own cache."""

    results: list[Any]  # contract.compare.CompareResult, one per step (prefill first)
    tokens_equal: bool

    @property
    def failed(self) -> bool:
        return not self.results or not self.tokens_equal or not all(self.results)

    @property
    def status(self) -> str:
        return "fail" if self.failed else "pass"

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "tokens_equal": self.tokens_equal, "steps": [r.to_dict() for r in self.results]}

    def table(self) -> str:
        return "\n".join(r.summary() for r in self.results) + f"\ngreedy tokens equal to transformers: {self.tokens_equal}"


def decode_parity(loaded: LoadedModel, model: Any, *, batch: int = 2, prompt: int = 16, steps: int = 4,
                  seed: int = 0) -> DecodeParity:
    """Prefill and ``steps`` greedy decode steps of ``model`` (a ModelProto or path) in ONNX Runtime
    CPU against transformers eager with its cache, rows left-padded by different amounts; per
    step, the last position's logits are compared (tolerance ``("model", "onnxruntime", dtype)``)."""
    from rmsnorm_deploy.contract.compare import compare
    from rmsnorm_deploy.contract.inputs import token_ids
    from rmsnorm_deploy.contract.tolerances import tolerance_for
    from rmsnorm_deploy.decoder.loop import KVDecoderRunner
    from rmsnorm_deploy.decoder.transformers_step import transformers_steps

    dtype = dtype_name(loaded.dtype)
    lm = _causal_lm(loaded)
    ids = token_ids((batch, prompt), loaded.vocab_size, seed=seed).astype(np.int64)
    mask = np.ones_like(ids)
    for row in range(1, batch):
        mask[row, : min(prompt - 1, 2 * row)] = 0  # left padding, different per row
    runner = KVDecoderRunner(model, dtype=numpy_dtype(dtype))
    got = runner.greedy(ids, mask, new_tokens=steps + 1, keep_logits=True)
    expected = transformers_steps(lm, ids, mask, new_tokens=steps + 1)
    tolerance = tolerance_for("model", "onnxruntime", dtype)
    results = [compare(g, e, tolerance, name=f"logits step {i}" if i else "logits prefill", dtype=dtype)
               for i, (g, e) in enumerate(zip(got.step_logits, expected.step_logits))]
    return DecodeParity(results, bool(np.array_equal(expected.tokens, got.tokens)))


@dataclasses.dataclass
class OrtDecoderExport:
    path: Any
    decoder: OrtDecoder
    parity: DecodeParity | None
    report_path: Any = None
    #: written beside the model: genai_config.json and the source's Hugging Face config/tokenizer files
    serving_files: list[str] = dataclasses.field(default_factory=list)

    @property
    def parity_failed(self) -> bool:
        return self.parity is not None and self.parity.failed


def export_ort_decoder(loaded: LoadedModel, plan: Any, *, progress: Any = None, share_buffer: bool = False,
                       max_length: int | None = None) -> OrtDecoderExport:
    """``export --kv-cache --target onnxruntime``: write, audit, save atomically, check parity.

    ``plan``: an ``exporter.plan.ExportPlan`` (options and paths checked once). The parity
    failure is not an exception: see ``OrtDecoderExport.parity_failed``.
    """
    import json

    from rmsnorm_deploy.decoder.genai_config import write_serving_files
    from rmsnorm_deploy.decoder.convention import KVCacheLayout
    from rmsnorm_deploy.graph.onnx_file import atomic_path, save_onnx
    from rmsnorm_deploy.progress import Progress

    options = plan.options
    progress = progress or Progress(enabled=False)
    if dtype_name(loaded.dtype) != options.dtype:
        raise UserError(f"the model was loaded in {loaded.dtype} but the export asks for {options.dtype}")
    with progress.stage("writing the ONNX Runtime decoder graph (GroupQueryAttention, fused projections)") as st:
        decoder = build_decoder(loaded, lowering=options.lowering, share_buffer=share_buffer, max_length=max_length)
        audited = audit_norms(decoder.model, decoder.norm_nodes)
        st.note(f"{len(decoder.model.graph.node)} nodes, {audited} norm nodes audited in float32")
    with progress.stage(f"saving {plan.model_path}") as st:
        save_onnx(decoder.model, plan.model_path, force=options.force)
    max_len = int(max_length or decoder.dims.max_positions)
    layout = KVCacheLayout.from_dict(kv_cache_metadata(decoder.dims, options.dtype, share_buffer=share_buffer,
                                                       max_length=max_len, head=decoder.lm_head))
    with progress.stage("writing genai_config.json and the Hugging Face files beside it") as st:
        serving_files = write_serving_files(plan.model_path, layout, loaded.source, force=options.force)
        st.note(", ".join(serving_files))
    result = OrtDecoderExport(plan.model_path, decoder, None, serving_files=serving_files)
    if options.parity:
        with progress.stage("parity: ONNX Runtime CPU vs transformers with its cache (prefill + 4 steps)") as st:
            result.parity = decode_parity(loaded, str(plan.model_path), batch=options.batch, prompt=options.seq,
                                          seed=options.seed)
            st.note(result.parity.status)
        report = {
            "model": str(plan.model_path), "name": loaded.name, "dtype": options.dtype, "lowering": options.lowering,
            "kv_cache": kv_cache_metadata(decoder.dims, options.dtype, share_buffer=share_buffer,
                                          max_length=max_len, head=decoder.lm_head),
            "serving_files": serving_files,
            "nodes": len(decoder.model.graph.node), "norms": [n.to_dict() for n in decoder.detection.norms],
            "parity": result.parity.to_dict(), "versions": tool_versions(),
        }
        with atomic_path(plan.report_path, force=options.force) as tmp:
            tmp.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
        result.report_path = plan.report_path
    return result
