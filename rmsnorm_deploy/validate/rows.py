"""The comparisons of one validation run, as rows: outputs against the source or the first
backend, and each norm against its float64 oracle."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import to_torch
from rmsnorm_deploy.contract.reference import oracle
from rmsnorm_deploy.contract.tolerances import (
    accuracy_bound_for,
    norm_tolerance,
    subnormal_input_allowance,
    tolerance_for,
)
from rmsnorm_deploy.exporter.norm_contract import NormContract
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.validate.backends import BACKENDS
from rmsnorm_deploy.validate.feeds import FLOAT_DTYPES, array_dtype
from rmsnorm_deploy.validate.norms import NormUnderTest
from rmsnorm_deploy.validate.report import CheckRow


@dataclasses.dataclass
class ValidationRun:
    """What one validation ran and what its outputs are compared with.

    ``keys``/``labels``: the backends (``BACKENDS`` keys) and their names in the report;
    ``results``: label -> outputs. ``ref_label`` is ``torch`` (the source in the model's dtype),
    ``float64`` (the source in float64) or ``backends`` (no source: the first backend).
    """

    keys: list[str]
    labels: list[str]
    results: dict[str, dict[str, np.ndarray]]
    feed: dict[str, np.ndarray]
    model_outputs: list[str]
    output_dtypes: dict[str, str]
    notes: list[str]
    meta: ModelMetadata | None = None
    ref_label: str = "backends"
    source_label: str = ""
    source_module: Any = None
    reference_outputs: dict[str, np.ndarray] | None = None
    #: the source run in the model's dtype, beside a float64 reference (its own error sets the bound)
    source_outputs: dict[str, np.ndarray] | None = None
    initializers: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    #: the spec detection confirmed on each norm of the source, by module path (empty without a source)
    source_specs: dict[str, Any] = dataclasses.field(default_factory=dict)


#: what a norm row compares with: the oracle of the spec confirmed on the source's norm (or, for a
#: standalone norm, of its spec, which is its source), or of the graph's own spec, which can only
#: show that the graph computes what it states
ORACLE_OF_SOURCE = "float64 oracle (the checkpoint's spec)"
ORACLE_OF_STANDALONE = "float64 oracle"
SELF_CONSISTENCY = "self-consistency (the graph's own spec)"


def norm_oracle(run: ValidationRun, site: NormUnderTest) -> tuple[Any, str, bool]:
    """The spec a norm's oracle uses, what the row says it compares with, and whether that is
    independent of the graph under test."""
    path = site.reduction.node.split("#")[0]
    if site.spec is not None and path in run.source_specs:
        return run.source_specs[path], ORACLE_OF_SOURCE, True
    if is_standalone(run.meta):
        return site.spec, ORACLE_OF_STANDALONE, True
    return site.spec, SELF_CONSISTENCY, False


def is_standalone(meta: ModelMetadata | None) -> bool:
    return meta is not None and meta.source.get("kind") == "standalone"


def _float64_bound(backend: str, dtype: str, source: np.ndarray, wide: np.ndarray) -> Any:
    """The tolerance of a whole model's output against its float64 source: a multiple of the source's own error."""
    source_error = float(np.max(np.abs(source.astype(np.float64) - wide.astype(np.float64)), initial=0.0))
    return accuracy_bound_for("model_vs_float64", backend, dtype).tolerance(source_error)


def _standalone_gain_max(meta: ModelMetadata | None, feed: dict[str, np.ndarray]) -> float:
    """The largest |gain| of a standalone model's norm: its weight input, or 1 + weight for an offset gain."""
    if not is_standalone(meta) or "weight" not in feed:
        return 0.0
    (spec,) = meta.specs.values()
    weight = feed["weight"].astype(np.float64) + (1.0 if spec.gain == "offset" else 0.0)
    return float(np.max(np.abs(weight), initial=0.0))


def output_rows(run: ValidationRun) -> list[CheckRow]:
    """Every floating output of every backend against the source, or against the first backend."""
    keys, labels, results, meta, notes = run.keys, run.labels, run.results, run.meta, run.notes
    reference_outputs, source_label, ref_label = run.reference_outputs, run.source_label, run.ref_label
    gain_max = _standalone_gain_max(meta, run.feed)
    rows: list[CheckRow] = []
    if reference_outputs is None:
        if len(labels) < 2:
            notes.append("outputs not compared: one backend and no PyTorch source; the norms are checked against "
                         "the oracle of their own spec (self-consistency)")
            return rows
        base = labels[0]
        pairs = [(k, lab, results[base], base, "backends") for k, lab in zip(keys[1:], labels[1:])]
    else:
        standalone = is_standalone(meta)
        if standalone:
            check = "norm" if ref_label == "float64" else "norm_vs_torch"
        else:
            check = "model_vs_float64" if ref_label == "float64" else "model"
        against = "float64 oracle" if standalone and ref_label == "float64" else (
            f"{source_label}" + (" f64" if ref_label == "float64" else ""))
        pairs = [(k, lab, reference_outputs, against, check) for k, lab in zip(keys, labels)]
    for key, label, expected, against, check in pairs:
        tol_backend = BACKENDS[key].tolerance_backend
        for name in run.model_outputs:
            dtype = run.output_dtypes[name]
            if dtype not in FLOAT_DTYPES:
                rows.append(CheckRow(label, name, against, check, status="skipped", detail=f"{dtype} output"))
                continue
            if name not in expected:
                rows.append(CheckRow(label, name, against, check, status="FAIL",
                                     detail=f"the reference has no output {name!r} (it has {sorted(expected)})"))
                continue
            if check == "model_vs_float64":
                tol = _float64_bound(tol_backend, dtype, run.source_outputs[name], expected[name])
            elif check in ("norm", "norm_vs_torch") and meta is not None and len(meta.specs) == 1:
                (spec,) = meta.specs.values()
                tol = norm_tolerance(check, tol_backend, dtype, spec, gain_max)
            else:
                tol = tolerance_for(check, tol_backend, dtype)
            res = compare(results[label][name], expected[name], tol, name=name, dtype=dtype)
            rows.append(CheckRow(label, name, against, check, res, "pass" if res else "FAIL", res.problem()))
    return rows


def norm_rows(run: ValidationRun, sites: list[NormUnderTest]) -> list[CheckRow]:
    """Each norm, on each backend, against the float64 oracle computed from that backend's own input."""
    import torch


    keys, labels, results, meta, ref_label = run.keys, run.labels, run.results, run.meta, run.ref_label
    standalone = is_standalone(meta)
    rows = []
    for site in sites:
        red, tensors = site.reduction, site.reduction.tensors
        spec, against, independent = norm_oracle(run, site)
        if standalone and ref_label == "float64" and run.source_module is not None and tensors.output in run.model_outputs:
            continue  # the output rows already compare this norm with the same oracle
        for key, label in zip(keys, labels):
            values = {**run.initializers, **run.feed, **results[label]}
            missing = [n for n in tensors.names() if n not in values and n != tensors.sum_output]
            name = f"norm {red.node}"
            if missing:
                rows.append(CheckRow(label, name, against, "norm", status="skipped",
                                     detail=f"{label} did not return {missing}"))
                continue
            x = sum(values[n].astype(np.float64) for n in tensors.inputs)
            y = values[tensors.output]
            gain = values[tensors.gain] if tensors.gain else None
            dtype = array_dtype(y)
            if dtype not in FLOAT_DTYPES or dtype == "float64":
                rows.append(CheckRow(label, name, against, "norm", status="skipped",
                                     detail=f"{dtype} output"))
                continue
            x_t = torch.from_numpy(np.ascontiguousarray(x))
            if spec is not None:
                check = "norm"
                g_t = None if gain is None else to_torch(gain.astype(np.float64))
                z_t = (torch.from_numpy(np.ascontiguousarray(values[tensors.gate].astype(np.float64)))
                       if tensors.gate else None)
                expected = oracle(spec, x_t, g_t, z_t)
                gain_abs = np.ones(()) if gain is None else np.abs(gain.astype(np.float64))
                tol = norm_tolerance(check, BACKENDS[key].tolerance_backend, dtype, spec, float(np.max(gain_abs, initial=0.0)))
                # the row rms only scales the subnormal-input allowance; the expected value is the oracle's
                rms = np.sqrt(np.mean(x * x, axis=spec.axes, keepdims=True) + spec.epsilon_float32)
                allowance = subnormal_input_allowance(dtype, gain_abs, rms)
            else:
                check = "layer_norm"
                shape = tuple(x.shape[-red.normalized_dims:])

                def affine(name: str | None) -> Any:
                    if not name:
                        return None
                    return torch.from_numpy(np.ascontiguousarray(values[name].astype(np.float64).reshape(shape)))

                expected = torch.nn.functional.layer_norm(x_t, shape, affine(tensors.gain), affine(tensors.bias),
                                                          red.epsilon)
                tol = tolerance_for(check, BACKENDS[key].tolerance_backend, dtype)
                allowance = None
            res = compare(y, expected, tol, name=name, dtype=dtype, allowance=allowance)
            rows.append(CheckRow(label, name, against, check, res, "pass" if res else "FAIL", res.problem(),
                                 independent=independent))
    return rows


def contract_rows(contract: NormContract) -> list[CheckRow]:
    """The static contract against the source (``exporter.norm_contract``): a failure per field
    that differs, else one row for all the norms compared."""
    rows = [CheckRow("static", f"norm {m.norm}", "checkpoint", "contract", status="FAIL", detail=m.message)
            for m in contract.mismatches]
    if not rows and contract.compared:
        count = len(contract.compared)
        rows.append(CheckRow("static", f"norm contract ({count} norm{'s' if count > 1 else ''})", "checkpoint",
                             "contract", detail="every norm's spec, precision and gain values match the checkpoint's"))
    if not rows:
        rows.append(CheckRow("static", "norm contract", "checkpoint", "contract", status="skipped",
                             detail="no norm of the graph could be compared with the checkpoint"))
    return rows


def broken_norm_rows(run: ValidationRun, sites: list[NormUnderTest]) -> list[CheckRow]:
    """A failure per backend for each norm that cannot give a correct result whatever it runs on
    (``Reduction.problem``: e.g. a NaN or negative epsilon in the graph)."""
    return [CheckRow(label, f"norm {site.reduction.node}", "float64 oracle", "norm", status="FAIL", detail=site.failure)
            for site in sites if site.failure for label in run.labels]
