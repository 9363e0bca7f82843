"""The ONNX Runtime decoder graph with a KV cache, written node by node from a model's modules.

``export --kv-cache --target onnxruntime`` writes this graph. It is not traced: like
onnxruntime-genai's model builder, it walks the module tree of a Llama-family causal LM
(``model.embed_tokens``, ``model.layers[i]``, ``model.norm`` and the module the model's
forward uses as its LM head, ``get_output_embeddings()``) and emits, per layer:

- the input norm as our exact ``rmsnorm_deploy::RMSNorm`` node (any lowering, see
  ``graph/lowerings.py``; ONNX Runtime fuses the ``function`` body into
  ``SimplifiedLayerNormalization``), its spec confirmed bit for bit by ``detect.py``;
- one fused Q/K/V ``MatMul`` (plus its bias where the model has one), or with ``--quantize`` one
  ``com.microsoft.MatMulNBits`` holding ONNX Runtime's int8/int4 packing of the same weights
  (``quantize``; the norms stay our exact nodes, in float32);
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

Where it is written: ``families`` says what each model family is (one module each),
``ort_model`` reads what the graph needs from the model (dimensions, LM
head, rotary tables, refusals), ``ort_builder`` writes it part by part, reading the weights from
a tensor source (``weights``) into a sink (``ort_writer``: in memory, or streamed to the
external-data file), ``ort_parity`` audits its norms and holds it to transformers (to the
dequantized model when it is quantized), ``ort_export`` is the export command's run.
"""

from __future__ import annotations

import dataclasses

import onnx

from rmsnorm_deploy.decoder.ort_builder import OrtDecoderBuilder
from rmsnorm_deploy.decoder.ort_model import DecoderDims
from rmsnorm_deploy.decoder.ort_writer import ExternalData, InMemory
from rmsnorm_deploy.decoder.quantize import Quantization, QuantizedLinear
from rmsnorm_deploy.decoder.weights import TensorSource
from rmsnorm_deploy.exporter.detect import Detection
from rmsnorm_deploy.exporter.loaded_model import LoadedModel


@dataclasses.dataclass
class OrtDecoder:
    """The written graph and what was found on the way."""

    model: onnx.ModelProto
    dims: DecoderDims
    detection: Detection
    norm_nodes: int
    lm_head: str  # the module path of the LM head (or "lm_head (tied to <embedding path>)")
    quantization: Quantization | None = None
    #: one per MatMulNBits: its packed weight, scales and the Linear modules it holds
    quantized: list[QuantizedLinear] = dataclasses.field(default_factory=list)


def build_decoder(loaded: LoadedModel, *, lowering: str = "function", share_buffer: bool = False,
                  max_length: int | None = None, quantization: Quantization | None = None,
                  tensors: TensorSource | None = None, sink: InMemory | ExternalData | None = None,
                  detection: Detection | None = None) -> OrtDecoder:
    """The ONNX Runtime decoder graph of ``loaded`` (a transformers Llama-family causal LM).

    ``tensors``: where the projections' and embedding's weights are read (default: the modules);
    ``sink``: where the initializers go (default: into the graph). Raises
    :class:`~rmsnorm_deploy.decoder.ort_model.OrtDecoderError` for a model or option it cannot
    write exactly.
    """
    builder = OrtDecoderBuilder(loaded, tensors=tensors, lowering=lowering, share_buffer=share_buffer,
                                max_length=max_length, quantization=quantization, sink=sink, detection=detection)
    model = builder.build()
    return OrtDecoder(model, builder.dims, builder.detection, len(builder.used_norms), builder.head_path,
                      quantization, builder.quantized)
