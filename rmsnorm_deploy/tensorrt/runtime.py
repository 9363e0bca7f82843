"""Pieces the builder and the runner share: TensorRT import, logger, plugin loading, dtypes.

Everything that touches ``tensorrt`` imports it lazily through :func:`import_tensorrt`, so this
module imports without it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.function import OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.tensorrt.precision import TRT_DTYPE_NAMES

PLUGIN_MODULE = "rmsnorm_deploy.tensorrt.plugin_loader"
#: How the plugin runs: ``aot`` (the kernel compiled into the engine, which then runs without
#: Python) or ``jit`` (the kernel called from Python at run time). The first is the default.
PLUGIN_IMPLEMENTATIONS = ("aot", "jit")
#: Set to 1 to echo every TensorRT log message (verbose) to stderr.
VERBOSE_ENV = "RMSNORM_DEPLOY_TRT_VERBOSE"


class PluginError(UserError):
    """The RMSNorm plugin was requested and is missing, fails to load, or is not what the engine holds."""


def import_tensorrt(feature: str) -> Any:
    return require("tensorrt", feature)


def trt_version(trt: Any) -> str:
    return str(getattr(trt, "__version__", "unknown"))


def make_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that keeps warnings and errors (for error messages) and echoes on request."""
    verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    severity = trt.ILogger.Severity

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.warnings: list[str] = []

        def log(self, level, msg):  # noqa: D401 - TensorRT callback, must not raise
            try:
                if level in (severity.INTERNAL_ERROR, severity.ERROR):
                    self.errors.append(str(msg))
                elif level == severity.WARNING:
                    self.warnings.append(str(msg))
                if verbose or level in (severity.INTERNAL_ERROR,):
                    print(f"[TensorRT {level.name}] {msg}", file=sys.stderr)
            except Exception:  # pragma: no cover - a logger must never throw into TensorRT
                pass

        def last_errors(self, count: int = 2) -> str:
            return " | ".join(" ".join(e.split()) for e in self.errors[-count:]) or "no error was logged"

    return _Logger()


def trt_dtype_name(dtype: Any) -> str:
    """``trt.DataType.HALF`` -> ``"float16"``."""
    name = getattr(dtype, "name", str(dtype).split(".")[-1])
    return TRT_DTYPE_NAMES.get(name, name.lower())


def register_plugin(library: str | os.PathLike | None = None, *, implementation: str = "aot") -> dict[str, Any]:
    """Load and register the RMSNorm plugin; its description for reports and sidecars.

    The plugin is registered by :mod:`rmsnorm_deploy.tensorrt.plugin_loader` (its ``load_plugin``),
    imported only here, so everything else works where it is absent. ``implementation``:
    ``aot`` (the kernel compiled into the engine) or ``jit`` (called from Python at run time);
    the description's ``network_flags`` are the flags the builder sets for it. Any failure is
    a one-line :class:`PluginError`.
    """
    try:
        module = importlib.import_module(PLUGIN_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == PLUGIN_MODULE:
            raise PluginError(f"the {OP_TYPE} TensorRT plugin is not part of this installation ({PLUGIN_MODULE} is "
                              "missing); build without --plugin") from None
        raise PluginError(f"the {OP_TYPE} TensorRT plugin cannot be imported: {exc}") from None
    try:
        info = (module.load_plugin(implementation=implementation) if library is None
                else module.load_plugin(library=str(library)))
    except UserError:
        raise
    except Exception as exc:
        text = " ".join(str(exc).split())[:300]
        raise PluginError(f"the {OP_TYPE} TensorRT plugin failed to load: {type(exc).__name__}: {text}") from None
    return describe_plugin(info)


def describe_plugin(info: Any) -> dict[str, Any]:
    """A JSON-ready description of ``load_plugin``'s result, with the plugin's identity."""
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        raw = dataclasses.asdict(info)
    elif isinstance(info, dict):
        raw = dict(info)
    elif hasattr(info, "__dict__"):
        raw = {k: v for k, v in vars(info).items() if not k.startswith("_")}
    else:
        raw = {"info": info}
    described = {k: v if isinstance(v, (str, int, float, bool, type(None))) else
                 [str(i) for i in v] if isinstance(v, (list, tuple)) else str(v) for k, v in raw.items()}
    described.setdefault("name", OP_TYPE)
    described.setdefault("namespace", PLUGIN_NAMESPACE)
    described.setdefault("version", PLUGIN_VERSION)
    return described
