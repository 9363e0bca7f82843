"""Rebuilding the PyTorch module an ONNX file was exported from, from its metadata alone.

``validate`` compares a model with its source; the metadata's ``source`` entry says what the
source was (``{"kind": "standalone" | "preset" | "hf" | "gguf", ...}``). Each kind has one builder,
registered with :func:`source_builder` in the module that knows that kind, and loaded only
when a model of that kind is validated.

A rebuilt source is an ``nn.Module`` in the model's dtype, in eval mode, whose ``forward``
takes the ONNX inputs as keyword arguments (torch tensors) and returns a dict of torch
tensors keyed by the ONNX output names. A KV-cache graph's source (metadata ``kv_cache``) is
that model wrapped by ``decoder.kv_model.kv_source``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from typing import Callable

import torch

from rmsnorm_deploy.contract.reference import reference
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.metadata import ModelMetadata

SourceBuilder = Callable[[ModelMetadata], torch.nn.Module]

#: source kind -> module that registers its builder on import
_KIND_MODULES = {
    "standalone": "rmsnorm_deploy.exporter.rebuild",
    "preset": "rmsnorm_deploy.exporter.presets",
    "hf": "rmsnorm_deploy.exporter.hf",
    "gguf": "rmsnorm_deploy.exporter.hf",
}
#: The kinds whose source is a path the metadata names (trusted only inside the model's folder),
#: and what that path is.
_PATH_KINDS = {"hf": "source folder", "gguf": "source GGUF file"}
_BUILDERS: dict[str, SourceBuilder] = {}


def source_builder(kind: str) -> Callable[[SourceBuilder], SourceBuilder]:
    """Register the function that rebuilds sources of ``kind``."""

    def register(fn: SourceBuilder) -> SourceBuilder:
        _BUILDERS[kind] = fn
        return fn

    return register


def rebuild_source(meta: ModelMetadata, *, model_dir: str | os.PathLike | None = None,
                   source_path: str | os.PathLike | None = None) -> torch.nn.Module:
    """The PyTorch module ``meta`` describes; a :class:`UserError` if it cannot be rebuilt.

    The metadata is untrusted input: a source folder or GGUF file it names is opened only inside
    ``model_dir`` (the model's own folder); ``source_path``, given by the user, replaces it.
    """
    meta = _trusted_source(meta, model_dir, source_path)
    kind = meta.source.get("kind", "unknown")
    if kind not in _BUILDERS and kind in _KIND_MODULES:
        importlib.import_module(_KIND_MODULES[kind])
    if kind not in _BUILDERS:
        raise UserError(f"cannot rebuild a source of kind {kind!r}; known kinds: {', '.join(sorted(_KIND_MODULES))}")
    return _BUILDERS[kind](meta).eval()


def _trusted_source(meta: ModelMetadata, model_dir: str | os.PathLike | None,
                    source_path: str | os.PathLike | None) -> ModelMetadata:
    source = dict(meta.source)
    kind = source.get("kind")
    what = _PATH_KINDS.get(kind, "source")
    if source_path is not None:
        if kind not in _PATH_KINDS:
            raise UserError(f"--source gives the folder of a Hugging Face model or a GGUF file, but this model's "
                            f"source is of kind {kind!r}; drop --source")
        source["path"] = str(Path(source_path).resolve())
        return dataclasses.replace(meta, source=source)
    if source.get("path") is None or model_dir is None:
        return meta
    base = Path(model_dir).resolve()
    named = base / str(source["path"])  # an absolute path stays itself
    try:
        resolved = named.resolve()
    except (OSError, ValueError) as exc:
        raise UserError(f"the model's metadata names an unusable {what} ({exc}); pass --source PATH") from None
    if resolved != base and base not in resolved.parents:
        raise UserError(f"the model's metadata names its {what} {source['path']}, outside the model's folder "
                        f"{base}; metadata is not trusted to open other paths: pass --source PATH to use it")
    source["path"] = str(resolved)
    return dataclasses.replace(meta, source=source)


class StandaloneNorm(torch.nn.Module):
    """The source of ``rmsnorm_model``: the spec's reference on the ``x``, ``weight`` and ``z`` inputs."""

    def __init__(self, meta: ModelMetadata):
        super().__init__()
        (self.spec,) = meta.specs.values()

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                z: torch.Tensor | None = None) -> dict[str, torch.Tensor]:

        if self.spec.has_gate and z is None:
            raise UserError(f"the standalone model's spec ({self.spec.describe()}) is gated but it has no input 'z'")
        return {"y": reference(self.spec, x, weight, z)}


@source_builder("standalone")
def _standalone(meta: ModelMetadata) -> torch.nn.Module:
    if len(meta.specs) != 1:
        raise UserError(f"a standalone model holds one RMSNorm, this metadata lists {len(meta.specs)}")
    return StandaloneNorm(meta)
