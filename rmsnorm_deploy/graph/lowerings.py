"""How a spec becomes ONNX: the lowerings.

Every graph this project writes first holds ``rmsnorm_deploy::RMSNorm`` nodes (see
``onnx_function.py``); :func:`lower_model` then turns each one into the lowering the user
asked for. Each lowering says, for a spec and input dtype, either how to write it or why
it cannot be written exactly (``refusal``): a lowering never changes the numbers quietly.

==========  ===================================================================
function    the node plus a local FunctionProto (default; runs everywhere)
plugin      ``function`` whose nodes also carry TensorRT's plugin fields
inline      the function body as plain nodes, no function
native      ONNX opset-23 ``RMSNormalization`` (``stash_type=1``)
ort         ONNX Runtime's ``SimplifiedLayerNormalization`` (domain ``""``)
==========  ===================================================================
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import onnx
import onnx.inliner
from onnx import TensorProto, helper

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import LoweringError
from rmsnorm_deploy.graph.function import (
    DOMAIN,
    DOMAIN_VERSION,
    OP_TYPE,
    PLUGIN_VERSION,
    check_opset,
    function_proto,
    input_names,
    is_rmsnorm_node,
    node_upcasts,
    plugin_namespace,
    spec_from_node,
)

LOWERINGS: tuple[str, ...] = ("function", "native", "ort", "inline", "plugin")


@dataclasses.dataclass(frozen=True)
class NormNode:
    """One RMSNorm node to lower: its spec, whether its input is converted, its tensor names."""

    spec: RMSNormSpec
    upcast: bool
    x: str
    weight: str | None
    y: str
    name: str
    gate: str | None = None


def refusal(lowering: str, spec: RMSNormSpec, upcast: bool, opset: int) -> str | None:
    """Why ``lowering`` cannot represent ``spec`` exactly, or ``None``.

    ``upcast``: whether the input dtype differs from the accumulation dtype
    (``spec.upcasts(input_dtype)``); rounding order only matters then.
    """
    if lowering not in LOWERINGS:
        return f"unknown lowering {lowering!r}; choose one of {', '.join(LOWERINGS)}"
    if lowering in ("function", "inline"):
        return None
    # the plugin's kernel, like the fused ops, has no gate input and normalizes whole trailing dims
    what = "the TensorRT plugin's kernel" if lowering == "plugin" else _OP_NAME[lowering]
    if spec.has_gate:
        return (f"{what} has no gate input; this spec is gated by {spec.gate}(z) "
                f"({spec.gate_placement.replace('_', ' ')}): use the function or inline lowering")
    if spec.group_size is not None:
        return (f"{what} normalizes whole trailing dims; this spec normalizes the last dim in groups "
                f"of {spec.group_size}: use the function or inline lowering")
    if lowering == "plugin":
        return None
    if spec.epsilon_placement != "inside_sqrt":
        return f"{_OP_NAME[lowering]} adds epsilon inside the square root; this spec adds it outside"
    if spec.accumulation != "float32":
        return f"{_OP_NAME[lowering]} accumulates in float32 only; this spec accumulates in {spec.accumulation}"
    if lowering == "native":
        if opset < 23:
            return f"RMSNormalization exists from opset 23; this model is opset {opset} (use --opset 23)"
        if spec.has_gain and upcast and spec.order == "scale_then_cast":
            return (
                "RMSNormalization rounds the normalized value to the input dtype before applying the gain "
                "(cast_then_scale); this spec applies the gain in float32 first (scale_then_cast)"
            )
    if lowering == "ort" and spec.has_gain and upcast and spec.order == "cast_then_scale":
        return (
            "SimplifiedLayerNormalization applies the gain in float32 before rounding to the input dtype "
            "(scale_then_cast); this spec rounds first (cast_then_scale)"
        )
    return None


_OP_NAME = {"native": "RMSNormalization", "ort": "SimplifiedLayerNormalization"}


def lower_model(model: onnx.ModelProto, lowering: str = "function") -> onnx.ModelProto:
    """Lower every ``rmsnorm_deploy::RMSNorm`` node of ``model`` (in place) and return it.

    Raises :class:`LoweringError` naming the first node the lowering cannot represent.
    """
    opset = model_opset(model)
    check_opset(opset)
    sites = [(i, _site(node, model)) for i, node in enumerate(model.graph.node) if is_rmsnorm_node(node)]
    for _, site in sites:
        reason = refusal(lowering, site.spec, site.upcast, opset)
        if reason:
            raise LoweringError(f"cannot lower RMSNorm node {site.name!r} to {lowering!r}: {reason}")
    if lowering in ("function", "plugin", "inline"):
        _attach_functions(model, sites, opset)
        if lowering == "plugin":
            for i, site in sites:
                set_plugin_fields(model.graph.node[i], site.spec)
        if lowering == "inline":
            model = onnx.inliner.inline_selected_functions(model, [(DOMAIN, OP_TYPE)])
            drop_unused_domain(model)
        return model
    builder = {"native": _native_nodes, "ort": _ort_nodes}[lowering]
    new_nodes: list[onnx.NodeProto] = []
    by_index = dict(sites)
    for i, node in enumerate(model.graph.node):
        new_nodes.extend(builder(by_index[i]) if i in by_index else [node])
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    drop_unused_domain(model)
    return model


def model_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    raise LoweringError("model has no default-domain opset import; it is not a valid ONNX model")


def _site(node: onnx.NodeProto, model: onnx.ModelProto) -> NormNode:
    spec = spec_from_node(node)
    declared = _value_dtype(model, node.input[0])
    from_overload = node_upcasts(node)
    if declared is not None:
        # a weight or gate narrower than the accumulation dtype is cast too, whatever x is
        others = [_value_dtype(model, name) for name in node.input[1:] if name]
        upcast = spec.upcasts(declared) or any(d is not None and spec.upcasts(d) for d in others)
        if from_overload is not None and from_overload != upcast:
            raise LoweringError(
                f"RMSNorm node {node.name!r}: its overload {node.overload!r} does not match its {declared} input; "
                "rebuild the node with rmsnorm_node()"
            )
    elif from_overload is not None:
        upcast = from_overload
    else:
        raise LoweringError(f"RMSNorm node {node.name!r}: the dtype of its input {node.input[0]!r} is not declared")
    roles = input_names(spec)
    given = [name for name in node.input]
    if len(given) != len(roles) or not all(given):
        raise LoweringError(f"RMSNorm node {node.name!r} has inputs {given} but its spec ({spec.describe()}) takes "
                            f"{len(roles)}: {', '.join(roles)}")
    named = dict(zip(roles, given))
    return NormNode(spec, upcast, named["x"], named.get("weight"), node.output[0], node.name or node.output[0],
                    gate=named.get("z"))


def _value_dtype(model: onnx.ModelProto, name: str) -> str | None:

    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return dtype_name(vi.type.tensor_type.elem_type)
    for init in g.initializer:
        if init.name == name:
            return dtype_name(init.data_type)
    return None


def _attach_functions(model: onnx.ModelProto, sites: list[tuple[int, NormNode]], opset: int) -> None:
    present = {(f.domain, f.name, f.overload) for f in model.functions}
    for i, site in sites:
        node = model.graph.node[i]
        node.overload = site.spec.variant(site.upcast)
        key = (DOMAIN, OP_TYPE, node.overload)
        if key not in present:
            model.functions.append(function_proto(site.spec, site.upcast, opset))
            present.add(key)
    _ensure_domain(model)


def set_plugin_fields(node: onnx.NodeProto, spec: RMSNormSpec) -> None:
    for attr in list(node.attribute):
        if attr.name in ("plugin_namespace", "plugin_version"):
            node.attribute.remove(attr)
    node.attribute.extend(
        [
            helper.make_attribute("plugin_namespace", plugin_namespace(spec)),
            helper.make_attribute("plugin_version", PLUGIN_VERSION),
        ]
    )


def _ensure_domain(model: onnx.ModelProto) -> None:
    if not any(imp.domain == DOMAIN for imp in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))


def drop_unused_domain(model: onnx.ModelProto) -> None:
    """Remove our domain's opset import once no node or function uses it."""
    if any(n.domain == DOMAIN for n in model.graph.node) or any(f.domain == DOMAIN for f in model.functions):
        return
    keep = [imp for imp in model.opset_import if imp.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)


# -- replacement nodes --------------------------------------------------------------------
def _scale_input(site: NormNode, name: Callable[[str], str], *, scale_in_float32: bool) -> tuple[list[onnx.NodeProto], str]:
    """Nodes computing the tensor that multiplies the normalized value, and its name.

    ``scale_in_float32``: the op applies the gain in float32 (SimplifiedLayerNormalization on
    converted inputs), so ``1 + w`` is formed in float32 as the spec says; otherwise the gain
    is rounded to the input dtype, which is what cast_then_scale specifies.
    """
    spec, x, w = site.spec, site.x, site.weight
    if spec.gain == "none":
        # Ones shaped like the normalized dims, in the input dtype.
        return [
            helper.make_node("Shape", [x], [name("norm_shape")], start=-spec.normalized_dims),
            helper.make_node(
                "ConstantOfShape", [name("norm_shape")], [name("ones_f32")], value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
            ),
            helper.make_node("CastLike", [name("ones_f32"), x], [name("ones")]),
        ], name("ones")
    assert w is not None
    if spec.gain == "weight":
        return [], w
    upcast = site.upcast
    nodes = [helper.make_node("Constant", [], [name("one")], value=helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]))]
    if not upcast:
        nodes.append(helper.make_node("Add", [w, name("one")], [name("gain")]))
        return nodes, name("gain")
    nodes += [
        helper.make_node("Cast", [w], [name("w_f32")], to=TensorProto.FLOAT),
        helper.make_node("Add", [name("w_f32"), name("one")], [name("gain_f32")]),
    ]
    if scale_in_float32:
        return nodes, name("gain_f32")
    nodes.append(helper.make_node("CastLike", [name("gain_f32"), x], [name("gain")]))
    return nodes, name("gain")


def _namer(site: NormNode) -> Callable[[str], str]:
    return lambda suffix: f"{site.y}__{suffix}"


def _native_nodes(site: NormNode) -> list[onnx.NodeProto]:
    name = _namer(site)
    nodes, scale = _scale_input(site, name, scale_in_float32=False)
    nodes.append(
        helper.make_node(
            "RMSNormalization",
            [site.x, scale],
            [site.y],
            name=site.name,
            axis=-site.spec.normalized_dims,
            epsilon=site.spec.epsilon,
            stash_type=TensorProto.FLOAT,
        )
    )
    return nodes


def _ort_nodes(site: NormNode) -> list[onnx.NodeProto]:
    name = _namer(site)
    scale_f32 = site.spec.gain == "offset" and site.upcast
    nodes, scale = _scale_input(site, name, scale_in_float32=scale_f32)
    attrs = dict(axis=-site.spec.normalized_dims, epsilon=site.spec.epsilon, stash_type=TensorProto.FLOAT)
    if scale_f32:
        # A float32 scale makes the op's output float32 (its output type follows the scale).
        nodes.append(helper.make_node("SimplifiedLayerNormalization", [site.x, scale], [name("y_f32")], name=site.name, **attrs))
        nodes.append(helper.make_node("CastLike", [name("y_f32"), site.x], [site.y]))
    else:
        nodes.append(helper.make_node("SimplifiedLayerNormalization", [site.x, scale], [site.y], name=site.name, **attrs))
    return nodes
