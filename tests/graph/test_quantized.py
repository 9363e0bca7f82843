"""``graph/quantized.py``: every MatMul with constant weights and how they are held, on any graph."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from rmsnorm_deploy.graph.quantized import matmul_rows, matmul_weights


def _graph(nodes, inits):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], inits)
    return helper.make_model(graph)


@pytest.mark.parametrize("bits, level, compute", [(4, None, "float32"), (8, 1, "float32"), (4, 4, "int8"),
                                                  (8, 3, "accuracy_level 3")])
def test_matmulnbits_and_float_matmuls_are_listed(bits, level, compute):
    attrs = dict(K=64, N=8, bits=bits, block_size=32, **({"accuracy_level": level} if level is not None else {}))
    nodes = [helper.make_node("MatMulNBits", ["x", "q", "s"], ["h"], domain="com.microsoft", name="proj", **attrs),
             helper.make_node("MatMul", ["h", "w"], ["y"], name="head"),
             helper.make_node("MatMul", ["h", "h"], ["z"], name="activations only")]
    model = _graph(nodes, [numpy_helper.from_array(np.zeros((8, 8), np.float16), "w")])
    found = matmul_weights(model)
    assert [(m.node, m.op, m.weights, m.block_size, m.accuracy_level, m.compute) for m in found] == [
        ("proj", "MatMulNBits", f"int{bits}", 32, level or 0, compute if level is not None else "float32"),
        ("head", "MatMul", "float16", None, None, "float16")]
    assert matmul_rows(found) == [[1, "MatMulNBits", f"int{bits}", 32, level or 0, found[0].compute],
                                  [1, "MatMul", "float16", "-", "-", "float16"]]


def test_a_graph_without_constant_matmuls_lists_none():
    model = _graph([helper.make_node("Relu", ["x"], ["y"])], [])
    assert matmul_weights(model) == [] and matmul_rows([]) == []
