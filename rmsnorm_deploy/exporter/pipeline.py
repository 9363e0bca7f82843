"""The export pipeline: a pre-norm model to an ONNX graph whose every norm is its exact spec.

Long: the eight steps of one export, each a short function, read in order in one place.

Steps (each one a line of progress on stderr):

1. **Detect** every norm of the module and confirm its spec bit for bit (``detect.py``);
   refuse the lowering early if it cannot represent a spec (``lowerings.refusal``).
2. **Run** the module once in its dtype on the example input: a model that cannot run in
   the requested dtype stops here, before anything is written. The PyTorch side of the
   parity check (step 7) runs here too, so that the module's weights can be freed once the
   graph holds its own copy (``release_model``).
   Each norm call is placed in the model run eagerly (``placement.py``: pre, post,
   sublayer_output, qk, final, other).
3. **Export**: each norm is swapped for :class:`~rmsnorm_deploy.exporter.torch_op.ExportRMSNorm` (the
   custom op carrying the spec); ``torch.onnx.export(dynamo=True)`` with the custom
   translation emits one ``rmsnorm_deploy::RMSNorm`` node per norm call, with dynamic
   ``batch`` and ``seq`` axes. The exporter's own fusions are not run (at opset 23 its
   rotary-embedding fusion produces a graph ONNX Runtime rejects at batch > 1); onnxscript's
   constant folding is. With ``fuse_attention`` (opset 23) the rules of ``fusions.py`` write
   rotary embeddings as ``RotaryEmbedding`` with caches valid at every batch size, and give
   ``Attention`` the key/value heads unrepeated; the norms are opaque nodes while they run.
   transformers' MoE blocks are traced with ``batched_mm`` experts (``upcast.experts_implementation``:
   their default ``grouped_mm`` is a custom op torch.onnx cannot translate); parity compares
   the graph with the model's own run.
4. **Canonicalize** the graph, serialized without its weights: each node gets exactly the
   attributes and overload ``onnx_function.rmsnorm_node`` gives it, and its module path as
   name; the nodes are counted against the detected norms; ``lowerings.lower_model`` writes
   the lowering; the norm reductions ``audit`` finds must equal the norm calls and all
   accumulate in float32 (or wider); the graph must place every norm call where the PyTorch
   model does (``graph/placement.py``), else the export is refused naming the norm and both
   placements; metadata (``metadata.ModelMetadata``, with the placements). The weights are
   never copied into it: under 2 GB they are appended to ``model.onnx`` at the save, past it
   they go to ``model.onnx.data``, one tensor at a time straight from the exporter's tensors,
   so the weights are never held twice; the module is freed before the file is checked.
5. **Check** the written file with ``onnx.checker`` (full check; not for the ``ort``
   lowering, whose ``SimplifiedLayerNormalization`` is an ONNX Runtime op the checker does
   not know) before it replaces anything.
6. **Save** into a hidden staging folder beside the target (``onnx_file.staging_folder``).
7. **Parity** (``parity.py``): ONNX Runtime CPU against the module in its dtype and
   against a float64 run, on the example shape and a larger one; a failure in a graph that
   routes with ``TopK`` is diagnosed (``routing.py``: a routing tie or not); ``report.json``.
8. **Publish** the model and its report together, the model last (``onnx_file.publish``),
   never over an existing file without ``force``; steps 6-8 hold a lock on the target, and
   the leftovers of a killed export are removed first.

A caller may hand :func:`run_export` another graph to trace (``kv``): the portable KV-cache
decoder (``decoder.portable.KVExport``, ``export --kv-cache``) supplies the module run, traced
and compared, its feeds (a prefill and a decode step for parity), the ``torch.onnx.export``
call, the metadata and the serving files staged and published with the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx
import torch

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.contract.inputs import token_ids
from rmsnorm_deploy.errors import LoweringError, UserError, one_line
from rmsnorm_deploy.exporter.detect import (
    DetectedNorm,
    Detection,
    detect_norms,
    norm_calls,
    refuse_calls_of_not_exported,
    root_path,
    without_uncalled,
)
from rmsnorm_deploy.exporter.fusions import (
    FusionCounts,
    FusionError,
    fuse_attention,
)
from rmsnorm_deploy.exporter.loaded_model import INPUT_NAME, OUTPUT_NAME, LoadedModel
from rmsnorm_deploy.exporter.parity import compare_with_onnxruntime, torch_expectations
from rmsnorm_deploy.exporter.placement import check_placements, torch_placements
from rmsnorm_deploy.exporter.plan import (
    MAX_BATCH,
    MAX_SEQ,
    ExportError,
    ExportOptions,
    ExportPlan,
    norm_overrides,
    plan_export,
)
from rmsnorm_deploy.exporter.routing import TopKRecorder
from rmsnorm_deploy.exporter.surgery import (
    quiet_exporter,
    quiet_logger,
    release_weights,
    swapped_modules,
)
from rmsnorm_deploy.exporter.torch_op import TRANSLATION_TABLE, ExportRMSNorm, norm_name_of
from rmsnorm_deploy.exporter.upcast import experts_implementation
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.function import (
    DOMAIN,
    OP_TYPE,
    is_rmsnorm_node,
    rmsnorm_node,
    spec_from_node,
)
from rmsnorm_deploy.graph.lowerings import lower_model, model_opset, refusal
from rmsnorm_deploy.graph.metadata import ModelMetadata, tool_versions
from rmsnorm_deploy.graph.onnx_file import (
    EXTERNAL_DATA_THRESHOLD,
    atomic_path,
    output_lock,
    publish,
    remove_stale,
    save_onnx,
    staging_folder,
)
from rmsnorm_deploy.graph.placement import graph_placements
from rmsnorm_deploy.graph.standalone import ir_version_for
from rmsnorm_deploy.progress import Progress
from rmsnorm_deploy.resources import check_memory


@dataclasses.dataclass
class ExportResult:
    path: Path
    report_path: Path | None
    detection: Detection
    report: dict[str, Any]
    parity: Any = None  # model_parity.ModelParity
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    fusions: FusionCounts | None = None  # with fuse_attention

    @property
    def parity_failed(self) -> bool:
        return self.parity is not None and self.parity.failed


# -- the pipeline -------------------------------------------------------------------------
def export_model(loaded: LoadedModel, path: str | os.PathLike, options: ExportOptions,
                 *, progress: Progress | None = None) -> ExportResult:
    """The Python API: plan the export of ``loaded`` to ``path``, then run it (:func:`run_export`)."""
    return run_export(loaded, plan_export(options, model_path=path), progress=progress)


def run_export(loaded: LoadedModel, plan: ExportPlan, *, progress: Progress | None = None,
               graph: Any = None) -> ExportResult:
    """Export ``loaded`` to ``path`` (see the module docstring); raises :class:`UserError` on bad input.

    Nothing is written unless every check before the save passes. The parity check's
    failure is not an exception: see ``ExportResult.parity_failed``. ``graph``: a factory
    ``graph(loaded, options)`` of another graph to trace (``decoder.portable.KVExport.of``).
    """

    options = plan.options
    progress = progress or Progress(enabled=False)
    dtype, lowering, opset = options.dtype, options.lowering, options.resolved_opset()
    _check_example_size(loaded, options)
    target, report_path = plan.model_path, plan.report_path
    timings: dict[str, float] = {}
    module = loaded.module
    input_ids = example_input_ids(options.batch, options.seq, loaded.vocab_size, options.seed)
    detection, timings["detect_s"] = _detect(loaded, options, input_ids, progress)
    kv = None
    if graph is not None:
        kv = graph(loaded, options)
        module = kv.module
        feed = kv.trace_feed
    else:
        feed = {INPUT_NAME: input_ids}
    torch_out, recorder, detection, timings["torch_run_s"] = _run_torch(loaded, module, feed, detection, progress)
    source_placements, timings["placement_s"] = _place_norms(loaded, detection, input_ids, progress)

    expected = None
    if options.parity:
        # The PyTorch side of the parity check runs first, so that the module's weights can be
        # freed (release_model) as soon as the graph holds its own copy.
        expected, timings["parity_torch_s"] = _parity_torch_side(loaded, options, module, detection, feed, kv,
                                                                 torch_out, recorder, progress)

    with progress.stage(f"torch.onnx.export (dynamo, opset {opset})") as st:
        call = kv.export_call() if kv is not None else {}
        program = _torch_export(module, detection.norms, feed.get(INPUT_NAME), opset, ExportRMSNorm, **call)
    timings["torch_onnx_export_s"] = st.seconds
    fusions = None
    if options.fuse_attention:
        with progress.stage("fusing attention and rotary embeddings (Attention, RotaryEmbedding)") as st:
            fusions = _fuse_attention(program, loaded.name)
            st.note(fusions.describe())
        timings["fuse_attention_s"] = st.seconds
    report, meta = _describe(loaded, options, plan, detection, source_placements, fusions, kv)
    # Staged beside the target, published at the end under a lock (module docstring, steps 6-8).
    with output_lock(target):
        stale = remove_stale(target)
        with staging_folder(target) as stage:
            staged_target = stage / target.name
            staged_data: Path | None = None
            try:
                with progress.stage(f"writing the {lowering} RMSNorm nodes, auditing the graph, adding the weights") as st:
                    model, staged_data, weights = _finish_graph(program, detection, options, staged_target, meta,
                                                                st, source_placements)
                    del program
                timings["onnx_graph_s"] = st.seconds
                del module
                release = _releaser(loaded, detection, options, weights)
                if staged_data is not None:
                    release()
                with progress.stage(f"saving {target} (onnx.checker full check first)") as st:
                    if stale:
                        st.note(f"removed {', '.join(p.name for p in stale)}, left by an interrupted export")
                    # inline weights (the exporter's tensors may share the module's) are freed once in the file
                    save_onnx(model, staged_target, force=True, staged_data=staged_data, weights=weights,
                              check=lambda tmp: (release(), _checker(tmp, options, stage=st)))
                    staged_data = None
                    del model
                timings["save_s"] = st.seconds
            finally:
                if staged_data is not None and staged_data.exists():
                    staged_data.unlink()

            serving_files: list[str] = []
            if kv is not None:
                with progress.stage("writing genai_config.json and the Hugging Face files beside the model") as st:
                    serving_files = kv.write_serving_files(staged_target)
                    report["serving_files"] = serving_files
                    st.note(", ".join(serving_files))
            result = ExportResult(target, None, detection, report, timings=timings, fusions=fusions)
            if expected is not None:

                with progress.stage("parity: ONNX Runtime CPU vs PyTorch and vs float64") as st:
                    result.parity = compare_with_onnxruntime(staged_target, expected, dtype=dtype, detection=detection)
                    st.note(result.parity.status)
                timings["parity_onnxruntime_s"] = st.seconds
                report["parity"] = result.parity.to_dict()
                report["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
                with atomic_path(stage / report_path.name, force=True) as tmp:
                    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
                result.report_path = report_path
            names = [target.name] + [n for n in (target.name + ".data", report_path.name, *serving_files)
                                     if (stage / n).exists()]
            publish(stage, target, names, force=options.force)
    report["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
    return result


def _releaser(loaded: LoadedModel, detection: Detection, options: ExportOptions,
              weights: list[Any]) -> Any:
    """A callable that frees the graph's weights and (``release_model``) the module's, once they
    are in the file; calling it again does nothing."""

    def release() -> None:
        weights.clear()
        if options.release_model and loaded.module is not None:
            release_weights(loaded, detection)

    return release


def _run_torch(loaded: LoadedModel, module: torch.nn.Module, feed: dict[str, Any], detection: Detection,
               progress: Progress) -> tuple[Any, TopKRecorder, Detection, float]:
    """Step 2: the module run once in its dtype on the example; the detected norms it never calls left out."""
    dtype = dtype_name(loaded.dtype)
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in list(feed.items())[:2])
    with progress.stage(f"running the PyTorch model in {dtype} on {shapes}") as st:
        try:
            # topk/sort calls are recorded for the parity check's routing diagnosis (routing.py)
            # the same forward and input the export traces: a module detection left out as not
            # called must not be called here either
            with torch.no_grad(), TopKRecorder() as recorder, \
                    refuse_calls_of_not_exported(loaded.module, detection), \
                    norm_calls(loaded.module, detection) as called:
                torch_out = module(**feed)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            raise UserError(f"{loaded.name} cannot run in {dtype} on this machine's torch: {one_line(exc)}; "
                            "choose another --dtype") from None
        # A detected norm this run never calls is not in the traced graph either: left out, listed.
        left_before = len(detection.not_exported)
        detection = without_uncalled(detection, called)
        if not detection.norms:
            raise ExportError(f"{loaded.name}: the forward the export traces calls none of its RMSNorms; nothing for "
                              "this exporter to guarantee")
        if len(detection.not_exported) > left_before:
            st.note(f"{len(detection.not_exported) - left_before} detected norm(s) not called by this run: "
                    "not on the exported path")
    return torch_out, recorder, detection, st.seconds


def _parity_torch_side(loaded: LoadedModel, options: ExportOptions, module: torch.nn.Module, detection: Detection,
                       feed: dict[str, Any], kv: Any, torch_out: Any, recorder: TopKRecorder,
                       progress: Progress) -> tuple[Any, float]:
    """The PyTorch side of the parity check (step 7): the module in its dtype and in float64."""
    dtype = options.dtype

    if kv is not None:
        feeds, torch_outputs, torch_topk = kv.parity_feeds(), [], []
    else:
        batch2, seq2 = second_shape(options.batch, options.seq, loaded.max_seq_len)
        feeds = [feed, {INPUT_NAME: example_input_ids(batch2, seq2, loaded.vocab_size, options.seed + 1)}]
        torch_outputs = [torch_out]
        torch_topk = [recorder.calls if recorder.complete else None]
    with progress.stage("parity, PyTorch side: the model in its dtype and in float64") as st:
        expected = torch_expectations(module, detection.norms, feeds, dtype=dtype, torch_outputs=torch_outputs,
                                      torch_topk=torch_topk)
    return expected, st.seconds


def _place_norms(loaded: LoadedModel, detection: Detection, input_ids: torch.Tensor,
                 progress: Progress) -> tuple[dict[str, str], float]:
    """Step 2, continued: where each norm call stands in the model run eagerly."""
    with progress.stage("placing each norm in the PyTorch model (pre, post, qk, final, ...)") as st:
        source_placements = _source_placements(loaded.module, detection, input_ids)
        st.note(_count_placements(source_placements))
    return source_placements, st.seconds


def _detect(loaded: LoadedModel, options: ExportOptions, input_ids: torch.Tensor,
            progress: Progress) -> tuple[Detection, float]:
    """Step 1: every norm detected and its spec confirmed; a lowering that cannot represent one refused."""
    dtype, lowering, opset = options.dtype, options.lowering, options.resolved_opset()
    with progress.stage("detecting norms and confirming their specs") as st:
        detection = detect_norms(loaded.module, dtype=dtype, overrides=norm_overrides(options),
                                 example={INPUT_NAME: input_ids})
        if not detection.norms:
            raise ExportError(f"{loaded.name}: no RMSNorm found; nothing for this exporter to guarantee")
        for norm in detection.norms:
            reason = refusal(lowering, norm.spec, norm.spec.upcasts(dtype), opset)
            if reason:
                raise LoweringError(f"cannot lower norm {norm.name!r} ({norm.class_name}) to {lowering!r}: {reason}")
        probed = sum(1 for n in detection.norms if n.how.startswith("confirmed by probing"))
        st.note(f"{len(detection.norms)} norms, {len({n.spec for n in detection.norms})} spec(s)"
                + (f", {probed} confirmed by probing" if probed else "")
                + (f", {len(detection.not_exported)} norm-like module(s) not on the exported path"
                   if detection.not_exported else ""))
    return detection, st.seconds


def _describe(loaded: LoadedModel, options: ExportOptions, plan: ExportPlan, detection: Detection,
              source_placements: dict[str, str], fusions: FusionCounts | None,
              kv: Any) -> tuple[dict[str, Any], ModelMetadata]:
    """The report and the metadata the model carries (step 4)."""
    target, dtype, lowering, opset = plan.model_path, options.dtype, options.lowering, options.resolved_opset()
    report: dict[str, Any] = {
        "model": str(target),
        "name": loaded.name,
        "description": loaded.description,
        "source": {k: v for k, v in loaded.source.items() if k != "toml"},
        "dtype": dtype,
        "lowering": lowering,
        "opset": opset,
        "fuse_attention": options.fuse_attention,
        "fusions": fusions.to_dict() if fusions is not None else None,
        "parameters": loaded.parameter_count(),
        "weight_bytes": loaded.weight_bytes(),
        "norms": [{**n.to_dict(), "placement": source_placements.get(n.path, "")} for n in detection.norms],
        "placements": source_placements,
        "other_norms": [{"path": p, "class": c} for p, c in detection.other_norms],
        "not_exported_norms": [n.to_dict() for n in detection.not_exported],
        "versions": tool_versions(),
    }
    meta = ModelMetadata(
        specs=detection.specs,
        lowering=lowering,
        dtype=dtype,
        source=loaded.source,
        inputs={INPUT_NAME: {"dtype": "int64", "shape": ["batch", "seq"], "kind": "token_ids",
                             "high": int(loaded.vocab_size)}},
        dims={"batch": [1, options.batch, max(options.batch, MAX_BATCH)],
              "seq": [1, options.seq, max(options.seq, min(loaded.max_seq_len, MAX_SEQ))]},
        versions=tool_versions(),
    )
    if kv is not None:
        kv.describe(meta, report)
    return report, meta


#: bytes per logit the parity check holds at once: the model's dtype, float64, ONNX Runtime's, the comparison's
_BYTES_PER_LOGIT = 32


def _check_example_size(loaded: LoadedModel, options: ExportOptions) -> None:
    """The model's dtype and positions fit the options, and the example's logits fit in memory."""
    if dtype_name(loaded.dtype) != options.dtype:
        raise UserError(f"the model was loaded in {loaded.dtype} but the export asks for {options.dtype}")
    if options.seq > loaded.max_seq_len:
        raise UserError(f"--seq {options.seq} is longer than the model's {loaded.max_seq_len} positions")
    batch2, seq2 = second_shape(options.batch, options.seq, loaded.max_seq_len)
    logits = (options.batch * options.seq + batch2 * seq2) * loaded.vocab_size
    check_memory(logits * _BYTES_PER_LOGIT, f"--batch {options.batch} --seq {options.seq}: the logits of the traced "
                 f"and checked shapes ({logits:,} values)", "give a smaller --batch or --seq")


def second_shape(batch: int, seq: int, max_seq: int) -> tuple[int, int]:
    """A second parity shape, other than the traced one in both dynamic axes."""
    return batch + 1, (seq + 5 if seq + 5 <= max_seq else max(1, seq - 1))


def example_input_ids(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:

    return torch.from_numpy(token_ids((batch, seq), vocab, seed=seed))


def _torch_export(module: torch.nn.Module, norms: list[DetectedNorm], input_ids: torch.Tensor | None, opset: int,
                  export_norm: type, *, exported: torch.nn.Module | None = None, args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None, input_names: list[str] | None = None,
                  output_names: list[str] | None = None, dynamic_shapes: Any = None) -> Any:
    """``torch.onnx.export`` of ``module`` with its norms swapped for our op. By default the
    ``input_ids -> logits`` signature; a KV-cache export passes its own call (``kv_export``):
    ``exported`` (a module sharing ``module``'s submodules), its arguments, names and shapes."""

    if exported is None:
        exported, kwargs = module, {INPUT_NAME: input_ids}
        input_names, output_names = [INPUT_NAME], [OUTPUT_NAME]
        dynamic_shapes = {INPUT_NAME: {0: "batch", 1: "seq"}}
    replacements = {n.path: export_norm(n.spec, n.weight, n.path) for n in norms}
    with swapped_modules(module, replacements), quiet_exporter(), experts_implementation(module):
        try:
            program = torch.onnx.export(
                exported, args, kwargs=kwargs, dynamo=True, opset_version=opset,
                input_names=input_names, output_names=output_names, dynamic_shapes=dynamic_shapes,
                custom_translation_table=TRANSLATION_TABLE, optimize=False, verbose=False,
            )
        except Exception as exc:  # torch raises many kinds; the user needs the first line of why
            raise ExportError(f"torch.onnx.export failed: {_export_reason(exc)}") from None
        optimize_exported(program.model)
    return program


#: onnxscript's default rewrite rule left out of :func:`optimize_exported`. Its pattern has two output
#: nodes, which the matcher tries against every pair of ``Slice`` nodes while scanning the whole graph
#: for each: half of a 30-layer model's export time (50 s of 90), for no rewrite (rotate_half's slices
#: take their bounds from shapes; the graphs came out node for node the same without it).
_SLOW_REWRITE_RULES = frozenset({"SlicesSplit"})


def optimize_exported(model: Any) -> None:
    """onnxscript's ``optimize_ir`` on the exported IR model (in place), less :data:`_SLOW_REWRITE_RULES`."""
    from unittest import mock

    import onnxscript.optimizer
    from onnxscript import rewriter

    rules = tuple(r for r in rewriter._DEFAULT_REWRITE_RULES if getattr(r, "name", None) not in _SLOW_REWRITE_RULES)
    with mock.patch.object(rewriter, "_DEFAULT_REWRITE_RULES", rules):
        onnxscript.optimizer.optimize_ir(model)


def _fuse_attention(program: Any, name: str) -> FusionCounts:
    """Run the attention and rotary fusions on the exported graph; refuse a graph with no
    ``Attention`` (the option would otherwise do nothing, silently)."""

    counts = fuse_attention(program.model, norm_op=(DOMAIN, OP_TYPE))
    if counts.attention == 0:
        raise FusionError(f"{name}: --fuse-attention found no attention to fuse: the model does not call "
                          "torch's scaled_dot_product_attention (for a transformers model, load it with "
                          "attn_implementation='sdpa'); export it without --fuse-attention")
    optimize_exported(program.model)
    return counts


#: Initializers above this size are held apart while the graph is rewritten and checked.
_WEIGHT_BYTES = 1024


def _finish_graph(program: Any, detection: Detection, options: ExportOptions, target: Path,
                  meta: ModelMetadata, stage: Any,
                  source_placements: dict[str, str]) -> tuple[onnx.ModelProto, Path | None, list[Any]]:
    """The exported graph as a checked ModelProto with canonical, lowered norm nodes and metadata.

    The graph is serialized without its weights, rewritten and audited; the weights are never
    copied into it. Under the 2 GB protobuf limit they are returned as the exporter's tensors
    (``save_onnx(weights=...)`` writes them into the file one at a time); past it they are
    written to a staging file beside ``target`` (returned; the caller renames or removes it)
    straight from the exporter's tensors, and the model refers to them.
    """
    from onnxscript import ir

    model_ir = program.model
    weights = {name: v for name, v in model_ir.graph.initializers.items()
               if v.const_value is not None and v.const_value.nbytes > _WEIGHT_BYTES}
    tensors = {}
    for name, value in weights.items():
        tensors[name] = value.const_value
        value.const_value = None
    total = sum(t.nbytes for t in tensors.values())
    clock = time.perf_counter()
    with quiet_logger("onnx_ir"):  # it warns about each initializer left without data, on purpose here
        model = ir.serde.serialize_model(model_ir)
    # onnxscript's rewrite rules keep a reference to the last graph they matched: leave it no tensors.
    for value in model_ir.graph.initializers.values():
        value.const_value = None
    del model_ir
    model.producer_name = "rmsnorm-deploy"
    nodes = _canonicalize_norm_nodes(model, detection, options.dtype)
    # Each norm call's output tensor keeps its name through every lowering: it names the norm after.
    outputs = {n.output[0]: n.name for n in model.graph.node if is_rmsnorm_node(n)}
    model.ir_version = max(model.ir_version, ir_version_for(model.opset_import))
    model = lower_model(model, options.lowering)
    reductions = _check_norms(model, nodes, options, stage)
    _check_placements(model, reductions, outputs, source_placements)
    meta.placements = {name: {"placement": source_placements[name], "output": out} for out, name in outputs.items()}
    stage.note(f"{nodes} norm nodes lowered and audited in {time.perf_counter() - clock:.1f}s")
    meta.write(model)

    clock = time.perf_counter()
    staged = None
    inline: list[Any] = []
    try:
        if total >= EXTERNAL_DATA_THRESHOLD:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.data.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            staged = Path(name)
            names = list(tensors)
            externals = ir.external_data.convert_tensors_to_external(
                [tensors.pop(n) for n in names], base_dir=str(target.parent), relative_path=staged.name)
            for n, tensor in zip(names, externals):
                tensor.name = n
                ir.serde.serialize_tensor_into(model.graph.initializer.add(), from_=tensor)
            stage.note(f"{total / 2**30:.2f} GiB of weights written to external data in {time.perf_counter() - clock:.1f}s")
        else:
            for n, tensor in tensors.items():
                tensor.name = n
            inline = list(tensors.values())
    except BaseException:
        if staged is not None and staged.exists():
            staged.unlink()
        raise
    tensors.clear()
    return model, staged, inline


def _canonicalize_norm_nodes(model: onnx.ModelProto, detection: Detection, dtype: str) -> int:
    """Give each exported norm node ``rmsnorm_node``'s attributes and its module path as name.

    Returns the number of norm nodes: one per call of a detected norm, each norm at least once.
    """

    expected = {n.path: n for n in detection.norms}
    types = {vi.name: vi.type.tensor_type.elem_type for vi in
             list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    seen: dict[str, int] = {}
    for node in model.graph.node:
        if not is_rmsnorm_node(node):
            continue
        path = norm_name_of(node)
        if path not in expected:
            raise ExportError(f"the exported graph holds an RMSNorm node for {path!r}, which is not a detected norm")
        spec = expected[path].spec
        carried = spec_from_node(node)  # epsilon travels as a float32 attribute
        if carried != dataclasses.replace(spec, epsilon=spec.epsilon_float32):
            raise ExportError(f"norm {path!r}: the exported node says {carried}, detection said {spec}")
        elem = types.get(node.input[0])
        input_dtype = dtype_name(elem) if elem else dtype_name(expected[path].dtype)
        # The variant that casts every input to the accumulation dtype whenever one of them (x,
        # weight, gate) is narrower: Bamba's gated norm in a float16 model takes a float32 x with
        # a float16 weight and gate (a float32 variant would mix float16 and float32 in its ops).
        narrower = [dtype_name(types[i]) for i in node.input[1:] if types.get(i)
                    and spec.upcasts(dtype_name(types[i]))]
        if narrower and not spec.upcasts(input_dtype):
            input_dtype = narrower[0]
        count = seen.get(path, 0)
        seen[path] = count + 1
        name = path if count == 0 else f"{path}#{count + 1}"
        node.CopyFrom(rmsnorm_node(spec, input_dtype, list(node.input), list(node.output), name=name))
    missing = [p for p in expected if p not in seen]
    if missing:
        raise ExportError(f"{len(missing)} detected norm(s) are missing from the exported graph "
                          f"({', '.join(missing[:3])}); the model's forward does not call them")
    return sum(seen.values())


def norm_node_count(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if is_rmsnorm_node(n))


def _check_norms(model: onnx.ModelProto, norm_nodes: int, options: ExportOptions, stage: Any = None) -> list[Any]:
    """As many RMSNorm reductions as norm calls, every one accumulating in float32 or wider; returns them."""

    reductions = [r for r in audit_model(model) if r.kind == "RMSNorm"]
    if len(reductions) != norm_nodes:
        raise ExportError(f"the {options.lowering} graph holds {len(reductions)} RMSNorm reductions for "
                          f"{norm_nodes} norm calls in the model")
    low = [r for r in reductions if r.low_precision]
    if low:
        raise ExportError(f"{len(low)} RMSNorm reduction(s) of the graph accumulate in {low[0].accumulation} "
                          f"(first: {low[0].node}); the export must keep them in float32")
    if model_opset(model) != options.resolved_opset():
        raise ExportError(f"the exporter wrote opset {model_opset(model)}, not the requested {options.resolved_opset()}")
    return reductions


#: The placement trace runs the model on at most this many tokens of one row (it keeps every
#: intermediate tensor alive while it runs).
_PLACEMENT_TOKENS = 8


def _source_placements(module: torch.nn.Module, detection: Detection, input_ids: torch.Tensor) -> dict[str, str]:

    ids = input_ids[:1, :_PLACEMENT_TOKENS]
    # LayerNorms stay in the graph as LayerNorms, which the graph side sees as norms too.
    # other_norms are named as the wrapped model says it (a Hugging Face model's own paths)
    paths = [root_path(module, name) for name, _ in detection.other_norms]
    others = [path for path in paths if isinstance(module.get_submodule(path), torch.nn.LayerNorm)]
    try:
        return torch_placements(module, detection.norms, {INPUT_NAME: ids}, others)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise ExportError(f"placing the norms failed: the model did not run under the trace: {one_line(exc)}") from None


def _count_placements(placements: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for p in placements.values():
        counts[p] = counts.get(p, 0) + 1
    return ", ".join(f"{n} {p}" for p, n in counts.items())


def _check_placements(model: onnx.ModelProto, reductions: list[Any], outputs: dict[str, str],
                      source: dict[str, str]) -> None:
    """The graph places every norm call where the PyTorch model does (``ExportError`` naming the first that differs)."""

    names = set(outputs.values())
    placed = graph_placements(model, reductions, names=outputs)
    check_placements(source, {k: v for k, v in placed.items() if k in names})


def _checker(path: Path, options: ExportOptions, *, stage: Any = None) -> None:
    """``onnx.checker`` full check of a written model file (its external data resolved beside it);
    not for the ``ort`` lowering, whose ``SimplifiedLayerNormalization`` the checker does not know."""
    if options.lowering == "ort":
        return
    clock = time.perf_counter()
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"the exported graph fails onnx.checker: {one_line(exc)}") from None
    if stage is not None:
        stage.note(f"onnx.checker full check in {time.perf_counter() - clock:.1f}s")


def _export_reason(exc: BaseException) -> str:
    """The innermost cause of a torch.onnx failure, in one line."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    return f"{type(root).__name__}: {one_line(root)}"

