"""The norms ``validate`` checks one by one: found by the audit, their boundary tensors exposed as
graph outputs, and what each became in the graph ONNX Runtime ran."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

import onnx
from onnx import helper

from rmsnorm_deploy.contract.dtypes import onnx_type
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.onnx_reading import GraphView  # the same typing pass the audit used
from rmsnorm_deploy.graph.reductions import Reduction
from rmsnorm_deploy.validate.feeds import FLOAT_DTYPES
from rmsnorm_deploy.validate.report import NormReport


@dataclasses.dataclass
class NormUnderTest:
    """A norm the audit found, the spec its oracle uses (``None`` for a LayerNorm), the tensors
    made graph outputs to compare it, or why it cannot be compared."""

    reduction: Reduction
    spec: Any  # RMSNormSpec, or None for a LayerNorm
    exposed: list[str]
    skip_reason: str = ""
    #: why the norm cannot give a correct result whatever the backend (``Reduction.problem``): a failure
    failure: str = ""


def norms_under_test(model: onnx.ModelProto, reductions: list[Reduction]) -> list[NormUnderTest]:
    """The norms that can be checked against an oracle, and why the others cannot."""


    graph = GraphView(model)
    initializers = {i.name for i in model.graph.initializer}
    graph_io = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    sites = []
    for red in reductions:
        tensors = red.tensors
        spec = red.implied_spec() if red.kind.startswith("RMSNorm") else None
        reason = ""
        if red.problem:
            sites.append(NormUnderTest(red, None, [], failure=red.problem))
            continue
        if tensors is None:
            reason = "its output could not be traced in the graph"
        elif red.kind.startswith("LayerNorm") and (red.normalized_dims is None or red.epsilon is None):
            reason = "its axes are not the trailing dims" if red.epsilon is not None else "its epsilon is not a constant"
        elif red.kind.startswith("RMSNorm") and spec is None:
            reason = ("its epsilon is not a constant" if red.epsilon is None else
                      "its axes are not the trailing dims" if not red.normalized_dims else
                      "its epsilon and axes do not form a valid RMSNorm spec")
        elif spec is not None and spec.has_gate and (tensors is None or not tensors.gate):
            reason = "it is gated and its gate input could not be traced in the graph"
        elif red.kind == "LayerNorm" and red.op not in ("LayerNormalization", "SkipLayerNormalization"):
            reason = "decomposed LayerNorm chains are audited but not compared"
        exposed: list[str] = []
        if not reason and tensors is not None:
            for name in tensors.names():
                if name in initializers or name in graph_io:
                    continue
                if graph.dtype(name) not in FLOAT_DTYPES:
                    reason = f"the dtype of tensor {name!r} is unknown"
                    break
                exposed.append(name)
        sites.append(NormUnderTest(red, spec, exposed, reason))
    return sites


def with_exposed_tensors(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose outputs also include ``names`` (boundary tensors of the norms)."""


    names = [n for n in dict.fromkeys(names)]
    if not names:
        return model
    graph = GraphView(model)
    augmented = onnx.ModelProto()
    augmented.CopyFrom(model)
    existing = {o.name for o in augmented.graph.output}
    for name in names:
        if name not in existing:
            augmented.graph.output.append(helper.make_tensor_value_info(name, onnx_type(graph.dtype(name)), None))
    return augmented


def save_scratch(model: onnx.ModelProto, path: Path) -> Path:
    """``model`` written to ``path`` in a scratch folder for one run, its weights in a side file
    beside it: protobuf serializes gigabytes of weights at ~20 s per GB, a file takes them as they
    are. ``model`` is a copy of the caller's: its weights move out of it."""
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    return path


def norm_report(red: Reduction) -> NormReport:
    spec = red.implied_spec()
    return NormReport(red.node, red.kind, red.op, red.precision, red.epsilon, red.axes,
                      spec.describe() if spec is not None else "-")


def record_what_ran(optimized: Path, label: str, sites: list[NormUnderTest], norms: list[NormReport],
                     optimization: str) -> None:
    """Which op each norm became in the graph ONNX Runtime ran, matched by the norm's output tensor."""
    ran_model = onnx.load(str(optimized), load_external_data=False)
    ran = audit_model(ran_model, stage=f"after onnxruntime ({optimization})")
    casts_of: dict[str, set[str]] = {}
    for node in ran_model.graph.node:
        if node.op_type in ("Cast", "CastLike") and node.input:
            casts_of.setdefault(node.input[0], set()).add(node.output[0])
    by_output: dict[str, Reduction] = {}
    for red in ran:
        if red.tensors is None:
            continue
        names = {red.tensors.output} | casts_of.get(red.tensors.output, set())
        for name in names:
            by_output[name] = red
    for site, report in zip(sites, norms):
        out = site.reduction.tensors.output if site.reduction.tensors else None
        red = by_output.get(out or "")
        report.ran[label] = f"{red.op} ({red.precision})" if red else "?"
