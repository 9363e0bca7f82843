"""Parity of a model too large to load whole: each layer alone, then the final logits, on one prompt.

A streamed export (``streaming``) of a model that does not fit in memory beside ONNX Runtime cannot
be compared with transformers running the whole model. :func:`layer_parity` compares it one layer
at a time instead, so that memory holds at most one layer of PyTorch weights:

1. the graph runs a short unpadded prompt (batch 1: its tokens stay in their order) with its
   embedding output and the residual stream after each layer but the last added as outputs
   (a copy of the graph beside its external data, removed afterwards);
2. transformers' own forward runs on the graph's embedding output; before each decoder layer
   runs, its weights are read from the checkpoint (the dequantized values from the graph for a
   quantized layer, ``quantize.dequantized_reference``) and its input is replaced by the graph's
   residual stream before it, so each layer is compared alone; after it, its output is compared
   with the graph's and its weights go back to the meta device;
3. the final norm's output times the LM head, read in blocks of rows, against the graph's logits.

Tolerances are the one-layer rows of the tolerance table (``ort_parity.LAYER_CHECKS``): each layer runs on
the graph's own input, so rounding differences do not compound over depth as in a whole-model run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper

from rmsnorm_deploy.contract.compare import CompareResult, compare
from rmsnorm_deploy.contract.dtypes import dtype_name, onnx_type, torch_dtype
from rmsnorm_deploy.contract.inputs import token_ids
from rmsnorm_deploy.contract.tolerances import tolerance_at_scale
from rmsnorm_deploy.decoder.convention import empty_past, layout_of
from rmsnorm_deploy.decoder.ort_model import OrtDecoderError, causal_lm, embedding_output, residual_output
from rmsnorm_deploy.decoder.ort_parity import (
    LAYER_CHECKS,
    ParityVerdict,
    decisive_tokens_equal,
    reference_name,
)
from rmsnorm_deploy.decoder.quantize import (
    channel_head,
    dequantize,
    dequantized_reference,
    quantization_of,
    reference_compute,
    WeightCheck,
    read_channel,
    read_initializer,
    read_smoothing,
    round_activations,
    scale_rounding,
    smoothed_weight,
    zero_points_of,
)
from rmsnorm_deploy.decoder.weights import TensorSource, parameter_names
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.runners.int8_gemm import exact_integer_matmuls

#: Rows of the LM head multiplied at a time.
HEAD_BLOCK_ROWS = 8192


@dataclasses.dataclass
class LayerParity(ParityVerdict):
    """Each layer's output and the final logits of the graph (``results``) against transformers,
    layer by layer; ``tokens_equal``: the greedy token after the prompt."""

    reference: str
    tolerance_key: tuple[str, str, str]
    prompt: int

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "kind": "layer by layer", "prompt": self.prompt,
                "tokens_equal": self.tokens_equal, "reference": self.reference,
                "tolerance": list(self.tolerance_key), "steps": [r.to_dict() for r in self.results]}

    def table(self) -> str:
        lines = [f"layer by layer on a {self.prompt}-token prompt; reference: {self.reference}; "
                 f"tolerance {self.tolerance_key}"]
        lines += [r.summary() for r in self.results]
        lines.append(f"next token equal to the reference's: {self.tokens_equal}")
        return "\n".join(lines)


def _graph_outputs(model_path: Path, proto: onnx.ModelProto, names: list[str], feed: dict[str, np.ndarray],
                   dtype: str) -> dict[str, np.ndarray]:
    """``logits`` and the tensors ``names`` of one run of the graph, through a copy of it whose
    outputs include them, written beside its external data and removed afterwards."""
    ort = require("onnxruntime", "checking a graph layer by layer")
    present = {o for n in proto.graph.node for o in n.output}
    missing = [n for n in names if n not in present]
    if missing:
        raise OrtDecoderError(f"the graph has no tensor {missing[0]!r}; the layer-by-layer check reads the "
                              "residual stream the onnxruntime target writes: export it again")
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    copy.graph.output.extend(helper.make_tensor_value_info(n, onnx_type(dtype), None) for n in names)
    fd, tmp = tempfile.mkstemp(prefix=f".{model_path.name}.", suffix=".layers.tmp", dir=model_path.parent)
    os.close(fd)
    try:
        onnx.save_model(copy, tmp)
        # exact int8 sums on CPUs without VNNI, as every session of ours (a per-channel head's MatMulInteger)
        session = ort.InferenceSession(tmp, exact_integer_matmuls(ort.SessionOptions()),
                                       providers=["CPUExecutionProvider"])
        values = session.run(["logits", *names], feed)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dict(zip(["logits", *names], values))


class _LayerByLayer:
    """Hooks on each decoder layer: its weights in, its input the graph's, its output compared."""

    def __init__(self, loaded: LoadedModel, tensors: TensorSource, proto: onnx.ModelProto, folder: Path,
                 graph: dict[str, np.ndarray], key: tuple[str, str, str], prefix: str):
        self.loaded, self.tensors, self.proto, self.folder, self.graph = loaded, tensors, proto, folder, graph
        self.key, self.prefix = key, prefix
        self.lm = causal_lm(loaded)
        self.names = parameter_names(self.lm)
        self.paths = {id(m): p for p, m in loaded.module.named_modules()}
        self.entry = ModelMetadata.read(proto).quantization
        self.dtype = dtype_name(loaded.dtype)
        self.results: list[CompareResult] = []
        self.weights = WeightCheck()
        self._open: contextlib.ExitStack | None = None

    def _materialize(self, layer: torch.nn.Module, stack: contextlib.ExitStack) -> None:
        for module in layer.modules():
            for attr, param in list(module.named_parameters(recurse=False)):
                if not param.is_meta:
                    continue
                name = self.names[id(param)]
                value = self.tensors.get(name).to(param.dtype)
                if tuple(value.shape) != tuple(param.shape):
                    raise OrtDecoderError(f"tensor {name!r} has shape {list(value.shape)}, the model {list(param.shape)}")
                setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))
                stack.callback(setattr, module, attr, param)

    def before(self, index: int, layer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        stack = contextlib.ExitStack()
        self._materialize(layer, stack)
        if self.entry is not None:
            stack.enter_context(dequantized_reference(self.loaded.module, self.proto, self.entry, base_dir=self.folder,
                                                      under=self.paths[id(layer)], check=self.weights))
        self._open = stack
        if index:  # layer 0's input is the graph's embedding output already
            hidden = torch.from_numpy(self.graph[residual_output(self.prefix, index - 1)])
            args = (hidden.to(args[0].dtype), *args[1:])
        return args, kwargs

    def after(self, index: int, output: Any) -> None:
        assert self._open is not None
        self._open.close()
        self._open = None
        name = residual_output(self.prefix, index)
        if name in self.graph:
            hidden = (output[0] if isinstance(output, tuple) else output).float().numpy()
            tolerance = tolerance_at_scale(*self.key, float(np.abs(hidden).max()))
            self.results.append(compare(self.graph[name], hidden, tolerance, name=f"layer {index} output",
                                        dtype=self.dtype))

    def head_logits(self, x: torch.Tensor) -> np.ndarray:
        """``x @ W.T`` for the LM head read in blocks of rows (dequantized from the graph when quantized)."""
        head = self.lm.get_output_embeddings()
        path = self.paths[id(head)]
        linears = quantization_of(self.entry)[1] if self.entry is not None else []
        quantized = next((lin for lin in linears if lin.parts[0][0] == path), None)
        q = quantization_of(self.entry)[0] if quantized is not None else None
        if quantized is not None and quantized.width.per_channel:
            return self._channel_logits(x, head, path, quantized)
        smooth = (torch.from_numpy(read_smoothing(self.proto, quantized, self.folder))
                  if quantized is not None and quantized.smoothing else None)
        if smooth is not None:  # the graph's Mul before the head (int8-smooth)
            x = x * smooth.to(x.dtype)
        if q is not None and q.compute == "int8":
            x = round_activations(x, q.block_size)
        packed = read_initializer(self.proto, quantized.packed, self.folder) if quantized else None
        scales = read_initializer(self.proto, quantized.scales, self.folder) if quantized else None
        zero = (read_initializer(self.proto, quantized.zero_points, self.folder)
                if quantized is not None and quantized.zero_points else None)
        if quantized is not None and quantized.offsets:
            raise UserError("the LM head has block offsets, which this layer-by-layer check does not model; "
                            "export the head with another --quantize recipe")
        blocks = []
        for start in range(0, int(head.out_features), HEAD_BLOCK_ROWS):
            stop = min(int(head.out_features), start + HEAD_BLOCK_ROWS)
            w = self.tensors.rows(self.names[id(head.weight)], start, stop)
            if quantized is not None and q is not None:
                bits, rows = quantized.width.bits, None if zero is None else zero[start:stop]
                deq = dequantize(packed[start:stop], scales[start:stop], rows, bits=bits, block_size=q.block_size,
                                 k=quantized.k).T.copy()
                self.weights.add(path, w if smooth is None else smoothed_weight(w, smooth, torch_dtype(self.dtype)), deq,
                                 scales[start:stop], zero_points_of(rows, bits, scales[start:stop].shape),
                                 quantized.width, q.block_size, scale_rounding(self.dtype))
                w = torch.from_numpy(deq)
            blocks.append((x @ w.to(x.dtype).T).float())
        return torch.cat(blocks, dim=-1).numpy()

    def _channel_logits(self, x: torch.Tensor, head: torch.nn.Module, path: str, lin: Any) -> np.ndarray:
        """A per-channel head (``quantize.channel_head``) in blocks of its rows, each block's int8 rows
        checked against the model's weights in the smoothed space."""
        table, scales, smoothing = read_channel(self.proto, lin, self.folder)
        smooth = torch.from_numpy(smoothing)
        blocks = []
        for start in range(0, int(head.out_features), HEAD_BLOCK_ROWS):
            stop = min(int(head.out_features), start + HEAD_BLOCK_ROWS)
            w = self.tensors.rows(self.names[id(head.weight)], start, stop)
            rows, s = np.array(table[start:stop]), np.array(scales[start:stop], np.float32)
            self.weights.add(path, w.float() / smooth, rows.astype(np.float32) * s[:, None], s[:, None],
                             np.full((stop - start, 1), 127.0, np.float32), lin.width, lin.k)
            blocks.append(channel_head(x, torch.from_numpy(rows), torch.from_numpy(s), smooth).float())
        return torch.cat(blocks, dim=-1).numpy()


def layer_parity(loaded: LoadedModel, tensors: TensorSource, model_path: str | os.PathLike, *, prompt: int = 8,
                 seed: int = 0) -> LayerParity:
    """The graph at ``model_path`` against ``loaded`` (a streamed model: weights on the meta device,
    read from ``tensors``) layer by layer on a ``prompt``-token prompt (see the module docstring)."""
    path = Path(model_path)
    proto = onnx.load(str(path), load_external_data=False)
    meta = ModelMetadata.read(proto)
    layout = layout_of(meta, what=str(path))
    lm = causal_lm(loaded)
    dtype = dtype_name(loaded.dtype)
    prefix = next(p for p, m in loaded.module.named_modules() if m is lm)
    prefix = f"{prefix}." if prefix else ""
    ids = token_ids((1, prompt), loaded.vocab_size, seed=seed).astype(np.int64)
    positions = np.arange(prompt, dtype=np.int64)[None, :]
    past = empty_past(layout, 1)
    if layout.past_present_share_buffer:  # one max-length buffer bound to past and present
        past = {n: np.zeros((1, layout.kv_heads, layout.max_length, layout.head_dim), v.dtype) for n, v in past.items()}
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": positions, **past}
    names = [embedding_output(proto), *(residual_output(prefix, i) for i in range(layout.num_layers - 1))]
    graph = _graph_outputs(path, proto, names, feed, dtype)
    compute = reference_compute(*quantization_of(meta.quantization)) if meta.quantization is not None else None
    key = (LAYER_CHECKS[compute], "onnxruntime", dtype)
    check = _LayerByLayer(loaded, tensors, proto, path.parent, graph, key, prefix)
    handles = []
    for i, layer in enumerate(lm.model.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, k, i=i: check.before(i, m, a, k), with_kwargs=True))
        handles.append(layer.register_forward_hook(lambda m, a, out, i=i: check.after(i, out)))
    try:
        with torch.no_grad():
            hidden = lm.model(inputs_embeds=torch.from_numpy(graph[names[0]]).to(torch.float32 if dtype == "float32"
                                                                                   else torch.float16),
                              attention_mask=torch.from_numpy(feed["attention_mask"]),
                              position_ids=torch.from_numpy(positions), use_cache=False).last_hidden_state
            logits = check.head_logits(hidden)
    finally:
        for handle in handles:
            handle.remove()
    tolerance = tolerance_at_scale(*key, float(np.abs(logits).max()))
    results = [*([check.weights] if meta.quantization is not None else []), *check.results,
               compare(graph["logits"], logits, tolerance, name="logits", dtype=dtype)]
    if compute == "int8":  # a near tie may go either way (see ort_parity)
        same = decisive_tokens_equal(logits[:, -1:], graph["logits"][:, -1:].argmax(-1), 2 * tolerance.atol)[0]
    else:
        same = bool(np.array_equal(graph["logits"][:, -1].argmax(-1), logits[:, -1].argmax(-1)))
    linears = quantization_of(meta.quantization)[1] if meta.quantization is not None else []
    return LayerParity(results, same, reference_name(compute, linears), key, prompt)
