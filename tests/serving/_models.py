"""Small ONNX graphs shaped like what the serving code meets: a KV-cache decoder step, a graph
without a batch dim, a model with external data. Built here so the tests need no export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = [helper.make_opsetid("", 18)]


def kv_cache_model(path: Path, *, layers: int = 2, kv_heads: int = 2, head_dim: int = 4,
                   drop_present: int | None = None) -> Path:
    """A graph in the optimum/onnxruntime-genai KV-cache convention (``past_key_values.{i}.key/value``
    [batch, kv_heads, past, head_dim] -> ``present.{i}.key/value`` [batch, kv_heads, past + seq, head_dim]).

    Each layer's new keys/values are the float ids broadcast to the cache's shape, so the graph runs
    in ONNX Runtime; ``drop_present`` leaves out one layer's ``present`` outputs (a broken pairing).
    """
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 1])]
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["ids_f", "axis_last"], ["logits"]),
        helper.make_node("Unsqueeze", ["ids_f", "axes_1_3"], ["new_kv0"]),  # [batch, 1, seq, 1]
        helper.make_node("Expand", ["new_kv0", "kv_shape"], ["new_kv"]),
    ]
    inits = [
        helper.make_tensor("axis_last", TensorProto.INT64, [1], [2]),
        helper.make_tensor("axes_1_3", TensorProto.INT64, [2], [1, 3]),
        helper.make_tensor("kv_shape", TensorProto.INT64, [4], [1, kv_heads, 1, head_dim]),
    ]
    for i in range(layers):
        for kind in ("key", "value"):
            past, present = f"past_key_values.{i}.{kind}", f"present.{i}.{kind}"
            inputs.append(helper.make_tensor_value_info(past, TensorProto.FLOAT, ["batch", kv_heads, "past", head_dim]))
            nodes.append(helper.make_node("Concat", [past, "new_kv"], [present], axis=2))
            if i != drop_present:
                outputs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT,
                                                             ["batch", kv_heads, "total", head_dim]))
    graph = helper.make_graph(nodes, "kv_step", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=OPSET)
    if drop_present is None:
        onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def fixed_shape_model(path: Path) -> Path:
    """``y = x * 2`` on a fixed [4, 3] float32 tensor: nothing for Triton to batch."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )
    onnx.save(helper.make_model(graph, opset_imports=OPSET), str(path))
    return path


def external_data_model(folder: Path) -> Path:
    """``y = x @ w`` with ``w`` (hidden 7) stored in ``model.onnx.data`` beside the model."""
    folder.mkdir(parents=True, exist_ok=True)
    w = np.arange(49, dtype=np.float32).reshape(7, 7)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "external",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 7])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=OPSET)
    path = folder / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=0)
    return path
