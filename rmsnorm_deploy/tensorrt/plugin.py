"""The TensorRT plugin ``RMSNorm`` (namespace ``rmsnorm_deploy``, version ``1``).

The fused Triton kernel (``kernels/triton_rmsnorm.py``) behind TensorRT's quickly
deployable plugins (``tensorrt.plugin``): ``@trtp.register`` describes the output,
``@trtp.aot_impl`` compiles the kernel to PTX while the engine is built, so the engine
carries the kernel and runs without Python (``trtexec``, C++), and ``@trtp.impl`` is the
same kernel called from Python at run time (for debugging). The definitions live in
``_qdp.py``, which imports tensorrt; ``plugin_loader.load_plugin`` imports it.

How a graph reaches it: the ``plugin`` lowering writes ``rmsnorm_deploy::RMSNorm`` nodes with
``plugin_namespace``/``plugin_version``; TensorRT's ONNX parser maps a node whose op type is a
registered plugin's name and that carries ``plugin_namespace`` to that plugin, and hands it
the node attributes named by the plugin's fields (:data:`PLUGIN_FIELDS`, the spec). A
plugin has a fixed number of inputs, so nodes without a weight (gain ``none``) go to a
second registration of ``RMSNorm`` in namespace ``rmsnorm_deploy_noweight``.

Why Python (QDP) and not a C++ ``IPluginV3`` library: the kernel is Triton, and Triton
compiles it for the GPU the engine is built on, specialized for the spec and the hidden
size, inside the builder; the engine then holds only PTX. A C++ library would need a
hand-written CUDA twin of the kernel (a second copy of the formula) or Triton's C AOT
output per GPU architecture, and a build per TensorRT/CUDA version. What QDP costs: the
engine *build* needs Python with tensorrt and triton (running it does not).

Everything here but :func:`run_jit` works without tensorrt: the
fields and their parsing into a spec, the checks of input dtypes, and the ahead-of-time
compilation (given a target architecture).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Mapping

import numpy as np
import onnx

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.function import (
    OP_TYPE,
    PLUGIN_NAMESPACE,
    PLUGIN_NAMESPACE_NO_WEIGHT,
    plugin_namespace,
    rmsnorm_node,
    spec_from_attributes,
)
from rmsnorm_deploy.kernels.functional import rms_norm
from rmsnorm_deploy.tensorrt.runtime import PLUGIN_IMPLEMENTATIONS

PLUGIN_NAME = OP_TYPE
#: (namespace, inputs) of each registration.
REGISTRATIONS: dict[str, tuple[str, ...]] = {PLUGIN_NAMESPACE: ("x", "weight"), PLUGIN_NAMESPACE_NO_WEIGHT: ("x",)}
IMPLEMENTATIONS = PLUGIN_IMPLEMENTATIONS
#: The first TensorRT whose ``tensorrt.plugin`` compiles Python plugins ahead of time
#: (``@trtp.aot_impl``, ``QuickPluginCreationRequest``); also the ``tensorrt`` extra's lower bound.
AOT_SINCE = (10, 9)
_AOT_TEXT = f"{AOT_SINCE[0]}.{AOT_SINCE[1]}"
#: The NetworkDefinitionCreationFlag a builder sets to pick an implementation (both are defined).
_NETWORK_FLAGS = {"aot": ("PREFER_AOT_PYTHON_PLUGINS",), "jit": ("PREFER_JIT_PYTHON_PLUGINS",), "library": ()}
#: Node attributes that address the plugin rather than describe the spec.
_ADDRESSING = ("plugin_namespace", "plugin_version")
#: Dtypes the kernel reads and writes; the weight is one of these too (x's or float32).
PLUGIN_DTYPES = ("float32", "float16", "bfloat16")


def _plugin_fields() -> dict[str, str]:
    """The spec's node attributes and their ONNX types, read off a node ``rmsnorm_node`` writes."""
    node = rmsnorm_node(RMSNormSpec(), "float16", ["x", "weight"], ["y"], plugin=True)
    return {
        a.name: onnx.AttributeProto.AttributeType.Name(a.type) for a in node.attribute if a.name not in _ADDRESSING
    }


#: The plugin's fields: name -> ONNX attribute type (``FLOAT``, ``INTS``, ``STRING``).
PLUGIN_FIELDS: dict[str, str] = _plugin_fields()


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """What ``plugin_loader.load_plugin`` registered, for the builder and its report.

    ``network_flags``: names of ``tensorrt.NetworkDefinitionCreationFlag`` members the
    builder must set when it creates the network (they pick the AOT or the Python
    implementation; see :meth:`network_flag_bits`).
    """

    name: str
    version: str
    namespaces: tuple[str, ...]
    implementation: str
    network_flags: tuple[str, ...]
    library: str | None
    tensorrt_version: str
    triton_version: str | None

    @property
    def plugin_ids(self) -> tuple[str, ...]:
        return tuple(f"{ns}::{self.name}" for ns in self.namespaces)

    def network_flag_bits(self, trt: Any) -> int:
        """The bits to OR into ``builder.create_network(flags)``."""
        bits = 0
        for name in self.network_flags:
            bits |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
        return bits

    def describe(self) -> str:
        how = {"aot": "Triton kernel compiled ahead of time into the engine (runs without Python)",
               "jit": "Triton kernel called from Python at run time",
               "library": f"plugin library {self.library}"}[self.implementation]
        return f"{', '.join(self.plugin_ids)} v{self.version}: {how}"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["plugin_ids"] = list(self.plugin_ids)
        return data


# -- fields -> spec -> kernel (no tensorrt needed) ----------------------------------------------
def spec_from_fields(fields: Mapping[str, Any]) -> RMSNormSpec:
    """The spec from the plugin fields as ``tensorrt.plugin`` hands them to ``_qdp.py``.

    TensorRT's ONNX parser passes a FLOAT attribute as a 1-element float32 field, and
    ``_qdp.py`` declares it ``npt.NDArray[np.float32]``, so each FLOAT field arrives as a
    1-element array and its element 0 is the value (a plain number is taken too). INTS arrive
    as an int32 array, STRING as ``str``. Raises ``UserError`` (a spec or lowering error)
    naming the bad field.
    """
    missing = [name for name in PLUGIN_FIELDS if name not in fields]
    if missing:
        raise UserError(f"TensorRT plugin {PLUGIN_NAME}: fields {missing} are missing; the node must carry the spec")
    values = {k: (v.rstrip("\x00") if isinstance(v, str) else v) for k, v in fields.items()}
    for name, kind in PLUGIN_FIELDS.items():
        if kind == "FLOAT":
            values[name] = _scalar_field(name, values[name])
    values["axes"] = [int(a) for a in list(values["axes"])]
    return spec_from_attributes(values, f"TensorRT plugin {PLUGIN_NAME}")


def _scalar_field(name: str, value: Any) -> float:
    """Element 0 of a 1-element FLOAT field (TensorRT's shape for a FLOAT attribute)."""
    array = np.asarray(value)
    if array.size != 1:
        raise UserError(f"TensorRT plugin {PLUGIN_NAME}: field {name!r} has {array.size} values {array.tolist()}; "
                        "the node's FLOAT attribute carries exactly one")
    return float(array.reshape(-1)[0])


def check_io(spec: RMSNormSpec, dtype: str, weight_dtype: str | None) -> None:
    """Refuse inputs the kernel does not take (``ValueError``, raised inside TensorRT's build)."""
    if dtype not in PLUGIN_DTYPES:
        raise ValueError(f"{PLUGIN_NAME} plugin: input x is {dtype}; the kernel reads {', '.join(PLUGIN_DTYPES)}")
    if spec.has_gain != (weight_dtype is not None):
        raise ValueError(
            f"{PLUGIN_NAME} plugin: gain {spec.gain!r} {'needs a weight input' if spec.has_gain else 'takes no weight'}; "
            f"use namespace {plugin_namespace(spec)!r}"
        )
    if weight_dtype is not None and weight_dtype not in (dtype, "float32"):
        raise ValueError(f"{PLUGIN_NAME} plugin: weight is {weight_dtype}; the kernel takes x's dtype ({dtype}) or float32")


def normalized_size(spec: RMSNormSpec, dims: list[int | None]) -> int:
    """The row length: the product of the last ``normalized_dims`` dims, which must be static."""
    k = spec.normalized_dims
    if len(dims) < k:
        raise ValueError(f"{PLUGIN_NAME} plugin: input x has rank {len(dims)}; the spec normalizes the last {k} dims")
    trailing = dims[len(dims) - k:]
    if any(d is None for d in trailing):
        raise ValueError(
            f"{PLUGIN_NAME} plugin: the normalized dims must be static (the kernel is compiled for the row length); "
            f"got {['?' if d is None else d for d in trailing]}"
        )
    return math.prod(trailing)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def aot_kernel(spec: RMSNormSpec, dtype: str, weight_dtype: str | None, n_cols: int, arch: int | None = None) -> Any:
    """The kernel compiled for ``spec``, the input dtypes and the row length: an ``AotKernel``.

    ``arch=None`` compiles for this process's GPU (inside TensorRT's build). The PTX ISA is
    held to what the CUDA driver loads, when Triton's default is newer.
    """
    from rmsnorm_deploy.kernels import triton_rmsnorm  # optional: it imports triton

    check_io(spec, dtype, weight_dtype)
    driver = triton_rmsnorm.driver_ptx_version() if arch is None else None
    return triton_rmsnorm.compile_aot(
        spec, dtype=dtype, weight_dtype=weight_dtype, n_cols=n_cols, arch=arch, max_ptx_version=driver
    )


def aot_supported(trt: Any, trtp: Any) -> bool:
    """Whether this TensorRT's ``tensorrt.plugin`` compiles plugins ahead of time (10.9 and later)."""
    match = re.match(r"(\d+)\.(\d+)", str(getattr(trt, "__version__", "")))
    if match is None or (int(match.group(1)), int(match.group(2))) < AOT_SINCE:
        return False
    return hasattr(trt, "QuickPluginCreationRequest") and hasattr(trtp, "aot_impl")


def run_jit(spec: RMSNormSpec, x: Any, weight: Any, y: Any, stream: int) -> None:
    """The Python implementation: TensorRT's buffers as torch tensors, the kernel on TensorRT's stream."""
    import torch


    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        w_t = _as_torch(weight) if weight is not None else None
        rms_norm(spec, _as_torch(x), w_t, out=_as_torch(y))


def _as_torch(tensor: Any) -> Any:
    """A ``tensorrt.plugin.Tensor`` as a torch CUDA tensor, without a copy.

    Its ``__cuda_array_interface__`` refuses bfloat16 (numpy has no such type), so a
    bfloat16 buffer is described as int16 and viewed back as bfloat16.
    """
    import tensorrt as trt
    import torch

    if tensor.dtype != trt.bfloat16:
        return torch.as_tensor(tensor, device="cuda")

    class _Int16View:
        __cuda_array_interface__ = {
            "shape": tuple(tensor.shape), "typestr": "<i2", "data": (int(tensor.data_ptr), False), "version": 3,
            "strides": None,
        }

    return torch.as_tensor(_Int16View(), device="cuda").view(torch.bfloat16)
