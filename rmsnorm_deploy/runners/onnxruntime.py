"""ONNX Runtime runner: CPU, CUDA and TensorRT execution providers, never a silent fallback.

onnxruntime-gpu asked for CUDA without the CUDA libraries logs an error and runs the whole
model on the CPU. This runner compares the providers the session really uses with the ones
that were asked for and raises :class:`ProviderError` naming what is missing.

ONNX Runtime may also place single nodes on the CPU provider while the session reports CUDA
(only a warning says so). The runner records which provider runs each node (ONNX Runtime's
``session.record_ep_graph_assignment_info`` and ``get_provider_graph_assignment_info``, in
1.32) into :attr:`OnnxRuntimeRunner.node_assignment`; with ``require_all_nodes_on_provider`` any
compute node off the requested providers is a :class:`ProviderError` naming the nodes.

Before a CUDA or TensorRT session, ``onnxruntime.preload_dlls()`` (where it exists) loads the CUDA and
cuDNN libraries of NVIDIA's pip wheels, which ONNX Runtime finds only then (or after torch was imported).

bfloat16 has no numpy dtype in ONNX Runtime's Python API: inputs go in as ``OrtValue``s made
from a uint16 view, outputs come back through an ``IOBinding`` and are read from memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import ml_dtypes
import numpy as np
import onnx

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.errors import InputError, ProviderError, UserError, one_line
from rmsnorm_deploy.graph.onnx_file import check_model_file
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.runners.base import Runner
from rmsnorm_deploy.runners.int8_gemm import exact_integer_matmuls

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
OPTIMIZATION_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
                       "all": "ORT_ENABLE_ALL"}  # our names: ONNX Runtime's GraphOptimizationLevel members


def optimization_level(name: str) -> Any:
    """ONNX Runtime's ``GraphOptimizationLevel`` called ``name`` (a key of :data:`OPTIMIZATION_LEVELS`)."""
    return getattr(require("onnxruntime", "the ONNX Runtime runner").GraphOptimizationLevel, OPTIMIZATION_LEVELS[name])


_ORT_TYPE_NAMES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(bfloat16)": "bfloat16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(bool)": "bool",
}
_BF16 = np.dtype(ml_dtypes.bfloat16)
#: The session option that makes ONNX Runtime keep each node's provider for
#: ``InferenceSession.get_provider_graph_assignment_info()``.
RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"
#: Session options that write the optimized model's initializers of 1 KB and more to a file beside it.
OPTIMIZED_DATA = "session.optimized_model_external_initializers_file_name"
OPTIMIZED_DATA_MIN_BYTES = "session.optimized_model_external_initializers_min_size_in_bytes"
#: Providers whose libraries ``onnxruntime.preload_dlls()`` helps find.
_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
#: Ops that only move data between devices (inserted by ONNX Runtime), and ops that only
#: compute shapes or constants, which GPU providers leave on the CPU on purpose.
_TRANSFER_OPS = frozenset({"MemcpyToHost", "MemcpyFromHost"})
_SHAPE_OPS = frozenset({"Shape", "Size", "Constant", "ConstantOfShape", "Range"})
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                          onnx.TensorProto.DOUBLE})


@dataclasses.dataclass(frozen=True)
class AssignedNode:
    """One node of the session's (optimized) graph and the provider ONNX Runtime gave it."""

    name: str
    op_type: str
    domain: str
    provider: str

    def describe(self) -> str:
        op = f"{self.domain}::{self.op_type}" if self.domain not in ("", "ai.onnx") else self.op_type
        return f"{self.name or '(unnamed)'} ({op}) on {short_provider_name(self.provider)}"


@dataclasses.dataclass(frozen=True)
class NodeAssignment:
    """Which provider runs each node of a session, as ONNX Runtime assigned them."""

    nodes: tuple[AssignedNode, ...]

    @property
    def counts(self) -> dict[str, int]:
        """Nodes per provider (short names: ``cpu``, ``cuda``, ``tensorrt``), most first."""
        counts: dict[str, int] = {}
        for node in self.nodes:
            key = short_provider_name(node.provider)
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def describe(self) -> str:
        return ", ".join(f"{n} on {p}" for p, n in self.counts.items()) or "no nodes"

    def off_providers(self, providers: Sequence[str], model: Any = None) -> list[AssignedNode]:
        """The compute nodes not on ``providers`` (ONNX Runtime's names).

        Not compute: device copies, and shape/constant ops. A node that is in ``model``
        (found by name) computes when one of its outputs is a floating-point tensor; a node
        ONNX Runtime made (a fusion) computes unless it is a shape op. Unknown types count as
        compute: a node is never excused without evidence.
        """
        wanted = set(providers)
        off = [n for n in self.nodes if n.provider not in wanted and n.op_type not in _TRANSFER_OPS]
        if not off:
            return []
        output_types = _node_output_types(model) if model is not None else {}
        found = []
        for node in off:
            types = output_types.get(node.name)
            if types is None:
                if node.op_type in _SHAPE_OPS:
                    continue
            elif types and not any(t in _FLOAT_TYPES or t == 0 for t in types):
                continue
            found.append(node)
        return found

    def to_dict(self) -> dict[str, Any]:
        return {"counts": self.counts, "nodes": [dataclasses.asdict(n) for n in self.nodes]}


def node_assignment(session: Any) -> NodeAssignment | None:
    """The session's node assignment, or ``None`` where this ONNX Runtime cannot report it
    (``get_provider_graph_assignment_info`` missing, or the session option was not set)."""
    getter = getattr(session, "get_provider_graph_assignment_info", None)
    if getter is None:
        return None
    try:
        subgraphs = getter()
    except Exception:  # noqa: BLE001 - ORT raises its own Fail type: no node assignment, said so
        return None
    nodes = []
    for subgraph in subgraphs:
        provider = str(subgraph.ep_name)
        for node in subgraph.get_nodes():
            nodes.append(AssignedNode(str(node.name), str(node.op_type), str(node.domain), provider))
    return NodeAssignment(tuple(nodes))


def _node_output_types(model: Any) -> dict[str, tuple[int, ...]]:
    """Node name -> its outputs' element types (0 where unknown), from the model with inferred shapes."""
    if not isinstance(model, onnx.ModelProto):
        try:
            model = onnx.load(model if isinstance(model, (str, os.PathLike)) else io.BytesIO(model),
                              load_external_data=False)
        except Exception:  # noqa: BLE001 - an unreadable model: no types, so every node counts
            return {}
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001, S110 - inference is best effort: untyped nodes count
        pass
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.output) + list(g.value_info)}
    types.update({i.name: i.data_type for i in g.initializer})
    return {n.name: tuple(types.get(o, 0) for o in n.output if o) for n in g.node if n.name}


def short_provider_name(full: str) -> str:
    """ONNX Runtime's provider name to ours (``CUDAExecutionProvider`` -> ``cuda``)."""
    return {v: k for k, v in PROVIDERS.items()}.get(full, full)


def provider_name(short: str) -> str:
    """``cpu``/``cuda``/``tensorrt`` (or the full ORT name) to ONNX Runtime's provider name."""
    key = short.strip().lower()
    if key in PROVIDERS:
        return PROVIDERS[key]
    for full in PROVIDERS.values():
        if short == full:
            return full
    raise UserError(f"unknown provider {short!r}; choose from {', '.join(PROVIDERS)}")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads: Any, flag: str = "--threads") -> None:
    """Intra-op threads: an integer from 1 to the CPUs this process may use (more only slows the
    kernels down, and ONNX Runtime takes an int32); ``None`` leaves ONNX Runtime's default."""
    if threads is None:
        return
    cpus = usable_cpus()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cpus:
        raise UserError(f"{flag} {threads!r}: give an integer from 1 to {cpus} (the CPUs this process may use), or "
                        "leave it out for ONNX Runtime's default")


class OnnxRuntimeRunner(Runner):
    """Runs an ONNX model with ONNX Runtime on the requested providers, or refuses.

    ``providers`` are short names (``cpu``, ``cuda``, ``tensorrt``) or ONNX Runtime's, in
    priority order; every one of them must be in the session ONNX Runtime creates, or
    :class:`ProviderError` says what is missing. ``provider_options`` maps a provider (short
    or full name) to its options, e.g. ``{"cuda": {"device_id": "1"}}``.
    """

    backend = "onnxruntime"

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto,
        providers: Sequence[str] = ("cpu",),
        *,
        optimization: str = "all",
        provider_options: dict[str, dict[str, Any]] | None = None,
        optimized_model_path: str | os.PathLike | None = None,
        intra_op_threads: int | None = None,
        require_all_nodes_on_provider: bool = False,
    ):
        super().__init__()
        if optimization not in OPTIMIZATION_LEVELS:
            raise UserError(f"unknown optimization level {optimization!r}; choose from {', '.join(OPTIMIZATION_LEVELS)}")
        if not providers:
            raise UserError("no provider requested; give at least one of cpu, cuda, tensorrt")
        self.model = model
        self.requested = list(dict.fromkeys(provider_name(p) for p in providers))
        self.optimization = optimization
        self.provider_options = {provider_name(k): {str(a): str(b) for a, b in v.items()}
                                 for k, v in (provider_options or {}).items()}
        unused = sorted(set(self.provider_options) - set(self.requested))
        if unused:
            raise UserError(f"options given for {', '.join(unused)}, which was not requested; requested: "
                            f"{', '.join(self.requested)}")
        self.optimized_model_path = optimized_model_path
        check_threads(intra_op_threads)
        self.intra_op_threads = intra_op_threads
        self.require_all_nodes_on_provider = require_all_nodes_on_provider
        self.session: Any = None
        self.actual_providers: list[str] = []
        #: Which provider runs each node (``None``: this ONNX Runtime cannot say).
        self.node_assignment: NodeAssignment | None = None

    @property
    def name(self) -> str:
        return f"onnxruntime[{','.join(short_provider_name(p) for p in self.requested)}]"

    def _activate(self) -> None:
        ort = require("onnxruntime", "the ONNX Runtime runner")
        available = ort.get_available_providers()
        for prov in self.requested:
            if prov not in available:
                raise ProviderError(
                    f"{prov} is not in this onnxruntime build (it has {', '.join(available)}); "
                    + ("install onnxruntime-gpu (CUDA 13) in place of onnxruntime" if prov != PROVIDERS["cpu"] else "reinstall onnxruntime")
                )
        options = exact_integer_matmuls(ort.SessionOptions())
        options.graph_optimization_level = optimization_level(self.optimization)
        if self.optimized_model_path is not None:
            options.optimized_model_filepath = str(self.optimized_model_path)
            # its weights beside it, not in it: readers of the optimized graph want the graph, and
            # ONNX Runtime would otherwise build it in memory with a copy of every weight
            options.add_session_config_entry(OPTIMIZED_DATA, Path(self.optimized_model_path).name + ".data")
            options.add_session_config_entry(OPTIMIZED_DATA_MIN_BYTES, "1024")
        if self.intra_op_threads is not None:
            options.intra_op_num_threads = self.intra_op_threads
        options.log_severity_level = 3
        can_record = hasattr(ort.InferenceSession, "get_provider_graph_assignment_info")
        if can_record:
            options.add_session_config_entry(RECORD_ASSIGNMENT, "1")
        elif self.require_all_nodes_on_provider:
            raise ProviderError(f"onnxruntime {getattr(ort, '__version__', '?')} cannot report which provider runs "
                                "each node (no InferenceSession.get_provider_graph_assignment_info); install "
                                "onnxruntime >= 1.32 or drop --require-all-nodes-on-provider")
        if any(p in _GPU_PROVIDERS for p in self.requested) and hasattr(ort, "preload_dlls"):
            # NVIDIA's pip wheels (nvidia-*-cu13) are found only after this, or after importing torch.
            try:
                ort.preload_dlls()
            except Exception as exc:  # noqa: BLE001 - reported as a ProviderError
                raise ProviderError(f"onnxruntime.preload_dlls() failed: {one_line(exc)}; "
                                    + _why_provider_cannot_load(self.requested[0])) from None
        source = _session_source(self.model)
        providers = [(p, self.provider_options.get(p, {})) for p in self.requested]
        # enable_fallback=0: ONNX Runtime's Python layer would otherwise retry a failing
        # TensorRT or CUDA session on other providers and only print that it did.
        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(captured):
                self.session = ort.InferenceSession(source, options, providers=providers, enable_fallback=0)
        except Exception as exc:
            failing = [p for p in self.requested if p != PROVIDERS["cpu"]]
            if failing and _looks_like_provider_failure(exc):
                raise ProviderError(f"{', '.join(failing)} failed to start: {one_line(exc)}; "
                                    + _why_provider_cannot_load(failing[0])) from None
            raise UserError(f"ONNX Runtime cannot load the model: {one_line(exc)}") from None
        actual = self.session.get_providers()
        missing = [p for p in self.requested if p not in actual]
        if missing:
            self.session = None
            raise ProviderError(
                f"requested {', '.join(missing)} but ONNX Runtime created a session on {', '.join(actual)}: "
                f"{_why_provider_cannot_load(missing[0])}; refusing to report CPU numbers as GPU numbers"
            )
        self.actual_providers = actual
        self.node_assignment = node_assignment(self.session) if can_record else None
        if self.require_all_nodes_on_provider:
            self._check_node_assignment()

    def _check_node_assignment(self) -> None:
        """Refuse a session in which a compute node runs on a provider that was not requested."""
        if self.node_assignment is None:
            self.session = None
            raise ProviderError("ONNX Runtime did not report which provider runs each node; cannot check "
                                "--require-all-nodes-on-provider")
        off = self.node_assignment.off_providers(self.requested, self.model)
        if off:
            self.session = None
            shown = "; ".join(n.describe() for n in off[:8]) + (f"; +{len(off) - 8} more" if len(off) > 8 else "")
            wanted = ", ".join(short_provider_name(p) for p in self.requested)
            raise ProviderError(f"{len(off)} of {len(self.node_assignment.nodes)} nodes run outside the requested "
                                f"provider(s) {wanted}: {shown}; the provider has no kernel for them (run with "
                                "RMSNORM_DEPLOY_ORT_LOG_LEVEL=1 for ONNX Runtime's reason)")

    def _deactivate(self) -> None:
        self.session = None

    def input_types(self) -> dict[str, tuple[str, list[Any]]]:
        """Each input's dtype name and shape (ints, or strings for dynamic dims)."""
        return {i.name: (_ORT_TYPE_NAMES.get(i.type, i.type), list(i.shape)) for i in self.session.get_inputs()}

    def output_names(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ort = require("onnxruntime", "the ONNX Runtime runner")
        from onnx import TensorProto

        expected = self.input_types()
        unknown = sorted(set(feed) - set(expected))
        missing = sorted(set(expected) - set(feed))
        if unknown or missing:
            raise InputError(f"inputs do not match the model: missing {missing}, unexpected {unknown}; "
                             f"the model takes {sorted(expected)}")
        binding = self.session.io_binding()
        keep_alive = []
        for name, array in feed.items():
            want_dtype, want_shape = expected[name]
            array = np.ascontiguousarray(array)
            got = _array_dtype_name(array)
            if got != want_dtype:
                raise InputError(f"input {name!r} is {got} but the model wants {want_dtype}; convert it first")
            if len(want_shape) != array.ndim or any(
                isinstance(w, int) and w != g for w, g in zip(want_shape, array.shape)
            ):
                raise InputError(f"input {name!r} has shape {list(array.shape)} but the model wants {want_shape}")
            if array.dtype == _BF16:
                value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), TensorProto.BFLOAT16)
            else:
                value = ort.OrtValue.ortvalue_from_numpy(array)
            keep_alive.append((array, value))
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names():
            binding.bind_output(name, "cpu")
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:
            raise UserError(f"ONNX Runtime failed to run the model: {one_line(exc)}") from None
        return {name: ortvalue_to_numpy(v) for name, v in zip(self.output_names(), binding.get_outputs())}


def optimized_graph(model: onnx.ModelProto | str | os.PathLike, *, optimization: str = "all",
                    providers: Iterable[str] = ("cpu",)) -> onnx.ModelProto:
    """The graph ONNX Runtime runs for ``model`` (``optimized_model_filepath``), without its weights' data."""
    with tempfile.TemporaryDirectory(prefix="rmsnorm-optimized-") as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        with OnnxRuntimeRunner(model, list(providers), optimization=optimization, optimized_model_path=optimized):
            pass
        return onnx.load(str(optimized), load_external_data=False)


def ortvalue_to_numpy(value: Any) -> np.ndarray:
    """A CPU ``OrtValue`` as a numpy array that owns its memory (bfloat16 as ml_dtypes)."""
    if value.data_type() != "tensor(bfloat16)":
        return np.array(value.numpy(), copy=True)
    shape = tuple(value.shape())
    count = int(np.prod(shape)) if shape else 1
    buffer = (ctypes.c_uint16 * count).from_address(value.data_ptr()) if count else (ctypes.c_uint16 * 0)()
    return np.array(np.ctypeslib.as_array(buffer), copy=True).reshape(shape).view(_BF16)


def _array_dtype_name(array: np.ndarray) -> str:
    try:
        return dtype_name(array.dtype)
    except UserError:
        return str(array.dtype)


def _session_source(model: str | os.PathLike | bytes | onnx.ModelProto) -> str | bytes:
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString()
    if isinstance(model, bytes):
        return model

    return str(check_model_file(Path(model)))


#: The shared library that holds each GPU provider, inside onnxruntime/capi.
_PROVIDER_LIBRARIES = {
    "CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
    "TensorrtExecutionProvider": "libonnxruntime_providers_tensorrt.so",
}
_LIBRARY_HINTS = {
    "libcuda.so": "the NVIDIA driver",
    "libcudart.so": "the CUDA 13 runtime",
    "libcublas": "cuBLAS (CUDA 13)",
    "libcurand": "cuRAND (CUDA 13)",
    "libcufft": "cuFFT (CUDA 13)",
    "libcudnn": "cuDNN 9",
    "libnvinfer": "TensorRT",
    "libnvonnxparser": "TensorRT's ONNX parser",
}


def _why_provider_cannot_load(provider: str) -> str:
    """Why ONNX Runtime could not start ``provider`` here: missing libraries or no GPU."""
    missing = missing_provider_libraries(provider)
    if missing:
        named = ", ".join(f"{lib} ({_hint(lib)})" for lib in missing)
        return (f"{_PROVIDER_LIBRARIES[provider]} cannot load, missing {named}; install them (e.g. from NVIDIA's "
                "CUDA 13/cuDNN 9 packages) on the library path, or use the Docker image")
    if provider in _PROVIDER_LIBRARIES and not _gpu_visible():
        return "its libraries load but no NVIDIA GPU is visible (no /dev/nvidia0; in a container pass --gpus all)"
    return "the provider's libraries load; see ONNX Runtime's log (set ORT_LOGGING_LEVEL or run with log severity 0)"


def missing_provider_libraries(provider: str) -> list[str]:
    """The shared libraries a GPU provider needs that the dynamic loader cannot find."""
    library = _PROVIDER_LIBRARIES.get(provider)
    if library is None:
        return []
    try:
        import onnxruntime
    except ImportError:
        return []
    path = Path(onnxruntime.__file__).parent / "capi" / library
    if not path.exists():
        return [library]
    ldd = shutil.which("ldd")
    if ldd:
        try:
            out = subprocess.run([ldd, str(path)], capture_output=True, text=True, timeout=30).stdout
            return [line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line]
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:  # without ldd: the loader names the first missing library
        ctypes.CDLL(str(path.parent / "libonnxruntime_providers_shared.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(path))
    except OSError as exc:
        return [str(exc).split(":")[0].strip()]
    return []


def _hint(library: str) -> str:
    return next((what for prefix, what in _LIBRARY_HINTS.items() if library.startswith(prefix)), "a dependency")


def _gpu_visible() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/dev/dxg").exists()


def _looks_like_provider_failure(exc: BaseException) -> bool:
    text = str(exc)
    return any(k in text for k in ("Please install", "Failed to load library", "provider_bridge", "EP Error",
                                   "RegisterTensorRTPluginsAsCustomOps", "Failed to create"))


def set_onnxruntime_log_level(default: int = 4) -> None:
    """Silence ONNX Runtime's own console log (CLI use): its failures become our one-line errors.

    ``RMSNORM_DEPLOY_ORT_LOG_LEVEL`` (0 verbose .. 4 fatal) overrides ``default`` to see it again.
    """
    ort = require("onnxruntime", "the ONNX Runtime runner")
    level = os.environ.get("RMSNORM_DEPLOY_ORT_LOG_LEVEL", "")
    ort.set_default_logger_severity(int(level) if level.isdigit() and int(level) <= 4 else default)
