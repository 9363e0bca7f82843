"""The static contract of a graph's norms against the source they were exported from.

Numbers alone cannot tell some defects apart: a gain applied before the cast back instead of
after it is the same float32 value, and a norm whose oracle is built from the graph's own
attributes agrees with a wrong epsilon. So each norm the graph holds (its spec read the way
``graph/`` reads it: the node's attributes, the precision the audit reads in its body, its gain
tensor) is compared field by field with the spec the model's metadata records and with the spec
detection confirms bit for bit on the source module's norm at the same module path
(``detect.detect_norms``), its gain values with the source's weight, and the set of norms with
the source's (a norm dropped or added). ``validate`` runs it whenever it has a source; the
export pipeline can run the same comparison on the graph it wrote.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.exporter.detect import Detection, DetectedNorm
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.placement import name_norms
from rmsnorm_deploy.graph.reductions import LOW_PRECISION, Reduction

#: the spec fields a node of this project carries; a lowered norm (native, ort, inline) shows only
#: the ones its ops can: its epsilon, axes and where epsilon sits (its precision is read from the ops)
NODE_FIELDS = tuple(f.name for f in dataclasses.fields(RMSNormSpec))
LOWERED_FIELDS = ("epsilon", "normalized_dims", "epsilon_placement")


@dataclasses.dataclass(frozen=True)
class ContractMismatch:
    """One field of one norm that differs: ``message`` is the whole line, naming the norm and the field."""

    norm: str
    field: str  # a spec field, "precision", "gain values", "missing" or "extra"
    message: str


@dataclasses.dataclass
class NormContract:
    """The comparison of every norm: which were compared with the source, what differs, what could not be read."""

    compared: list[str]
    mismatches: list[ContractMismatch]
    notes: list[str] = dataclasses.field(default_factory=list)


def graph_norms(reductions: list[Reduction], meta: ModelMetadata | None) -> dict[str, Reduction]:
    """The graph's norms (as written) by name: the module path the metadata's placements give their
    output (a second call of one module is ``path#2``), else the node's own name."""
    named = name_norms(reductions, meta)
    return {red.node: red for red in named}


def graph_spec(red: Reduction) -> tuple[RMSNormSpec | None, tuple[str, ...]]:
    """The spec a norm of the graph states and the fields it states: every field for a node of this
    project (from its attributes), the ones its ops show for a lowered norm."""
    spec = red.implied_spec()
    return spec, (NODE_FIELDS if red.spec is not None else LOWERED_FIELDS)


def check_norm_contract(reductions: list[Reduction], meta: ModelMetadata | None, detection: Detection | None,
                        initializers: dict[str, np.ndarray]) -> NormContract:
    """Every norm of the graph against the metadata's spec and, with ``detection`` (of the source
    module), against the source's confirmed spec and weight; the norm sets against each other.

    ``reductions``: the audit of the graph as written (``graph.audit.audit_model``); their
    ``node`` is set to the norm's name. ``initializers``: the graph's constant tensors by name,
    for the gain values."""
    norms = {name: red for name, red in graph_norms(reductions, meta).items() if red.kind.startswith("RMSNorm")}
    mismatches: list[ContractMismatch] = []
    notes: list[str] = []
    recorded = dict(meta.specs) if meta is not None else {}
    source = {n.path: n for n in detection.norms} if detection is not None else {}
    compared: list[str] = []
    # the set of norms: each module path the graph, the metadata and the source hold
    paths = {name.split("#")[0] for name in norms}
    if meta is not None:
        _set_mismatches(paths, set(recorded), "the metadata", mismatches)
    if detection is not None:
        _set_mismatches(paths, set(source), "the checkpoint", mismatches)
        if meta is not None:
            for name in sorted(set(recorded) - set(source)):
                mismatches.append(ContractMismatch(name, "extra",
                                                   f"norm {name}: in the metadata, not in the checkpoint"))
    for name, red in norms.items():
        path = name.split("#")[0]
        spec, fields = graph_spec(red)
        if spec is None:
            notes.append(f"norm {name}: its spec cannot be read from the graph (epsilon or axes not constant), "
                         "so it is not compared field by field")
            continue
        if path in recorded:
            mismatches += _field_mismatches(name, red, spec, fields, recorded[path], "the metadata")
        if path in source:
            compared.append(name)
            mismatches += _field_mismatches(name, red, spec, fields, source[path].spec, "the checkpoint")
            mismatch, note = _gain_mismatch(name, red, spec, source[path], initializers)
            mismatches += [mismatch] if mismatch else []
            notes += [note] if note else []
    return NormContract(compared, mismatches, notes)


def _set_mismatches(graph: set[str], other: set[str], where: str, out: list[ContractMismatch]) -> None:
    for name in sorted(other - graph):
        out.append(ContractMismatch(name, "missing", f"norm {name}: in {where}, not in the graph (a dropped norm)"))
    for name in sorted(graph - other):
        out.append(ContractMismatch(name, "extra", f"norm {name}: in the graph, not in {where} (an added norm)"))


def _field_mismatches(name: str, red: Reduction, spec: RMSNormSpec, fields: tuple[str, ...],
                      expected: RMSNormSpec, where: str) -> list[ContractMismatch]:
    found = []
    for field in fields:
        ours, theirs = getattr(spec, field), getattr(expected, field)
        if field == "epsilon":  # an ONNX float attribute holds float32: compare in it
            same = np.float32(ours) == np.float32(theirs)
            ours, theirs = f"{float(np.float32(ours)):.6g}", f"{theirs:.6g}"
        else:
            same = ours == theirs
        if not same:
            found.append(ContractMismatch(name, field,
                                          f"norm {name}: {field} {ours} in the graph, {theirs} in {where}"))
    precision = _precision(red)
    if precision != expected.accumulation:
        found.append(ContractMismatch(name, "precision", f"norm {name}: squares and sum in {precision} in the graph, "
                                      f"accumulation {expected.accumulation} in {where}"))
    return found


def _precision(red: Reduction) -> str:
    """The narrowest dtype the audit reads the norm's squares or sum in."""
    low = [d for d in (red.squares, red.accumulation) if d in LOW_PRECISION]
    return low[0] if low else red.accumulation


def _gain_mismatch(name: str, red: Reduction, spec: RMSNormSpec, norm: DetectedNorm,
                   initializers: dict[str, np.ndarray]) -> tuple[ContractMismatch | None, str]:
    """The gain the graph multiplies by (``1 + w`` for an offset gain) against the source's, exactly."""
    expected = _effective_gain(norm.spec, None if norm.weight is None else norm.weight.detach().double().numpy())
    tensor = red.tensors.gain if red.tensors is not None else None
    if tensor is not None and tensor not in initializers:
        return None, f"norm {name}: its gain {tensor!r} is computed in the graph, so its values are not compared"
    gain = _effective_gain(spec, None if tensor is None else initializers[tensor].astype(np.float64))
    if gain is None and expected is None:
        return None, ""
    if gain is None or expected is None:
        ours = "no gain" if gain is None else "a gain"
        theirs = "none" if expected is None else "one"
        return ContractMismatch(name, "gain values",
                                f"norm {name}: {ours} in the graph, {theirs} in the checkpoint"), ""
    if gain.shape != expected.shape:
        return ContractMismatch(name, "gain values", f"norm {name}: gain of shape {list(gain.shape)} in the graph, "
                                f"{list(expected.shape)} in the checkpoint"), ""
    diff = np.abs(gain - expected)
    if np.any(diff > 0) or np.any(np.isnan(gain) != np.isnan(expected)):
        at = int(np.nanargmax(diff)) if np.any(~np.isnan(diff)) else 0
        return ContractMismatch(name, "gain values", (
            f"norm {name}: gain values differ from the checkpoint's weight at {int(np.sum(~(diff == 0)))} of "
            f"{diff.size} elements (max abs difference {float(np.nanmax(diff, initial=0.0)):.3g}, element {at}: "
            f"{gain.reshape(-1)[at]:.6g} in the graph, {expected.reshape(-1)[at]:.6g} in the checkpoint)")), ""
    return None, ""


def _effective_gain(spec: RMSNormSpec, weight: Any) -> np.ndarray | None:
    """What a norm of ``spec`` multiplies by, in float64: ``w``, ``1 + w`` or nothing."""
    if weight is None or not spec.has_gain:
        return None
    return weight + 1.0 if spec.gain == "offset" else weight


def check_file_contract(path: Any, detection: Detection) -> NormContract:
    """:func:`check_norm_contract` of the graph at ``path`` (its weights left on disk: only the norms'
    gains are read from its external data) against ``detection``, the norms of the module exported."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    reductions = audit_model(model)
    gains = {r.tensors.gain for r in reductions if r.tensors is not None and r.tensors.gain}
    initializers = {i.name: numpy_helper.to_array(i, base_dir=str(path.parent))
                    for i in model.graph.initializer if i.name in gains}
    return check_norm_contract(reductions, ModelMetadata.read(model), detection, initializers)
