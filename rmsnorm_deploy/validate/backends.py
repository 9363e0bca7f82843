"""The backends ``validate`` runs a model on: what each one is, its label, its tolerances, its runner."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from rmsnorm_deploy.errors import MissingDependencyError, UserError
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.runners.base import Runner
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner, provider_name
from rmsnorm_deploy.tensorrt.runner import TensorRTRunner


@dataclasses.dataclass(frozen=True)
class Backend:
    """A backend of ``validate --providers``.

    ``runtime``: ``onnxruntime`` (a session with ``providers``, in order of preference) or
    ``tensorrt`` (an engine built from the model, its norms run by the fused plugin when
    ``plugin``). ``tolerance_backend`` is its column in the tolerance table.
    """

    key: str
    runtime: str
    providers: tuple[str, ...] = ()
    plugin: bool = False
    tolerance_backend: str = "onnxruntime"

    @property
    def label(self) -> str:
        if self.runtime == "onnxruntime":
            return f"onnxruntime[{self.key}]"
        return "tensorrt[plugin]" if self.plugin else "tensorrt"

    def runner(self, model_path: Path, workdir: Path, *, optimization: str = "all",
               provider_options: dict[str, dict[str, str]] | None = None,
               require_all_nodes_on_provider: bool = False) -> Runner:
        """The runner on ``model_path`` (a TensorRT engine is built into ``workdir``).

        ``require_all_nodes_on_provider``: an ONNX Runtime session with a compute node off this
        backend's providers is an error (a TensorRT engine runs every layer in TensorRT).
        """
        if self.runtime == "onnxruntime":

            wanted = {provider_name(p) for p in self.providers}
            options = {k: v for k, v in (provider_options or {}).items() if provider_name(k) in wanted}
            return OnnxRuntimeRunner(model_path, list(self.providers), optimization=optimization,
                                     provider_options=options,
                                     optimized_model_path=workdir / f"optimized-{self.key}.onnx",
                                     require_all_nodes_on_provider=require_all_nodes_on_provider)
        return _tensorrt_runner(model_path, workdir, plugin=self.plugin)


BACKENDS: dict[str, Backend] = {b.key: b for b in (
    Backend("cpu", "onnxruntime", ("cpu",)),
    Backend("cuda", "onnxruntime", ("cuda",)),
    Backend("tensorrt", "onnxruntime", ("tensorrt", "cuda"), tolerance_backend="tensorrt"),
    Backend("trt", "tensorrt", tolerance_backend="tensorrt"),
    Backend("trt-plugin", "tensorrt", plugin=True, tolerance_backend="tensorrt"),
)}


def parse_backends(text: str | Sequence[str]) -> list[str]:
    """``cpu,cuda`` -> ``["cpu", "cuda"]``; unknown names are a one-line error."""
    items = text.split(",") if isinstance(text, str) else list(text)
    keys = [k.strip().lower() for k in items if k.strip()]
    unknown = [k for k in keys if k not in BACKENDS]
    if unknown or not keys:
        raise UserError(f"unknown provider(s) {unknown or [text]}; choose from {', '.join(BACKENDS)}")
    return list(dict.fromkeys(keys))


def check_provider_options(keys: Sequence[str], provider_options: dict[str, dict[str, str]] | None) -> None:
    """Options for a provider none of ``keys`` runs would be dropped: a one-line error instead."""
    if not provider_options:
        return

    wanted = {provider_name(p) for k in keys for p in BACKENDS[k].providers}
    for provider, options in provider_options.items():
        if provider_name(provider) not in wanted:
            requested = ",".join(keys)
            raise UserError(f"--provider-option {provider}:{next(iter(options), '')}=...: provider {provider!r} is not "
                            f"run by --providers {requested}; add it to --providers or drop the option")


def _tensorrt_runner(model_path: Path, workdir: Path, *, plugin: bool) -> Runner:

    flag = "trt-plugin" if plugin else "trt"
    require("tensorrt", f"validate --providers {flag}")
    try:
        from rmsnorm_deploy.tensorrt.build import build_engine  # optional: only the trt providers build engines
    except ImportError as exc:
        raise MissingDependencyError(
            f"validate --providers {flag} needs rmsnorm_deploy's TensorRT engine builder, which this installation "
            f"lacks ({exc}); install a release of rmsnorm-deploy with TensorRT support or use the Docker image"
        ) from None
    report = build_engine(model_path, workdir / f"model-{flag}.engine", plugin=plugin, force=True)
    return TensorRTRunner(report.engine_path, plugin=plugin)
