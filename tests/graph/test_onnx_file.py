"""The weights streamed into a model file one tensor at a time read back as the model holding them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from rmsnorm_deploy.graph.onnx_file import save_onnx, write_with_weights


def _skeleton() -> onnx.ModelProto:
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              initializer=[helper.make_tensor("small", TensorProto.FLOAT, [1], [1.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _weights() -> list:
    torch = pytest.importorskip("torch", reason="the exporter's tensors wrap torch tensors")
    from torch.onnx._internal.exporter._core import TorchTensor

    generator = torch.Generator().manual_seed(0)
    return [TorchTensor(torch.randn(3, 4, generator=generator), name="w"),
            ir.tensor(np.arange(6, dtype=np.float16).reshape(2, 3), name="half"),
            ir.tensor(np.array([1, -2, 3], dtype=ml_dtypes.int4), name="packed"),  # two values a byte
            TorchTensor(torch.randn(5, generator=generator).to(torch.bfloat16), name="bf16"),
            ir.StringTensor(np.array([b"a", b"bc"]), name="strings")]


def test_streamed_weights_read_back_as_the_model_with_them_in_its_graph(tmp_path):
    weights = _weights()
    path = tmp_path / "m.onnx"
    size = write_with_weights(_skeleton(), weights, path)
    want = _skeleton()
    for tensor in weights:
        ir.serde.serialize_tensor_into(want.graph.initializer.add(), from_=tensor)
    got = onnx.load(str(path))
    assert size == path.stat().st_size
    assert [t.name for t in got.graph.initializer] == ["small", "w", "half", "packed", "bf16", "strings"]
    # byte for byte the message onnx.save_model would have written from the model holding the weights
    assert got.SerializeToString() == want.SerializeToString()
    onnx.checker.check_model(str(path), full_check=True)


def test_save_onnx_with_weights_checks_the_file_before_publishing_it(tmp_path):
    path = tmp_path / "m.onnx"
    seen = []

    def check(tmp):
        seen.append(len(onnx.load(str(tmp)).graph.initializer))
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        save_onnx(_skeleton(), path, weights=_weights()[:1], check=check)
    assert seen == [2] and not path.exists() and list(tmp_path.iterdir()) == []
    save_onnx(_skeleton(), path, weights=_weights()[:1])
    assert [t.name for t in onnx.load(str(path)).graph.initializer] == ["small", "w"]
