"""Build a TensorRT engine from one of our ONNX graphs, and prove where its norms run.

``build_engine`` does, in order (everything that can be checked without TensorRT first, so
a bad flag fails in a second, not after a build):

1. read the model (external data stays beside it), its metadata, and resolve the
   optimization profile (``profiles.py``); prepare the graph for the parser (``prepare.py``:
   our functions inlined, or mapped to the plugin); refuse outputs that exist without ``force``;
2. import TensorRT, find the GPU, load the plugin when asked;
3. parse with a strongly typed network (:func:`network_flags`: ``STRONGLY_TYPED`` on 10.x, where
   it is required for strong typing; not set on 11.x, where it is deprecated and ignored because
   weak typing and ``BuilderFlag.FP16`` are gone; and the plugin's ``PREFER_AOT``/``PREFER_JIT``
   flag for the implementation asked for). Precision is what the graph says, so an fp16 graph with
   float32 casts around its norm gives an fp16 engine whose reduction runs in float32. Every
   parser error is reported with its node name and op;
4. check each norm's reduction dtype in the network (``precision.py``), then build with a
   timing cache, the profile, ``ProfilingVerbosity.DETAILED`` and a progress bar;
5. inspect the built engine (``IEngineInspector``) and attach the layers of each norm;
6. write the engine and its JSON sidecar (``sidecar.py``) atomically.

TensorRT API used (10.9 to 11.x, from the TensorRT Python API docs and the bindings in
NVIDIA/TensorRT ``python/src``): ``Builder``, ``create_network``, ``OnnxParser.parse(model,
path)``, ``get_error(i).node_name()/node_operator()/desc()``, ``create_builder_config``,
``set_memory_pool_limit``, ``create_timing_cache``/``set_timing_cache``/``get_timing_cache``,
``create_optimization_profile``/``set_shape``, ``progress_monitor``, ``profiling_verbosity``,
``build_serialized_network``, ``Runtime.deserialize_cuda_engine``, ``create_engine_inspector``,
``get_layer_information(i, LayerInformationFormat.JSON)``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import onnx

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_file import (
    atomic_path,
    check_model_file,
    ensure_writable,
    load_onnx,
)
from rmsnorm_deploy.resources import __version__
from rmsnorm_deploy.table import format_table
from rmsnorm_deploy.tensorrt.precision import (
    LayerRecord,
    NormPrecision,
    check_engine,
    check_network,
    engine_record,
    raise_on_failures,
)
from rmsnorm_deploy.tensorrt.prepare import PreparedModel, prepare_for_tensorrt
from rmsnorm_deploy.tensorrt.profiles import Profiles, engine_profiles, profiles_to_dict
from rmsnorm_deploy.tensorrt.progress import BuildProgress, progress_monitor
from rmsnorm_deploy.tensorrt.runtime import (
    PLUGIN_IMPLEMENTATIONS,
    PluginError,
    import_tensorrt,
    make_logger,
    register_plugin,
    trt_dtype_name,
    trt_version,
)
from rmsnorm_deploy.tensorrt.sidecar import (
    Device,
    Sidecar,
    sha256_bytes,
    sha256_file,
    sidecar_path,
    write_sidecar,
)


if TYPE_CHECKING:  # the stubs' types (make typecheck-tensorrt); tensorrt itself is imported lazily
    import tensorrt


class ParseError(UserError):
    """TensorRT's ONNX parser rejected the model."""


class BuildError(UserError):
    """TensorRT could not build an engine from a parsed network."""


@dataclasses.dataclass
class BuildReport:
    """What was built, for which device, and how each norm runs in it."""

    engine_path: Path
    sidecar_path: Path
    onnx_path: Path
    tensorrt_version: str
    gpu: str
    compute_capability: str
    profiles: Profiles
    plugin: dict[str, Any] | None
    norms: list[NormPrecision]
    notes: list[str]
    build_seconds: float
    timing_cache: Path | None = None
    engine_bytes: int = 0

    @property
    def plugin_used(self) -> bool:
        return self.plugin is not None

    @property
    def ok(self) -> bool:
        return all(n.ok for n in self.norms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": str(self.engine_path), "sidecar": str(self.sidecar_path), "onnx": str(self.onnx_path),
            "tensorrt": self.tensorrt_version, "gpu": self.gpu, "compute_capability": self.compute_capability,
            "profiles": self.profiles.to_dict(), "plugin": self.plugin, "norms": [n.to_dict() for n in self.norms],
            "notes": self.notes, "build_seconds": round(self.build_seconds, 3),
            "timing_cache": str(self.timing_cache) if self.timing_cache else None, "engine_bytes": self.engine_bytes,
        }

    def summary(self) -> str:
        head = (f"engine {self.engine_path} ({self.engine_bytes / 2**20:.1f} MiB) built in {self.build_seconds:.1f} s "
                f"with TensorRT {self.tensorrt_version} for {self.gpu} (sm_{self.compute_capability.replace('.', '')}); "
                f"profile {self.profiles.describe()}; plugin: "
                + (f"{self.plugin.get('name')} ({self.plugin.get('namespace')}, v{self.plugin.get('version')})"
                   if self.plugin else "not used"))
        rows = []
        for n in self.norms:
            engine = ", ".join(sorted({r.type for r in n.engine_layers})) or "-"
            rows.append([n.norm, n.implementation, n.reduction, engine, "ok" if n.ok else "FAIL: " + n.problem])
        table = format_table(["norm", "implemented by", "reduction dtype", "engine layers", "status"], rows)
        notes = [n for n in self.notes] + [f"{n.norm}: {n.engine_note}" for n in self.norms if n.engine_note]
        return "\n".join([head, "", table] + ([""] + [f"note: {t}" for t in notes] if notes else []))


def default_engine_path(onnx_path: str | Path, plugin: bool) -> Path:
    """``model.engine`` beside ``model.onnx`` (``model.plugin.engine`` with the plugin)."""
    p = Path(onnx_path)
    return p.with_name(p.stem + (".plugin.engine" if plugin else ".engine"))


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes from ``1073741824``, ``"512M"``, ``"4G"``, ``"4GiB"`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE_RE.match(str(value))
        if not match:
            raise UserError(f"--workspace {value!r} is not a size; write it like 4G, 512M or 1073741824")
        number, unit = float(match.group(1)), match.group(2).lower()
        size = int(number * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit])
    if size <= 0:
        raise UserError(f"--workspace must be positive, got {value!r}")
    return size


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path | None = None,
    *,
    profiles: Mapping[str, Sequence[int]] | Iterable[str] | None = None,
    plugin: bool = False,
    plugin_impl: str = "aot",
    timing_cache: str | Path | None = None,
    workspace: int | str | None = None,
    force: bool = False,
    progress: bool = True,
) -> BuildReport:
    """Build a strongly typed TensorRT engine from ``onnx_path``; see the module doc.

    ``profiles``: ``{"d0": (1, 64, 256)}`` or ``["d0:1,64,256"]``, per dynamic dim; dims not
    given take the range in the model's metadata. ``plugin``: map every
    ``rmsnorm_deploy::RMSNorm`` node to the RMSNorm plugin (loaded here); ``plugin_impl``: its
    ``aot`` implementation (compiled into the engine) or ``jit`` (Python at run time). ``timing_cache``: a
    file read if present and updated after the build. ``workspace``: a byte count or
    ``"4G"``. Raises :class:`UserError` (one line) for bad input, :class:`PrecisionError`
    (exit code 1) if a norm's reduction would run below float32.
    """
    if plugin_impl not in PLUGIN_IMPLEMENTATIONS:
        raise UserError(f"unknown plugin implementation {plugin_impl!r}; choose one of "
                        f"{', '.join(PLUGIN_IMPLEMENTATIONS)}")
    if plugin_impl != "aot" and not plugin:
        raise UserError(f"--plugin-impl {plugin_impl} chooses how the plugin runs; add --plugin")
    onnx_path = check_model_file(onnx_path)
    model = load_onnx(onnx_path, load_external=False)
    meta = ModelMetadata.read(model)
    profile_list = engine_profiles(model, meta, profiles)
    resolved = profile_list[0]
    prepared = prepare_for_tensorrt(model, plugin=plugin)
    engine_path = Path(engine_path) if engine_path is not None else default_engine_path(onnx_path, plugin)
    side_path = sidecar_path(engine_path)
    ensure_writable(engine_path, force=force)
    ensure_writable(side_path, force=force)
    workspace_bytes = parse_size(workspace) if workspace is not None else None
    cache_path = Path(timing_cache) if timing_cache is not None else None
    if cache_path is not None and cache_path.is_dir():
        raise UserError(f"--timing-cache {cache_path} is a folder; give a file path")


    trt = import_tensorrt("building a TensorRT engine")
    device = Device.current(trt_version(trt))
    plugin_info = register_plugin(implementation=plugin_impl) if plugin else None
    flags = network_flags(trt, plugin_info)
    logger = make_logger(trt)
    builder = trt.Builder(logger)
    network = _parse(trt, builder, logger, prepared, onnx_path, flags)
    norms = check_network(prepared.sites, _network_records(trt, network))
    raise_on_failures(norms, "TensorRT's network")

    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    cache = _load_timing_cache(config, cache_path)
    for each in profile_list:  # a KV-cache graph: prefill (index 0) and decode (index 1)
        _add_profile(trt, builder, config, network, each)
    plan, seconds = _serialize(trt, builder, network, config, logger, onnx_path, progress)
    if cache_path is not None:
        _save_timing_cache(config, cache, cache_path)

    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise BuildError(f"TensorRT cannot load the engine it just built: {logger.last_errors()}")
    check_engine(norms, prepared.sites, _engine_records(trt, engine))
    raise_on_failures(norms, "the built engine")

    sidecar = Sidecar(
        engine_sha256=sha256_bytes(plan),
        device=device,
        profiles=profiles_to_dict(profile_list),
        plugin=plugin_info,
        source_model={"path": str(onnx_path.resolve()), "sha256": sha256_file(onnx_path)},
        lowering=meta.lowering if meta else "",
        dtype=meta.dtype if meta else "",
        norms=[n.to_dict() for n in norms],
        built_by=_built_by(),
    )
    with atomic_path(engine_path, force=force) as tmp_engine, atomic_path(side_path, force=force) as tmp_side:
        tmp_engine.write_bytes(plan)
        write_sidecar(sidecar, tmp_side)
    return BuildReport(engine_path, side_path, onnx_path, device.tensorrt, device.gpu, device.compute_capability,
                       resolved, plugin_info, norms, prepared.notes, seconds, cache_path, len(plan))


def _serialize(trt: Any, builder: tensorrt.Builder, network: tensorrt.INetworkDefinition,
               config: tensorrt.IBuilderConfig, logger: Any, onnx_path: Path,
               progress: bool) -> tuple[bytes, float]:
    """The engine's bytes and the build's seconds, with the progress bar fed by ``IProgressMonitor``."""
    bar = None
    if progress:

        bar = BuildProgress()
        config.progress_monitor = progress_monitor(trt, bar)
    start = time.perf_counter()
    try:
        serialized = builder.build_serialized_network(network, config)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    if bar is not None and bar.cancelled:
        raise BuildError("the build was cancelled")
    if serialized is None:
        raise BuildError(f"TensorRT could not build an engine from {onnx_path}: {logger.last_errors()}")
    return bytes(memoryview(serialized)), seconds


def _built_by() -> str:

    return f"rmsnorm-deploy {__version__}"


def network_flags(trt: Any, plugin_info: Mapping[str, Any] | None) -> int:
    """The ``NetworkDefinitionCreationFlag`` bits for ``builder.create_network``.

    ``STRONGLY_TYPED`` only on TensorRT 10.x and only where the enum has it: TensorRT 11
    deprecates it (every network is strongly typed) and ignores it. With the plugin, the flag
    its ``network_flags`` name (``PREFER_AOT_PYTHON_PLUGINS`` or ``PREFER_JIT_PYTHON_PLUGINS``):
    TensorRT needs it to choose between a plugin's two implementations, and a flag this TensorRT
    lacks for a requested implementation is an error, not a silent other choice.
    """

    enum = trt.NetworkDefinitionCreationFlag
    flags = 0
    major = re.match(r"\d+", trt_version(trt))
    strongly_typed = getattr(enum, "STRONGLY_TYPED", None)
    if strongly_typed is not None and (major is None or int(major.group()) < 11):
        flags |= 1 << int(strongly_typed)
    if plugin_info:
        names = plugin_info.get("network_flags") or []
        for name in [names] if isinstance(names, str) else names:
            member = getattr(enum, name, None)
            if member is None:
                raise PluginError(f"TensorRT {trt_version(trt)} has no NetworkDefinitionCreationFlag.{name}, which "
                                  f"the plugin's {plugin_info.get('implementation')} implementation needs")
            flags |= 1 << int(member)
    return flags


def _parse(trt: Any, builder: tensorrt.Builder, logger: Any, prepared: PreparedModel, onnx_path: Path,
           flags: int) -> tensorrt.INetworkDefinition:

    network = builder.create_network(flags)
    if hasattr(trt, "init_libnvinfer_plugins"):
        trt.init_libnvinfer_plugins(logger, "")
    parser = trt.OnnxParser(network, logger)
    ok = parser.parse(prepared.model.SerializeToString(), str(onnx_path))
    if not ok or parser.num_errors:
        errors = [parser_error(parser.get_error(i), prepared.model) for i in range(parser.num_errors)]
        raise ParseError(format_parse_errors(trt_version(trt), onnx_path, errors, logger.last_errors()))
    return network


@dataclasses.dataclass(frozen=True)
class ParserErrorInfo:
    """One ``IParserError``: the node it is about and what went wrong."""

    node: str
    op: str
    desc: str
    code: str = ""
    function_stack: tuple[str, ...] = ()


def parser_error(error: Any, model: onnx.ModelProto) -> ParserErrorInfo:
    """A :class:`ParserErrorInfo` from a ``trt.IParserError``; the node found by index when unnamed."""

    def call(name: str, default: Any = "") -> Any:
        fn = getattr(error, name, None)
        try:
            return fn() if callable(fn) else default
        except Exception:
            return default

    node_name, op = str(call("node_name") or ""), str(call("node_operator") or "")
    index = call("node", -1)
    if (not node_name or not op) and isinstance(index, int) and 0 <= index < len(model.graph.node):
        node = model.graph.node[index]
        node_name, op = node_name or node.name, op or node.op_type
    stack = call("local_function_stack", []) or []
    return ParserErrorInfo(node_name or "(graph)", op or "?", " ".join(str(call("desc")).split()),
                           str(call("code")), tuple(str(s) for s in stack))


def format_parse_errors(version: str, onnx_path: Path, errors: Sequence[ParserErrorInfo], logged: str) -> str:
    """One line naming every rejected node and op, and the static check that explains it."""
    if not errors:
        return (f"TensorRT {version}'s ONNX parser rejected {onnx_path}: {logged}; run `rmsnorm-deploy check-trt "
                f"{onnx_path}` for what this TensorRT imports")
    parts = []
    for e in errors:
        where = f"node {e.node!r} ({e.op})"
        if e.function_stack:
            where += f" in function {' > '.join(e.function_stack)}"
        parts.append(f"{where}: {e.desc}")
    return (f"TensorRT {version}'s ONNX parser rejected {onnx_path} ({len(errors)} error(s)): " + "; ".join(parts)
            + f"; run `rmsnorm-deploy check-trt {onnx_path} --trt-version {'.'.join(version.split('.')[:2])}` for the fix")


def _network_records(trt: Any, network: tensorrt.INetworkDefinition) -> list[LayerRecord]:

    records = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)

        def dtypes(count: int, get: Any) -> tuple[str, ...]:
            out = []
            for j in range(count):
                tensor = get(j)
                out.append(trt_dtype_name(tensor.dtype) if tensor is not None else "none")
            return tuple(out)

        records.append(LayerRecord(
            str(layer.name), str(layer.type.name), str(getattr(layer, "metadata", "") or ""),
            dtypes(layer.num_inputs, layer.get_input), dtypes(layer.num_outputs, layer.get_output),
        ))
    return records


def _engine_records(trt: Any, engine: tensorrt.ICudaEngine) -> list[LayerRecord]:
    inspector = engine.create_engine_inspector()
    records = []
    for i in range(engine.num_layers):
        text = inspector.get_layer_information(i, trt.LayerInformationFormat.JSON)
        try:
            info = json.loads(text)
        except (TypeError, ValueError):
            info = text
        records.append(engine_record(info))
    return records


def _add_profile(trt: Any, builder: tensorrt.Builder, config: tensorrt.IBuilderConfig,
                 network: tensorrt.INetworkDefinition, resolved: Profiles) -> None:
    profile = builder.create_optimization_profile()
    dynamic = 0
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        # Dims iterates and tuples convert to Dims (pybind11); tensorrt-stubs 10.13 declares neither
        shape: tuple[int, ...] = tuple(tensor.shape)  # type: ignore[arg-type]
        if all(d >= 0 for d in shape):
            continue
        spec = resolved.inputs.get(tensor.name)
        if spec is None:
            raise UserError(f"TensorRT's network input {tensor.name!r} has dynamic shape {list(shape)} but the model "
                            "declares no such input; re-export the model")
        if len(spec.min) != len(shape):
            raise UserError(f"input {tensor.name!r}: the model declares rank {len(spec.min)}, TensorRT sees "
                            f"{list(shape)}; re-export the model")
        try:
            profile.set_shape(tensor.name, spec.min, spec.opt, spec.max)  # type: ignore[arg-type]
        except RuntimeError as exc:
            raise UserError(f"the profile of input {tensor.name!r} ({list(spec.min)} .. {list(spec.max)}) does not fit "
                            f"its shape {list(shape)}: {exc}") from None
        dynamic += 1
    if dynamic:
        config.add_optimization_profile(profile)


def _load_timing_cache(config: tensorrt.IBuilderConfig, path: Path | None) -> tensorrt.ITimingCache:
    data = path.read_bytes() if path is not None and path.is_file() else b""
    cache = config.create_timing_cache(data)
    if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
        raise UserError(f"--timing-cache {path}: TensorRT cannot use it (written by another TensorRT version or GPU, "
                        "or damaged); delete it or give another path")
    return cache


def _save_timing_cache(config: tensorrt.IBuilderConfig, cache: tensorrt.ITimingCache, path: Path) -> None:
    updated = config.get_timing_cache() or cache
    blob = updated.serialize()
    with atomic_path(path, force=True) as tmp:
        tmp.write_bytes(bytes(memoryview(blob)))
