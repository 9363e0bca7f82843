"""Validate an ONNX model before serving it: run it on each backend and compare.

Two kinds of evidence, each measured under the tolerance table:

* **outputs**: every floating output of every backend against a reference. For a model this
  project exported, the reference is the PyTorch source rebuilt from the model's metadata
  (``exporter.rebuild.rebuild_source``): a whole model is held to the source's float64 run, no
  farther from it than the source in its own dtype is, times the ``model_vs_float64`` bound (two
  float32 runtimes drift apart with depth, so their distance decides nothing); a standalone norm
  to its source in the model's dtype (``--reference torch``) or in float64 (``--reference float64``).
  For any other graph there is no source: the backends are compared with the first one.
* **norms**: every RMSNorm and LayerNorm the audit finds, in isolation. Its boundary tensors
  (input, gain, output) become extra outputs of the graph, and each backend's output is
  compared with the float64 oracle of the spec the norm implies (ours: the spec on the node;
  a third party's: epsilon and axes from the graph, the gain the graph multiplies by), computed
  from that backend's own input to the norm. Exposing boundary tensors leaves the norm's own
  ops, and so ONNX Runtime's fusions of them, as they are.

Inputs come from the metadata (kinds ``activations``, ``token_ids``, ``weight`` and the
dims' optimal sizes) or, for any other graph, from its declared inputs; ``stress`` inputs put
float values of 300..60000 (whose squares overflow float16) in every activation.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from onnx import numpy_helper

from rmsnorm_deploy.decoder.kv_model import kv_source
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.plan import REPORT_NAME
from rmsnorm_deploy.exporter.rebuild import rebuild_source
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_file import load_onnx, save_onnx
from rmsnorm_deploy.runners.torch import TorchRunner
from rmsnorm_deploy.validate.backends import BACKENDS, check_provider_options, parse_backends
from rmsnorm_deploy.validate.feeds import check_feed, elem_dtype, generate_feed, load_feed
from rmsnorm_deploy.validate.norms import norm_report, norms_under_test, record_what_ran, with_exposed_tensors
from rmsnorm_deploy.validate.report import CheckRow, ValidationReport
from rmsnorm_deploy.validate.rows import ValidationRun, broken_norm_rows, is_standalone, norm_rows, output_rows

REFERENCES = ("auto", "torch", "float64")


def validate_model(
    path: str | Path,
    *,
    providers: Sequence[str] = ("cpu",),
    reference: str = "auto",
    inputs: str = "normal",
    seed: int = 0,
    dims: dict[str, int] | None = None,
    feed_path: str | Path | None = None,
    optimization: str = "all",
    provider_options: dict[str, dict[str, str]] | None = None,
    check_norms: bool = True,
    require_all_nodes_on_provider: bool = False,
    source: str | Path | None = None,
) -> ValidationReport:
    """Run ``path`` on each backend of ``providers`` and compare outputs and norms; see the module doc.

    ``require_all_nodes_on_provider``: refuse an ONNX Runtime backend that runs any compute node
    on another provider (a ``ProviderError`` naming the nodes); nodes per provider are reported
    either way.
    """

    if reference not in REFERENCES:
        raise UserError(f"unknown reference {reference!r}; choose from {', '.join(REFERENCES)}")
    keys = parse_backends(providers)
    check_provider_options(keys, provider_options)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"--seed {seed!r} is not an integer >= 0; give a seed like 0")
    model = load_onnx(path)
    meta = ModelMetadata.read(model)
    notes: list[str] = []
    if feed_path is not None:
        if dims:
            raise UserError("--dim sizes generated inputs; with --feed the arrays' shapes decide")
        feed, described = load_feed(feed_path, model, meta)
    else:
        feed, described, feed_notes = generate_feed(model, meta, kind=inputs, seed=seed, dims=dims)
        notes += feed_notes
        check_feed(feed, model, meta)
    source_module, source_label, ref_label = _reference_source(meta, reference, notes, Path(path).parent, source)
    notes += _export_report_notes(Path(path), meta)

    reductions = audit_model(model)
    sites = norms_under_test(model, reductions) if check_norms else []
    for site in sites:
        if site.skip_reason:
            notes.append(f"norm {site.reduction.node} not compared: {site.skip_reason}")
    checked_sites = [s for s in sites if not s.skip_reason and not s.failure]
    model_outputs = [o.name for o in model.graph.output]
    output_dtypes = {o.name: elem_dtype(o.type.tensor_type.elem_type) for o in model.graph.output}

    rows: list[CheckRow] = []
    labels = [BACKENDS[k].label for k in keys]
    norms = [norm_report(s.reduction) for s in sites]
    with tempfile.TemporaryDirectory(prefix="rmsnorm-validate-") as tmp:
        workdir = Path(tmp)
        exposed = [n for s in checked_sites for n in s.exposed]
        run_path = Path(path)
        if exposed:
            run_path = save_onnx(with_exposed_tensors(model, exposed), workdir / "model-with-norm-outputs.onnx")
        results: dict[str, dict[str, np.ndarray]] = {}
        node_assignment: dict[str, dict[str, int]] = {}
        for key, label in zip(keys, labels):
            runner = BACKENDS[key].runner(
                run_path, workdir, optimization=optimization, provider_options=provider_options,
                require_all_nodes_on_provider=require_all_nodes_on_provider)
            try:
                with runner:
                    results[label] = runner.infer(feed)
                    if getattr(runner, "node_assignment", None) is not None:
                        node_assignment[label] = runner.node_assignment.counts
            except UserError as exc:
                raise type(exc)(f"{label}: {exc}") from None
            optimized = workdir / f"optimized-{key}.onnx"
            if optimized.exists():
                record_what_ran(optimized, label, sites, norms, optimization)
        reference_outputs = source_outputs = None
        if source_module is not None:

            with TorchRunner(source_module, dtype="float64" if ref_label == "float64" else None) as torch_runner:
                reference_outputs = torch_runner.infer(feed)
            if ref_label == "float64" and not is_standalone(meta):
                # A whole model is held to its source's own distance from float64 (accuracy bounds).
                with TorchRunner(source_module) as torch_runner:
                    source_outputs = torch_runner.infer(feed)
        initial = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}

        run = ValidationRun(keys, labels, results, feed, model_outputs, output_dtypes, notes, meta, ref_label,
                            source_label, source_module, reference_outputs, source_outputs, initial)
        rows += output_rows(run)
        if check_norms:
            rows += broken_norm_rows(run, sites)
            rows += norm_rows(run, checked_sites)
    source = (f"{meta.source.get('kind', 'unknown')} (rmsnorm_deploy metadata, {meta.dtype}, lowering "
              f"{meta.lowering})" if meta else "third-party graph (no rmsnorm_deploy metadata)")
    reference_text = {"torch": f"{source_label}, run in the model's dtype", "float64": f"{source_label} in float64",
                      "backends": f"outputs: the first backend ({labels[0]}); norms: their float64 oracle"}[ref_label]
    return ValidationReport(str(path), source, reference_text, described, labels, rows, norms, notes, node_assignment)


def _export_report_notes(path: Path, meta: ModelMetadata | None) -> list[str]:
    """An exported model (not a standalone norm) is published with its ``report.json``: say so when
    it is missing or describes another export."""
    import json

    if meta is None or is_standalone(meta):
        return []

    report_path = path.parent / REPORT_NAME
    if not report_path.is_file():
        return [f"warning: no {REPORT_NAME} beside the model: its export-time parity was never recorded (an "
                "interrupted export, or one without parity); re-export it to have one"]
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"warning: {report_path} is not readable JSON ({exc}); re-export the model"]
    if not isinstance(report, dict):
        return [f"warning: {report_path} is not an export report; re-export the model"]
    theirs = {k: report.get(k) for k in ("dtype", "lowering")}
    if theirs != {"dtype": meta.dtype, "lowering": meta.lowering}:
        return [f"warning: {report_path} describes another export ({theirs}) than the model "
                f"(dtype {meta.dtype!r}, lowering {meta.lowering!r}); re-export the model"]
    return []


def _reference_source(meta: ModelMetadata | None, reference: str, notes: list[str], model_dir: Path,
                      source: str | Path | None = None) -> tuple[Any, str, str]:
    """The PyTorch module to compare outputs with, its label, and ``torch``/``float64``/``backends``."""
    if meta is None and source is not None:
        raise UserError("--source gives the PyTorch source of a model exported by rmsnorm-deploy; this graph has no "
                        "rmsnorm_deploy metadata, so drop --source")
    if meta is None:
        if reference == "torch":
            raise UserError("--reference torch needs a model exported by rmsnorm-deploy (its metadata rebuilds the "
                            "PyTorch source); this graph has none: use --reference float64 (each norm against its "
                            "float64 oracle, backends against each other)")
        return None, "", "backends"

    kind = meta.source.get("kind", "unknown")
    try:
        module = kv_source(rebuild_source(meta, model_dir=model_dir, source_path=source), meta)
    except (UserError, ImportError) as exc:
        why = f"cannot rebuild the PyTorch source of kind {kind!r}: {exc}"
        if reference != "auto":
            raise UserError(f"--reference {reference}: {why}") from None
        notes.append(why + "; comparing backends with each other and each norm with its float64 oracle instead")
        return None, "", "backends"
    label = f"torch source ({kind})"
    if kind != "standalone" and reference == "torch":
        notes.append("a whole model is held to the float64 run of its source (tolerances.ACCURACY_BOUNDS): its distance "
                     "to the source in its own dtype grows with depth and decides nothing, so --reference torch is "
                     "read as float64")
    whole_model = kind != "standalone"
    return module, label, "float64" if reference == "float64" or whole_model else "torch"
