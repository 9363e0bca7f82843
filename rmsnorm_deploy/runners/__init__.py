"""Runners: one signature, ``infer(feed) -> outputs``, for every backend.

A runner is a context manager (``with OnnxRuntimeRunner(path) as r: r.infer(feed)``), as in
Polygraphy: ``activate`` loads the backend and ``deactivate`` frees it. Backends load lazily,
so a missing optional dependency is a clear error at activation, not at import.
"""

from rmsnorm_deploy.runners.base import Runner

__all__ = ["Runner"]
