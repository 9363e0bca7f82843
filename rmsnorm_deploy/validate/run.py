"""Validate an ONNX model before serving it: run it on each backend and compare.

Two kinds of evidence, each measured under the tolerance table:

* **outputs**: every floating output of every backend against a reference. For a model this
  project exported, the reference is the PyTorch source rebuilt from the model's metadata
  (``sources.rebuild_source``), run in the model's dtype (``--reference torch``) or in float64
  (``--reference float64``). For any other graph there is no source: the backends are compared
  with the first one.
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

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from rmsnorm_deploy.contract.compare import CompareResult, compare
from rmsnorm_deploy.contract.dtypes import dtype_name, onnx_type
from rmsnorm_deploy.contract.inputs import (
    INPUT_KINDS,
    activations,
    gain_weights,
    token_ids,
)
from rmsnorm_deploy.contract.tolerances import (
    norm_tolerance,
    subnormal_input_allowance,
    tolerance_for,
)
from rmsnorm_deploy.errors import (
    InputError,
    MissingDependencyError,
    ModelFileError,
    UserError,
)
from rmsnorm_deploy.graph.audit import Reduction, audit_model
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.runners.base import Runner
from rmsnorm_deploy.table import format_table

#: backend key -> (runner family, ONNX Runtime providers or TensorRT plugin flag, tolerance backend)
BACKENDS: dict[str, tuple[str, Any, str]] = {
    "cpu": ("onnxruntime", ["cpu"], "onnxruntime"),
    "cuda": ("onnxruntime", ["cuda"], "onnxruntime"),
    "tensorrt": ("onnxruntime", ["tensorrt", "cuda"], "tensorrt"),
    "trt": ("tensorrt", False, "tensorrt"),
    "trt-plugin": ("tensorrt", True, "tensorrt"),
}
REFERENCES = ("auto", "torch", "float64")
#: size given to a dynamic dim that neither the metadata nor ``--dim`` sizes: odd, and > 2 so that
#: stress inputs get their all-zero row
DEFAULT_DYNAMIC_DIM = 3
_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_ELEM_NAMES = {
    onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32", onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8",
}


@dataclasses.dataclass
class CheckRow:
    """One comparison: a backend's output (or one norm's) against its reference."""

    backend: str
    output: str
    against: str
    check: str
    result: CompareResult | None = None
    status: str = "pass"  # pass, FAIL, skipped
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "result"}
        data["result"] = self.result.to_dict() if self.result is not None else None
        return data


@dataclasses.dataclass
class NormReport:
    """One norm of the graph: what the graph says, and what each ONNX Runtime backend ran."""

    name: str
    kind: str
    op: str
    precision: str
    epsilon: float | None
    axes: list[int] | None
    spec: str
    ran: dict[str, str] = dataclasses.field(default_factory=dict)  # backend -> "op (precision)"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ValidationReport:
    model: str
    source: str
    reference: str
    inputs: dict[str, dict[str, Any]]
    backends: list[str]
    rows: list[CheckRow]
    norms: list[NormReport]
    notes: list[str]

    @property
    def passed(self) -> bool:
        return not any(r.status == "FAIL" for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "source": self.source, "reference": self.reference, "inputs": self.inputs,
            "backends": self.backends, "passed": self.passed, "rows": [r.to_dict() for r in self.rows],
            "norms": [n.to_dict() for n in self.norms], "notes": self.notes,
        }

    def table(self) -> str:
        headers = ["backend", "output", "vs", "dtype", "max abs", "max rel", "max ulp", "tolerance", "status"]
        body = []
        for r in self.rows:
            res = r.result
            if res is None:
                body.append([r.backend, r.output, r.against, "-", "-", "-", "-", "-", f"{r.status}: {r.detail}"])
                continue
            status = r.status if not res.nan_mismatch and not res.inf_mismatch else (
                f"{r.status} (nan {res.nan_mismatch}, inf {res.inf_mismatch})")
            body.append([r.backend, r.output, r.against, res.dtype, _num(res.max_abs), _num(res.max_rel),
                         _num(res.max_ulp), res.tolerance.describe(), status])
        text = [f"model: {self.model}", f"source: {self.source}", f"reference: {self.reference}",
                "inputs: " + ", ".join(f"{k} {v['dtype']}{v['shape']} ({v['kind']})" for k, v in self.inputs.items()),
                "", format_table(headers, body)]
        if self.norms:
            norm_headers = ["norm", "kind", "as written", "accumulates", "epsilon", "axes", *self.backends_ran(), "spec"]
            norm_body = [[n.name, n.kind, n.op, n.precision, "-" if n.epsilon is None else f"{n.epsilon:.3g}",
                          n.axes, *[n.ran.get(b, "-") for b in self.backends_ran()], n.spec] for n in self.norms]
            text += ["", format_table(norm_headers, norm_body)]
        failed = [r for r in self.rows if r.status == "FAIL"]
        for r in failed:
            if r.result is not None and r.result.first_bad:
                text.append(f"FAIL {r.backend} {r.output}: {r.result.summary()}")
        text += [f"note: {n}" for n in self.notes]
        counts = {s: sum(r.status == s for r in self.rows) for s in ("pass", "FAIL", "skipped")}
        text.append(f"\n{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} skipped")
        return "\n".join(text)

    def backends_ran(self) -> list[str]:
        return [b for b in self.backends if any(b in n.ran for n in self.norms)]


def _num(value: float) -> str:
    return f"{value:.3g}"


# -- backends ---------------------------------------------------------------------------
def parse_backends(text: str | Sequence[str]) -> list[str]:
    """``cpu,cuda`` -> ``["cpu", "cuda"]``; unknown names are a one-line error."""
    items = text.split(",") if isinstance(text, str) else list(text)
    keys = [k.strip().lower() for k in items if k.strip()]
    unknown = [k for k in keys if k not in BACKENDS]
    if unknown or not keys:
        raise UserError(f"unknown provider(s) {unknown or [text]}; choose from {', '.join(BACKENDS)}")
    return list(dict.fromkeys(keys))


def backend_label(key: str) -> str:
    family, arg, _ = BACKENDS[key]
    if family == "onnxruntime":
        return f"onnxruntime[{key}]"
    return "tensorrt[plugin]" if arg else "tensorrt"


def make_runner(
    key: str,
    model_path: Path,
    workdir: Path,
    *,
    optimization: str = "all",
    provider_options: dict[str, dict[str, str]] | None = None,
) -> Runner:
    """The runner of backend ``key`` on ``model_path`` (a TensorRT engine is built into ``workdir``)."""
    family, arg, _ = BACKENDS[key]
    if family == "onnxruntime":
        from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner, provider_name

        wanted = {provider_name(p) for p in arg}
        options = {k: v for k, v in (provider_options or {}).items() if provider_name(k) in wanted}
        return OnnxRuntimeRunner(model_path, arg, optimization=optimization, provider_options=options,
                                 optimized_model_path=workdir / f"optimized-{key}.onnx")
    return _tensorrt_runner(model_path, workdir, plugin=bool(arg))


def _tensorrt_runner(model_path: Path, workdir: Path, *, plugin: bool) -> Runner:
    from rmsnorm_deploy.optional import require

    flag = "trt-plugin" if plugin else "trt"
    require("tensorrt", f"validate --providers {flag}")
    try:
        from rmsnorm_deploy.runners.tensorrt import TensorRTRunner
        from rmsnorm_deploy.tensorrt.build import build_engine
    except ImportError as exc:
        raise MissingDependencyError(
            f"validate --providers {flag} needs rmsnorm_deploy's TensorRT engine builder, which this installation "
            f"lacks ({exc}); install a release of rmsnorm-deploy with TensorRT support or use the Docker image"
        ) from None
    report = build_engine(model_path, workdir / f"model-{flag}.engine", plugin=plugin, force=True)
    return TensorRTRunner(report.engine_path, plugin=plugin)


# -- inputs -----------------------------------------------------------------------------
@dataclasses.dataclass
class InputDecl:
    """A graph input: dtype name and dims (ints, dim names, or ``None`` for unnamed dynamic dims)."""

    name: str
    dtype: str
    dims: list[int | str | None]


def graph_inputs(model: onnx.ModelProto) -> list[InputDecl]:
    initializers = {i.name for i in model.graph.initializer}
    decls = []
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        tensor_type = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise InputError(f"input {vi.name!r} is not a tensor; validate feeds tensors only")
        dims: list[int | str | None] = []
        for d in tensor_type.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
        decls.append(InputDecl(vi.name, _elem_dtype(tensor_type.elem_type), dims))
    return decls


def _elem_dtype(elem: int) -> str:
    if elem in _ELEM_NAMES:
        return _ELEM_NAMES[elem]
    try:
        return dtype_name(elem)
    except UserError:
        return onnx.TensorProto.DataType.Name(elem).lower()


def parse_dims(items: Iterable[str]) -> dict[str, int]:
    """``["batch=2", "seq=7"]`` -> ``{"batch": 2, "seq": 7}``."""
    dims = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise UserError(f"--dim {item!r} is not NAME=SIZE with SIZE >= 1, e.g. --dim batch=2")
        dims[name.strip()] = int(value)
    return dims


def _resolve_shape(decl: InputDecl, sizes: dict[str, int]) -> list[int]:
    return [d if isinstance(d, int) else sizes.get(d or "", DEFAULT_DYNAMIC_DIM) for d in decl.dims]


def generate_feed(
    model: onnx.ModelProto,
    meta: ModelMetadata | None,
    *,
    kind: str = "normal",
    seed: int = 0,
    dims: dict[str, int] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]], list[str]]:
    """Seeded inputs for every graph input, the description of each, and notes."""
    if kind not in INPUT_KINDS:
        raise UserError(f"unknown input kind {kind!r}; choose from {', '.join(INPUT_KINDS)}")
    decls = graph_inputs(model)
    dims = dict(dims or {})
    known_dims = {d for decl in decls for d in decl.dims if isinstance(d, str)}
    unknown = sorted(set(dims) - known_dims)
    if unknown:
        raise UserError(f"--dim {', '.join(unknown)}: no such dynamic dim; the model's are "
                        f"{', '.join(sorted(known_dims)) or 'none (all dims are fixed)'}")
    notes: list[str] = []
    sizes = {name: int(rng[1]) for name, rng in (meta.dims.items() if meta else []) if len(rng) == 3}
    sizes.update(dims)
    unsized = sorted(d for d in known_dims if d not in sizes)
    if unsized or any(d is None for decl in decls for d in decl.dims):
        notes.append(f"dynamic dims without a size ({', '.join(unsized) or 'unnamed'}) were given "
                     f"{DEFAULT_DYNAMIC_DIM}; set them with --dim NAME=SIZE")
    feed, described = {}, {}
    gather_sizes = _gather_index_bounds(model)
    for i, decl in enumerate(decls):
        shape = _resolve_shape(decl, sizes)
        info = (meta.inputs.get(decl.name) if meta else None) or {}
        input_kind = info.get("kind") or _guess_kind(decl)
        if input_kind == "activations":
            array = activations(shape, decl.dtype, seed=seed + i, kind=kind)
        elif input_kind == "weight":
            array = gain_weights(shape, decl.dtype, info.get("gain", "weight"), seed=seed + 1 + i)
            if array is None:
                raise ModelFileError(f"input {decl.name!r} is a weight of gain 'none'; the metadata is inconsistent")
        elif input_kind == "token_ids":
            high = int(info.get("high") or gather_sizes.get(decl.name, 2))
            array = token_ids(shape, high, seed=seed + i).astype(np.dtype(decl.dtype))
        elif input_kind == "mask":
            array = np.ones(shape, dtype=np.dtype(decl.dtype))
        elif input_kind == "positions":
            array = np.broadcast_to(np.arange(shape[-1] if shape else 1), shape).astype(np.dtype(decl.dtype))
        else:
            array = np.zeros(shape, dtype=np.dtype(decl.dtype))
        feed[decl.name] = np.ascontiguousarray(array)
        described[decl.name] = {"dtype": decl.dtype, "shape": shape, "kind": input_kind if input_kind != "activations"
                                else f"activations, {kind}"}
    if kind == "stress" and not any(v["kind"].startswith("activations") for v in described.values()):
        notes.append("--inputs stress has no effect: the model has no floating activation input")
    return feed, described, notes


def _guess_kind(decl: InputDecl) -> str:
    """A third-party input's role, from its dtype and name."""
    if decl.dtype in _FLOAT_DTYPES:
        return "activations"
    lowered = decl.name.lower()
    if decl.dtype == "bool" or "mask" in lowered:
        return "mask"
    if "position" in lowered:
        return "positions"
    if decl.dtype in ("int64", "int32"):
        return "token_ids"
    return "zeros"


def _gather_index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For graph inputs used as Gather indices into an initializer (embeddings): the table's size."""
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    bounds: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[0] in shapes:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = shapes[node.input[0]]
            if dims:
                bounds[node.input[1]] = int(dims[axis])
    return bounds


def load_feed(path: str | Path, model: onnx.ModelProto) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    """Inputs from an ``.npz`` file, checked against the graph's inputs."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such file; give an .npz file with one array per model input")
    try:
        with np.load(p, allow_pickle=False) as data:
            feed = {k: np.ascontiguousarray(data[k]) for k in data.files}
    except Exception as exc:
        raise InputError(f"{p}: not a readable .npz file ({type(exc).__name__}: {exc})") from None
    check_feed(feed, model)
    return feed, {k: {"dtype": _array_dtype(v), "shape": list(v.shape), "kind": f"from {p.name}"} for k, v in feed.items()}


def _array_dtype(array: np.ndarray) -> str:
    try:
        return dtype_name(array.dtype)
    except UserError:
        return str(array.dtype)


def check_feed(feed: dict[str, np.ndarray], model: onnx.ModelProto) -> None:
    """Names, dtypes, ranks and fixed dims of ``feed`` against the graph; one-line errors."""
    decls = {d.name: d for d in graph_inputs(model)}
    missing, unexpected = sorted(set(decls) - set(feed)), sorted(set(feed) - set(decls))
    if missing or unexpected:
        raise InputError(f"inputs do not match the model: missing {missing}, unexpected {unexpected}; "
                         f"the model takes {sorted(decls)}")
    seen: dict[str, tuple[str, int]] = {}
    for name, array in feed.items():
        decl = decls[name]
        got = _array_dtype(array)
        if got != decl.dtype:
            raise InputError(f"input {name!r} is {got} but the model wants {decl.dtype}; convert it first")
        want = ["?" if d is None else d for d in decl.dims]
        if array.ndim != len(decl.dims) or any(isinstance(d, int) and d != s for d, s in zip(decl.dims, array.shape)):
            raise InputError(f"input {name!r} has shape {list(array.shape)} but the model wants {want}")
        for d, size in zip(decl.dims, array.shape):
            if isinstance(d, str):
                if d in seen and seen[d][1] != size:
                    raise InputError(f"dim {d!r} is {seen[d][1]} in input {seen[d][0]!r} but {size} in {name!r}")
                seen[d] = (name, size)


# -- the norms' boundary tensors -----------------------------------------------------------
@dataclasses.dataclass
class NormSite:
    reduction: Reduction
    spec: Any  # RMSNormSpec, or None for a LayerNorm
    exposed: list[str]
    skip_reason: str = ""


def norm_sites(model: onnx.ModelProto, reductions: list[Reduction]) -> list[NormSite]:
    """The norms that can be checked against an oracle, and why the others cannot."""
    from rmsnorm_deploy.graph.audit import _Graph  # the same typing pass the audit used

    graph = _Graph(model)
    initializers = {i.name for i in model.graph.initializer}
    graph_io = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    sites = []
    for red in reductions:
        tensors = red.tensors
        spec = red.implied_spec() if red.kind.startswith("RMSNorm") else None
        reason = ""
        if tensors is None:
            reason = "its output could not be traced in the graph"
        elif red.kind.startswith("LayerNorm") and (red.normalized_dims is None or red.epsilon is None):
            reason = "its axes are not the trailing dims"
        elif red.kind.startswith("RMSNorm") and spec is None:
            reason = "its axes are not the trailing dims or its epsilon is not a constant"
        elif spec is not None and spec.has_gate and (tensors is None or not tensors.gate):
            reason = "it is gated and its gate input could not be traced in the graph"
        elif red.kind == "LayerNorm" and red.op not in ("LayerNormalization", "SkipLayerNormalization"):
            reason = "decomposed LayerNorm chains are audited but not compared"
        exposed: list[str] = []
        if not reason and tensors is not None:
            for name in tensors.names():
                if name in initializers or name in graph_io:
                    continue
                if graph.dtype(name) not in _FLOAT_DTYPES:
                    reason = f"the dtype of tensor {name!r} is unknown"
                    break
                exposed.append(name)
        sites.append(NormSite(red, spec, exposed, reason))
    return sites


def with_exposed_tensors(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose outputs also include ``names`` (boundary tensors of the norms)."""
    from rmsnorm_deploy.graph.audit import _Graph

    names = [n for n in dict.fromkeys(names)]
    if not names:
        return model
    graph = _Graph(model)
    augmented = onnx.ModelProto()
    augmented.CopyFrom(model)
    existing = {o.name for o in augmented.graph.output}
    for name in names:
        if name not in existing:
            augmented.graph.output.append(helper.make_tensor_value_info(name, onnx_type(graph.dtype(name)), None))
    return augmented


# -- the run ----------------------------------------------------------------------------
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
) -> ValidationReport:
    """Run ``path`` on each backend of ``providers`` and compare outputs and norms; see the module doc."""
    from rmsnorm_deploy.graph.onnx_file import load_onnx, save_onnx

    if reference not in REFERENCES:
        raise UserError(f"unknown reference {reference!r}; choose from {', '.join(REFERENCES)}")
    keys = parse_backends(providers)
    model = load_onnx(path)
    meta = ModelMetadata.read(model)
    notes: list[str] = []
    if feed_path is not None:
        if dims:
            raise UserError("--dim sizes generated inputs; with --feed the arrays' shapes decide")
        feed, described = load_feed(feed_path, model)
    else:
        feed, described, feed_notes = generate_feed(model, meta, kind=inputs, seed=seed, dims=dims)
        notes += feed_notes
        check_feed(feed, model)
    source_module, source_label, ref_label = _reference_source(meta, reference, notes)

    reductions = audit_model(model)
    sites = norm_sites(model, reductions) if check_norms else []
    for site in sites:
        if site.skip_reason:
            notes.append(f"norm {site.reduction.node} not compared: {site.skip_reason}")
    checked_sites = [s for s in sites if not s.skip_reason]
    model_outputs = [o.name for o in model.graph.output]
    output_dtypes = {o.name: _elem_dtype(o.type.tensor_type.elem_type) for o in model.graph.output}

    rows: list[CheckRow] = []
    labels = [backend_label(k) for k in keys]
    norms = [_norm_report(s.reduction) for s in sites]
    with tempfile.TemporaryDirectory(prefix="rmsnorm-validate-") as tmp:
        workdir = Path(tmp)
        exposed = [n for s in checked_sites for n in s.exposed]
        run_path = Path(path)
        if exposed:
            run_path = save_onnx(with_exposed_tensors(model, exposed), workdir / "model-with-norm-outputs.onnx")
        results: dict[str, dict[str, np.ndarray]] = {}
        for key, label in zip(keys, labels):
            runner = make_runner(key, run_path, workdir, optimization=optimization, provider_options=provider_options)
            try:
                with runner:
                    results[label] = runner.infer(feed)
            except UserError as exc:
                raise type(exc)(f"{label}: {exc}") from None
            optimized = workdir / f"optimized-{key}.onnx"
            if optimized.exists():
                _record_what_ran(optimized, label, sites, norms, optimization)
        reference_outputs = source_outputs = None
        if source_module is not None:
            from rmsnorm_deploy.runners.torch import TorchRunner

            with TorchRunner(source_module, dtype="float64" if ref_label == "float64" else None) as torch_runner:
                reference_outputs = torch_runner.infer(feed)
            if ref_label == "float64" and not _is_standalone(meta):
                # A whole model is held to its source's own distance from float64 (accuracy bounds).
                with TorchRunner(source_module) as torch_runner:
                    source_outputs = torch_runner.infer(feed)
        initial = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}

        rows += _output_rows(keys, labels, results, reference_outputs, source_label, ref_label, meta,
                             model_outputs, output_dtypes, notes, source_outputs, _standalone_gain_max(meta, feed))
        if check_norms:
            rows += _norm_rows(keys, labels, results, checked_sites, initial, feed, ref_label, source_module,
                               meta, model_outputs)
    source = (f"{meta.source.get('kind', 'unknown')} (rmsnorm_deploy metadata, {meta.dtype}, lowering "
              f"{meta.lowering})" if meta else "third-party graph (no rmsnorm_deploy metadata)")
    reference_text = {"torch": f"{source_label}, run in the model's dtype", "float64": f"{source_label} in float64",
                      "backends": f"outputs: the first backend ({labels[0]}); norms: their float64 oracle"}[ref_label]
    return ValidationReport(str(path), source, reference_text, described, labels, rows, norms, notes)


def _reference_source(meta: ModelMetadata | None, reference: str, notes: list[str]) -> tuple[Any, str, str]:
    """The PyTorch module to compare outputs with, its label, and ``torch``/``float64``/``backends``."""
    if meta is None:
        if reference == "torch":
            raise UserError("--reference torch needs a model exported by rmsnorm-deploy (its metadata rebuilds the "
                            "PyTorch source); this graph has none: use --reference float64 (each norm against its "
                            "float64 oracle, backends against each other)")
        return None, "", "backends"
    from rmsnorm_deploy.exporter.rebuild import rebuild_source

    kind = meta.source.get("kind", "unknown")
    try:
        module = rebuild_source(meta)
    except (UserError, ImportError) as exc:
        why = f"cannot rebuild the PyTorch source of kind {kind!r}: {exc}"
        if reference != "auto":
            raise UserError(f"--reference {reference}: {why}") from None
        notes.append(why + "; comparing backends with each other and each norm with its float64 oracle instead")
        return None, "", "backends"
    label = f"torch source ({kind})"
    return module, label, "float64" if reference == "float64" else "torch"


def _is_standalone(meta: ModelMetadata | None) -> bool:
    return meta is not None and meta.source.get("kind") == "standalone"


def _float64_bound(backend: str, dtype: str, source: np.ndarray, wide: np.ndarray) -> Any:
    """The tolerance of a whole model's output against its float64 source: a multiple of the source's own error."""
    try:
        from rmsnorm_deploy.contract.tolerances import accuracy_bound_for
    except ImportError:
        raise UserError("--reference float64 for a whole model needs the accuracy bounds of the export pipeline "
                        "(tolerances.accuracy_bound_for), which this installation lacks; use --reference torch") from None
    source_error = float(np.max(np.abs(source.astype(np.float64) - wide.astype(np.float64)), initial=0.0))
    return accuracy_bound_for("model_vs_float64", backend, dtype).tolerance(source_error)


def _standalone_gain_max(meta: ModelMetadata | None, feed: dict[str, np.ndarray]) -> float:
    """The largest |gain| of a standalone model's norm: its weight input, or 1 + weight for an offset gain."""
    if not _is_standalone(meta) or "weight" not in feed:
        return 0.0
    (spec,) = meta.specs.values()
    weight = feed["weight"].astype(np.float64) + (1.0 if spec.gain == "offset" else 0.0)
    return float(np.max(np.abs(weight), initial=0.0))


def _output_rows(keys, labels, results, reference_outputs, source_label, ref_label, meta, model_outputs,
                 output_dtypes, notes, source_outputs=None, gain_max=0.0) -> list[CheckRow]:
    rows: list[CheckRow] = []
    if reference_outputs is None:
        if len(labels) < 2:
            notes.append("outputs not compared: one backend and no PyTorch source; the norms are checked against "
                         "their float64 oracle")
            return rows
        base = labels[0]
        pairs = [(k, lab, results[base], base, "backends") for k, lab in zip(keys[1:], labels[1:])]
    else:
        standalone = _is_standalone(meta)
        if standalone:
            check = "norm" if ref_label == "float64" else "norm_vs_torch"
        else:
            check = "model_vs_float64" if ref_label == "float64" else "model"
        against = "float64 oracle" if standalone and ref_label == "float64" else (
            f"{source_label}" + (" f64" if ref_label == "float64" else ""))
        pairs = [(k, lab, reference_outputs, against, check) for k, lab in zip(keys, labels)]
    for key, label, expected, against, check in pairs:
        tol_backend = BACKENDS[key][2]
        for name in model_outputs:
            dtype = output_dtypes[name]
            if dtype not in _FLOAT_DTYPES:
                rows.append(CheckRow(label, name, against, check, status="skipped", detail=f"{dtype} output"))
                continue
            if name not in expected:
                rows.append(CheckRow(label, name, against, check, status="FAIL",
                                     detail=f"the reference has no output {name!r} (it has {sorted(expected)})"))
                continue
            if check == "model_vs_float64":
                tol = _float64_bound(tol_backend, dtype, source_outputs[name], expected[name])
            elif check in ("norm", "norm_vs_torch") and meta is not None and len(meta.specs) == 1:
                (spec,) = meta.specs.values()
                tol = norm_tolerance(check, tol_backend, dtype, spec, gain_max)
            else:
                tol = tolerance_for(check, tol_backend, dtype)
            res = compare(results[label][name], expected[name], tol, name=name, dtype=dtype)
            rows.append(CheckRow(label, name, against, check, res, "pass" if res else "FAIL"))
    return rows


def _norm_rows(keys, labels, results, sites, initial, feed, ref_label, source_module, meta,
               model_outputs) -> list[CheckRow]:
    import torch

    from rmsnorm_deploy.contract.dtypes import to_torch
    from rmsnorm_deploy.contract.reference import oracle

    standalone = _is_standalone(meta)
    rows = []
    for site in sites:
        red, tensors = site.reduction, site.reduction.tensors
        if standalone and ref_label == "float64" and source_module is not None and tensors.output in model_outputs:
            continue  # the output rows already compare this norm with the same oracle
        for key, label in zip(keys, labels):
            values = {**initial, **feed, **results[label]}
            missing = [n for n in tensors.names() if n not in values and n != tensors.sum_output]
            name = f"norm {red.node}"
            if missing:
                rows.append(CheckRow(label, name, "float64 oracle", "norm", status="skipped",
                                     detail=f"{label} did not return {missing}"))
                continue
            x = sum(values[n].astype(np.float64) for n in tensors.inputs)
            y = values[tensors.output]
            gain = values[tensors.gain] if tensors.gain else None
            dtype = _array_dtype(y)
            if dtype not in _FLOAT_DTYPES or dtype == "float64":
                rows.append(CheckRow(label, name, "float64 oracle", "norm", status="skipped",
                                     detail=f"{dtype} output"))
                continue
            x_t = torch.from_numpy(np.ascontiguousarray(x))
            if site.spec is not None:
                check = "norm"
                g_t = None if gain is None else to_torch(gain.astype(np.float64))
                z_t = (torch.from_numpy(np.ascontiguousarray(values[tensors.gate].astype(np.float64)))
                       if tensors.gate else None)
                expected = oracle(site.spec, x_t, g_t, z_t)
                gain_abs = np.ones(()) if gain is None else np.abs(gain.astype(np.float64))
                tol = norm_tolerance(check, BACKENDS[key][2], dtype, site.spec, float(np.max(gain_abs, initial=0.0)))
                # the row rms only scales the subnormal-input allowance; the expected value is the oracle's
                rms = np.sqrt(np.mean(x * x, axis=site.spec.axes, keepdims=True) + site.spec.epsilon_float32)
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
                tol = tolerance_for(check, BACKENDS[key][2], dtype)
                allowance = None
            res = compare(y, expected, tol, name=name, dtype=dtype, allowance=allowance)
            rows.append(CheckRow(label, name, "float64 oracle", check, res, "pass" if res else "FAIL"))
    return rows


def _norm_report(red: Reduction) -> NormReport:
    spec = red.implied_spec()
    return NormReport(red.node, red.kind, red.op, red.precision, red.epsilon, red.axes,
                      spec.describe() if spec is not None else "-")


def _record_what_ran(optimized: Path, label: str, sites: list[NormSite], norms: list[NormReport],
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
