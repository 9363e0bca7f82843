"""The MatMuls of a graph whose weights are quantized, and how: what ``audit`` shows beside the norms.

ONNX Runtime's weight-only ``com.microsoft.MatMulNBits`` holds its weights packed (``bits`` per
value, one scale per ``block_size`` values of an input column) and computes in the dtype its
``accuracy_level`` asks for: :data:`ACCURACY_COMPUTE`. Every MatMul with a constant weight is
listed with its weights' dtype, so an audit shows at once which projections are quantized, which
are not, and that the norms beside them still accumulate in float32.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import onnx

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.errors import UserError

#: MatMulNBits ``accuracy_level`` -> the dtype it computes in on ONNX Runtime CPU (0: unset, the
#: kernel's default, float32; 4: the input rounded to int8 per block, int8 dot products).
ACCURACY_COMPUTE = {0: "float32", 1: "float32", 4: "int8"}
NBITS_OP = "MatMulNBits"
#: ONNX's int8 x int8 -> int32 MatMul: a per-channel quantized weight on int8 rows (``decoder.quantize.channel_head``).
INTEGER_OP = "MatMulInteger"


@dataclasses.dataclass(frozen=True)
class QuantizedMatMul:
    """One MatMul of a graph and its weights: ``int4``/``int8`` (MatMulNBits) or a float dtype."""

    node: str
    op: str
    weights: str
    block_size: int | None = None
    accuracy_level: int | None = None
    k: int | None = None
    n: int | None = None

    @property
    def compute(self) -> str:
        if self.op == INTEGER_OP:
            return "int8"
        if self.accuracy_level is None:
            return self.weights.removesuffix(f" {OFFSETS}")
        return ACCURACY_COMPUTE.get(self.accuracy_level, f"accuracy_level {self.accuracy_level}")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "compute": self.compute}


def _weight_dtype(elem: int) -> str:
    try:
        return dtype_name(elem)
    except UserError:  # not a float: named as ONNX names it
        return onnx.TensorProto.DataType.Name(elem).lower()


def _ints(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: int(a.i) for a in node.attribute if a.type == onnx.AttributeProto.INT}


#: What a MatMul that adds a fitted width's block offsets (a ReduceSum's block sums times a constant)
#: holds: named apart, so that the audit does not list it as a projection left unquantized.
OFFSETS = "block offsets"


def matmul_weights(model: onnx.ModelProto) -> list[QuantizedMatMul]:
    """Every MatMulNBits, every MatMulInteger on a constant (or a constant's Transpose), and every
    MatMul whose second input is an initializer, in graph order."""
    inits = {i.name: i for i in model.graph.initializer}
    producer = {out: node.op_type for node in model.graph.node for out in node.output}
    transposed = {node.output[0]: node.input[0] for node in model.graph.node
                  if node.op_type == "Transpose" and node.input and node.input[0] in inits}
    found = []
    for node in model.graph.node:
        if node.op_type == INTEGER_OP and len(node.input) > 1 and (node.input[1] in inits or node.input[1] in transposed):
            weight = inits[transposed.get(node.input[1], node.input[1])]
            dims = [int(d) for d in weight.dims]
            k, n = (dims[::-1] if node.input[1] in transposed else dims) if len(dims) == 2 else (None, None)
            found.append(QuantizedMatMul(node.name or node.output[0], INTEGER_OP,
                                         f"{_weight_dtype(weight.data_type)} per channel", k=k, n=n))
            continue
        name = node.name or node.output[0]
        if node.op_type == NBITS_OP and node.domain == "com.microsoft":
            attrs = _ints(node)
            found.append(QuantizedMatMul(name, NBITS_OP, f"int{attrs.get('bits', 4)}", attrs.get("block_size"),
                                         attrs.get("accuracy_level", 0), attrs.get("K"), attrs.get("N")))
        elif node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in inits:
            weight = inits[node.input[1]]
            dims = list(weight.dims)
            offsets = producer.get(node.input[0]) == "ReduceSum"
            found.append(QuantizedMatMul(name, "MatMul", _weight_dtype(weight.data_type)
                                         + (f" {OFFSETS}" if offsets else ""),
                                         k=dims[-2] if len(dims) >= 2 else None, n=dims[-1] if dims else None))
    return found


def matmul_rows(matmuls: list[QuantizedMatMul]) -> list[list[Any]]:
    """One table row per kind of MatMul: count, op, weights, block size, accuracy level and compute dtype."""
    kinds = Counter((m.op, m.weights, m.block_size, m.accuracy_level, m.compute) for m in matmuls)
    return [[count, op, weights, "-" if block is None else block, "-" if level is None else level, compute]
            for (op, weights, block, level, compute), count in kinds.items()]
