"""The graph TensorRT's ONNX parser is given, and where each norm sits in it.

TensorRT's parser keys local functions by *name* only (onnx-tensorrt ``importLocalFunctions``
inserts ``function.name()`` into a map, first one wins), so a model holding two overloads of
``rmsnorm_deploy::RMSNorm`` (for example a Llama norm and a Gemma norm, or an fp32 and an
upcast variant) would run the first overload's body for every node. And it maps a node
carrying ``plugin_namespace`` to a registered plugin before it looks at local functions, so
once our plugin is registered in a process, every ``plugin``-lowered node would run it.

So the graph is prepared here, with no TensorRT needed:

* without the plugin, every ``rmsnorm_deploy::RMSNorm`` node is inlined (the ONNX inliner
  resolves each node's own overload), which is what TensorRT would do with one overload, and
  the inlined nodes are renamed ``<norm>/<node>`` so TensorRT's layers can be traced back to
  their norm;
* with the plugin, every ``rmsnorm_deploy::RMSNorm`` node gets the plugin fields
  (``plugin_namespace``, ``plugin_version``), so each one maps to the plugin.

Each norm becomes a :class:`EngineNorm`: the ONNX node names TensorRT will name its layers after
(the parser names a layer after its node, or ``node_of_<first output>`` for an unnamed node),
and which of them holds the reduction.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import onnx
import onnx.inliner

from rmsnorm_deploy.errors import LoweringError, UserError
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.function import (
    DOMAIN,
    OP_TYPE,
    PLUGIN_VERSION,
    is_rmsnorm_node,
    plugin_namespace,
    spec_from_node,
)
from rmsnorm_deploy.graph.lowerings import drop_unused_domain, set_plugin_fields
from rmsnorm_deploy.graph.metadata import ModelMetadata

REDUCTION_OPS = ("ReduceMean", "ReduceSumSquare", "ReduceL2")


@dataclasses.dataclass(frozen=True)
class EngineNorm:
    """One norm of the prepared graph.

    ``kind``: ``plugin`` (our node, mapped to the plugin), ``function`` (our node, inlined),
    or the op that computes a norm found by the audit (``RMSNormalization``,
    ``SimplifiedLayerNormalization``, ``Pow>ReduceMean>Add>Sqrt``, ...).
    """

    label: str
    kind: str
    nodes: frozenset[str]
    reduction_nodes: frozenset[str]
    spec: dict | None = None
    accumulation: str = ""


@dataclasses.dataclass
class PreparedModel:
    model: onnx.ModelProto
    sites: list[EngineNorm]
    plugin: bool
    notes: list[str]


def parser_node_name(node: onnx.NodeProto) -> str:
    """The name TensorRT's ONNX parser gives a node's layers (onnx-tensorrt ``getNodeName``)."""
    if not node.name and node.output:
        return f"node_of_{node.output[0]}"
    return node.name


def prepare_for_tensorrt(model: onnx.ModelProto, *, plugin: bool) -> PreparedModel:
    """A copy of ``model`` ready for TensorRT's parser, with its norms located (see the module doc)."""
    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    graph = prepared.graph
    for node in graph.node:
        node.name = parser_node_name(node)
    ours = [node for node in graph.node if is_rmsnorm_node(node)]
    notes: list[str] = []
    sites: list[EngineNorm] = []
    if plugin:
        if not ours:
            raise UserError(
                "the plugin replaces rmsnorm_deploy::RMSNorm nodes and this model has none (its norms are lowered to "
                f"{_lowering_of(model)!r}); export it with --lowering plugin (or function), or build without --plugin"
            )
        for node in ours:
            spec = _checked_spec(node)
            set_plugin_fields(node, spec)
            sites.append(EngineNorm(node.name, "plugin", frozenset([node.name]), frozenset(), spec.to_dict(),
                                  spec.accumulation))
        namespaces = sorted({plugin_namespace(_checked_spec(node)) for node in ours})
        notes.append(f"{len(ours)} rmsnorm_deploy::RMSNorm node(s) mapped to the plugin "
                     f"{OP_TYPE} v{PLUGIN_VERSION} in namespace(s) {', '.join(namespaces)}")
    elif ours:
        bounds = [(node.name, _checked_spec(node), list(node.input), node.output[0]) for node in ours]
        overloads = sorted({node.overload for node in ours})
        prepared = onnx.inliner.inline_selected_functions(prepared, [(DOMAIN, OP_TYPE)])
        drop_unused_domain(prepared)
        graph = prepared.graph
        for label, spec, inputs, output in bounds:
            members = _body_nodes(graph, output, stop=set(inputs))
            for node in members:
                node.name = f"{label}/{node.name or node.op_type}"
            names = frozenset(n.name for n in members)
            reductions = frozenset(n.name for n in members if n.op_type in REDUCTION_OPS)
            sites.append(EngineNorm(label, "function", names, reductions, spec.to_dict(), spec.accumulation))
        for node in graph.node:
            node.name = parser_node_name(node)
        notes.append(f"{len(ours)} rmsnorm_deploy::RMSNorm node(s) inlined before parsing ({len(overloads)} "
                     "overload(s)); TensorRT's parser keys local functions by name only")
    taken = {n for site in sites for n in site.nodes}
    sites.extend(_other_norms(prepared, taken))
    wide = [s.label for s in sites if s.accumulation == "float64"]
    if wide:
        raise UserError(
            f"norm(s) {', '.join(wide)} accumulate in float64, which TensorRT does not compute (its parser casts "
            "DOUBLE down to FLOAT); use a float32-accumulation spec for TensorRT, or run this model in ONNX Runtime"
        )
    return PreparedModel(prepared, sites, plugin, notes)


def _checked_spec(node: onnx.NodeProto):
    try:
        return spec_from_node(node)
    except LoweringError as exc:
        raise UserError(str(exc)) from None


def _lowering_of(model: onnx.ModelProto) -> str:

    meta = ModelMetadata.read(model)
    return meta.lowering if meta and meta.lowering else "unknown"


def _body_nodes(graph: onnx.GraphProto, output: str, stop: set[str]) -> list[onnx.NodeProto]:
    """The nodes computing ``output`` from the tensors in ``stop`` (an inlined function body)."""
    producers = {out: node for node in graph.node for out in node.output}
    seen: set[int] = set()
    members: list[onnx.NodeProto] = []
    pending = [output]
    while pending:
        tensor = pending.pop()
        if tensor in stop or tensor not in producers:
            continue
        node = producers[tensor]
        if id(node) in seen:
            continue
        seen.add(id(node))
        members.append(node)
        pending.extend(i for i in node.input if i)
    order = {id(n): i for i, n in enumerate(graph.node)}
    return sorted(members, key=lambda n: order[id(n)])


def _other_norms(model: onnx.ModelProto, taken: Iterable[str]) -> list[EngineNorm]:
    """Norms the audit finds outside our nodes: fused ops and decomposed chains."""

    taken = set(taken)
    sites = []
    for red in audit_model(model):
        if red.node in taken or red.spec is not None:
            continue  # one of ours: located above
        # A decomposed chain is named after the tensor it produces; a fused op after its node.
        label = red.note[3:] if red.note.startswith("-> ") else red.node
        sites.append(EngineNorm(label, red.op, frozenset([red.node]), frozenset([red.node]), None, red.accumulation))
    return sites
