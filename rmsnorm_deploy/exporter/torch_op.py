"""The torch custom op that carries an RMSNorm spec through ``torch.onnx.export``.

Before export every detected norm is replaced by :class:`ExportRMSNorm`, which calls
``torch.ops.rmsnorm_deploy.rms_norm(x, weight, gate, <spec fields>, name)`` (``gate``: the
second input of a gated norm, ``None`` otherwise). In eager mode the op
computes :func:`reference.reference` (bit-equal to the module it replaces, which detection
has confirmed); in ``torch.export`` it stays one opaque node, and :data:`TRANSLATION_TABLE`
turns that node into one ``rmsnorm_deploy::RMSNorm`` ONNX node with the spec as attributes.

Why a custom-domain node and not an onnxscript function: the exporter inlines every function
it is given, so the FunctionProto is attached afterwards by ``lowerings.lower_model``. The
node's final attributes and overload are set by ``onnx_function.rmsnorm_node`` in the export
pipeline; here the node only has to carry the spec and the norm's name (``norm_name``).
"""

from __future__ import annotations

from typing import Any, Optional

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema

from rmsnorm_deploy.contract.reference import reference
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.exporter.gated import check_gate_call
from rmsnorm_deploy.graph.function import DOMAIN, DOMAIN_VERSION, OP_TYPE

#: The attribute that carries the norm's module path from the op to the pipeline (then removed).
NAME_ATTRIBUTE = "norm_name"


@torch.library.custom_op("rmsnorm_deploy::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    epsilon: float,
    normalized_dims: int,
    gain: str,
    order: str,
    accumulation: str,
    epsilon_placement: str,
    gate_activation: str,
    gate_placement: str,
    group_size: Optional[int],
    name: str,
) -> torch.Tensor:
    """RMSNorm of ``x`` as the spec given field by field says (``name``: the norm's module path)."""
    spec = RMSNormSpec(epsilon, normalized_dims, gain, order, accumulation, epsilon_placement,  # type: ignore[arg-type]
                       gate_activation, gate_placement, group_size)  # type: ignore[arg-type]
    return reference(spec, x, weight, gate)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, gate, epsilon, normalized_dims, gain, order, accumulation, epsilon_placement,
                   gate_activation, gate_placement, group_size, name):
    return torch.empty_like(x)


class ExportRMSNorm(torch.nn.Module):
    """Stands in for a detected norm during export: the same weight, the spec, the custom op."""

    def __init__(self, spec: RMSNormSpec, weight: torch.Tensor | None, name: str):
        super().__init__()
        self.spec = spec
        self.norm_name = name
        # The original Parameter, not a copy: a large model must not hold its norms twice.
        if isinstance(weight, torch.nn.Parameter):
            self.weight = weight
        elif weight is not None:
            self.register_buffer("weight", weight, persistent=False)
        else:
            self.weight = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        check_gate_call(s, gate, self.norm_name)
        weight = self.weight if s.has_gain else None
        return torch.ops.rmsnorm_deploy.rms_norm(
            x, weight, gate, s.epsilon, s.normalized_dims, s.gain, s.order, s.accumulation, s.epsilon_placement,
            s.gate, s.gate_placement, s.group_size, self.norm_name
        )

    def extra_repr(self) -> str:
        return f"{self.norm_name}: {self.spec.describe()}"


def _schema() -> OpSchema:
    """An OpSchema for the exporter's tracer only (never registered with onnx: it stays process-local)."""
    param = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    string_attrs = ("gain", "order", "accumulation", "epsilon_placement", "gate", "gate_placement", NAME_ATTRIBUTE)
    return OpSchema(
        OP_TYPE,
        DOMAIN,
        DOMAIN_VERSION,
        inputs=[param("x", "T"), param("weight", "T", param_option=optional),
                param("z", "T", param_option=optional)],
        outputs=[param("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"], "")],
        attributes=[
            OpSchema.Attribute("epsilon", OpSchema.AttrType.FLOAT, required=True),
            OpSchema.Attribute("axes", OpSchema.AttrType.INTS, required=True),
            OpSchema.Attribute("group_size", OpSchema.AttrType.INT, required=False),
        ]
        + [OpSchema.Attribute(a, OpSchema.AttrType.STRING, required=False) for a in string_attrs],
    )


_OP = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION), OP_TYPE, _schema())


def _translate(x: Any, weight: Any, gate: Any, epsilon: float, normalized_dims: int, gain: str, order: str,
               accumulation: str, epsilon_placement: str, gate_activation: str, gate_placement: str,
               group_size: int | None, name: str) -> Any:
    # The inputs present, in input_names(spec) order: x[, weight][, gate].
    inputs = [t for t in (x, weight, gate) if t is not None]
    attrs = {"epsilon": float(epsilon), "axes": list(range(-int(normalized_dims), 0)), "gain": gain, "order": order,
             "accumulation": accumulation, "epsilon_placement": epsilon_placement, NAME_ATTRIBUTE: name}
    if gate is not None:
        attrs.update(gate=gate_activation, gate_placement=gate_placement)
    if group_size is not None:
        attrs["group_size"] = int(group_size)
    return _OP(*inputs, **attrs)


#: ``custom_translation_table`` for ``torch.onnx.export``.
TRANSLATION_TABLE = {torch.ops.rmsnorm_deploy.rms_norm.default: _translate}


def norm_name_of(node: onnx.NodeProto) -> str | None:
    """The module path an exported node carries, if any."""
    for attr in node.attribute:
        if attr.name == NAME_ATTRIBUTE:
            return onnx.helper.get_attribute_value(attr).decode()
    return None
