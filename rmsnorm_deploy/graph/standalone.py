"""A model holding one RMSNorm: the unit that parity tests and benchmarks run."""

from __future__ import annotations

from typing import Any, Sequence

import onnx
from onnx import helper

from rmsnorm_deploy.contract.dtypes import dtype_name, onnx_type
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.function import (
    DOMAIN,
    DOMAIN_VERSION,
    MIN_IR_VERSION,
    check_opset,
    input_names,
    rmsnorm_node,
)
from rmsnorm_deploy.graph.lowerings import LOWERINGS, lower_model
from rmsnorm_deploy.graph.metadata import ModelMetadata, tool_versions


def default_opset(lowering: str) -> int:
    """Opset 18 runs on the widest set of runtimes; ``native`` needs 23."""
    return 23 if lowering == "native" else 18


def ir_version_for(opset_imports: Sequence[onnx.OperatorSetIdProto]) -> int:
    """The lowest IR version that holds these opsets and function overloads."""
    default = [imp for imp in opset_imports if imp.domain in ("", "ai.onnx")]
    return max(MIN_IR_VERSION, helper.find_min_ir_version_for(default))


def rmsnorm_model(
    spec: RMSNormSpec,
    *,
    dtype: Any,
    shape: Sequence[int],
    lowering: str = "function",
    opset: int | None = None,
) -> onnx.ModelProto:
    """A model ``y = RMSNorm(x[, weight][, z])`` for ``spec`` in ``lowering``.

    ``shape`` is an example input shape: its last ``spec.normalized_dims`` dims are fixed
    (they size the weight), the leading dims are dynamic; a gated spec's gate input ``z`` has
    the shape and dtype of ``x``. ``dtype`` is a name
    (``"float16"``) or a torch or numpy dtype.
    """
    name = dtype_name(dtype)
    if name == "float64":
        raise UserError("float64 models are not supported; choose float32, float16 or bfloat16")
    if lowering not in LOWERINGS:
        raise UserError(f"unknown lowering {lowering!r}; choose one of {', '.join(LOWERINGS)}")
    opset = default_opset(lowering) if opset is None else opset
    check_opset(opset)
    shape = tuple(int(d) for d in shape)
    k = spec.normalized_dims
    if len(shape) < k or any(d < 1 for d in shape):
        raise UserError(f"shape {shape} must have at least {k} dims, all >= 1")
    leading: list[int | str] = [f"d{i}" for i in range(len(shape) - k)]
    dims = leading + list(shape[-k:])
    elem = onnx_type(name)
    inputs = [helper.make_tensor_value_info("x", elem, dims)]
    if spec.group_size is not None and shape[-1] % spec.group_size:
        raise UserError(f"shape {shape}: the last dim {shape[-1]} is not a multiple of group_size {spec.group_size}")
    node_inputs = input_names(spec)
    if spec.has_gain:
        inputs.append(helper.make_tensor_value_info("weight", elem, list(shape[-k:])))
    if spec.has_gate:
        inputs.append(helper.make_tensor_value_info("z", elem, dims))
    node = rmsnorm_node(spec, name, node_inputs, ["y"], name="rmsnorm")
    graph = helper.make_graph([node], "rmsnorm", inputs, [helper.make_tensor_value_info("y", elem, dims)])
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="rmsnorm-deploy")
    model.ir_version = ir_version_for(model.opset_import)
    model = lower_model(model, lowering)
    inputs_meta = {"x": {"dtype": name, "shape": dims, "kind": "activations"}}
    if spec.has_gain:
        inputs_meta["weight"] = {"dtype": name, "shape": list(shape[-k:]), "kind": "weight", "gain": spec.gain}
    if spec.has_gate:
        inputs_meta["z"] = {"dtype": name, "shape": dims, "kind": "activations"}
    ModelMetadata(
        specs={"rmsnorm": spec},
        lowering=lowering,
        dtype=name,
        source={"kind": "standalone"},
        inputs=inputs_meta,
        dims={d: [1, int(v), max(int(v), 1) * 4] for d, v in zip(leading, shape)},
        versions=tool_versions(),
    ).write(model)
    return model
