"""Registering the ``RMSNorm`` plugin with TensorRT: this package's Python plugin (``_qdp``, whose
import registers it) or a shared library. Apart from ``plugin`` so that ``_qdp``, which imports
``plugin``'s fields and kernel, is not imported back by the module it imports."""

from __future__ import annotations

import importlib
from pathlib import Path

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.function import PLUGIN_VERSION
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.tensorrt.plugin import (
    _AOT_TEXT,
    _NETWORK_FLAGS,
    IMPLEMENTATIONS,
    PLUGIN_NAME,
    REGISTRATIONS,
    PluginInfo,
    aot_supported,
)


def load_plugin(library: str | Path | None = None, *, implementation: str = "aot") -> PluginInfo:
    """Register the ``RMSNorm`` plugin with TensorRT's plugin registry and say what was registered.

    ``library=None``: this package's Triton plugin (``tensorrt.plugin``); ``implementation``
    ``"aot"`` (default: the kernel is compiled into the engine) or ``"jit"`` (called from
    Python at run time); the builder sets :attr:`PluginInfo.network_flags`. ``library``: a
    shared library whose creators register ``RMSNorm`` v1 in both namespaces (IPluginV3).
    Calling it again is harmless. Errors are one-line ``UserError``s.
    """
    if implementation not in IMPLEMENTATIONS:
        raise UserError(f"unknown plugin implementation {implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    if library is not None:
        path = Path(library)
        if not path.is_file():
            raise UserError(f"plugin library {path} does not exist; check the path, or load this package's plugin (library=None)")
    trt = require("tensorrt", "the TensorRT RMSNorm plugin")
    registry = trt.get_plugin_registry()
    if library is not None:
        if registry.load_library(str(path)) is None:
            raise UserError(f"TensorRT could not load plugin library {path}; is it built for TensorRT {trt.__version__}?")
        info = PluginInfo(PLUGIN_NAME, PLUGIN_VERSION, tuple(REGISTRATIONS), "library", (), str(path), trt.__version__, None)
    else:
        triton = require("triton", "the TensorRT RMSNorm plugin (its kernel is Triton)")
        try:
            trtp = importlib.import_module("tensorrt.plugin")
        except ImportError as exc:
            raise UserError(
                f"TensorRT {trt.__version__} has no tensorrt.plugin module ({exc}); the RMSNorm plugin needs TensorRT "
                f">= {_AOT_TEXT}"
            ) from None
        if implementation == "aot" and not aot_supported(trt, trtp):
            raise UserError(
                f"TensorRT {trt.__version__} cannot compile Python plugins ahead of time (they exist from TensorRT "
                f"{_AOT_TEXT}); use TensorRT >= {_AOT_TEXT}, or --plugin-impl jit for an engine that needs Python at "
                "run time"
            )
        importlib.import_module("rmsnorm_deploy.tensorrt._qdp")
        info = PluginInfo(
            PLUGIN_NAME, PLUGIN_VERSION, tuple(REGISTRATIONS), implementation, _NETWORK_FLAGS[implementation], None,
            trt.__version__, getattr(triton, "__version__", None),
        )
    missing = [ns for ns in info.namespaces if registry.get_creator(PLUGIN_NAME, PLUGIN_VERSION, ns) is None]
    if missing:
        where = f"plugin library {info.library}" if info.library else "rmsnorm_deploy.tensorrt._qdp"
        raise UserError(f"{where} did not register {PLUGIN_NAME} v{PLUGIN_VERSION} in namespace(s) {missing}")
    return info
