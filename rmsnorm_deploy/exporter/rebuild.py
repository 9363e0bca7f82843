"""Rebuilding the PyTorch module an ONNX file was exported from, from its metadata alone.

``validate`` compares a model with its source; the metadata's ``source`` entry says what the
source was (``{"kind": "standalone" | "preset" | "hf", ...}``). Each kind has one builder,
registered with :func:`source_builder` in the module that knows that kind, and loaded only
when a model of that kind is validated.

A rebuilt source is an ``nn.Module`` in the model's dtype, in eval mode, whose ``forward``
takes the ONNX inputs as keyword arguments (torch tensors) and returns a dict of torch
tensors keyed by the ONNX output names. For a KV-cache graph (metadata ``kv_cache``) that is
the model wrapped in ``kv_model.KVCacheLM``.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.metadata import ModelMetadata

SourceBuilder = Callable[[ModelMetadata], torch.nn.Module]

#: source kind -> module that registers its builder on import
_KIND_MODULES = {
    "standalone": "rmsnorm_deploy.exporter.rebuild",
    "preset": "rmsnorm_deploy.exporter.presets",
    "hf": "rmsnorm_deploy.exporter.hf",
}
_BUILDERS: dict[str, SourceBuilder] = {}


def source_builder(kind: str) -> Callable[[SourceBuilder], SourceBuilder]:
    """Register the function that rebuilds sources of ``kind``."""

    def register(fn: SourceBuilder) -> SourceBuilder:
        _BUILDERS[kind] = fn
        return fn

    return register


def rebuild_source(meta: ModelMetadata) -> torch.nn.Module:
    """The PyTorch module ``meta`` describes; a :class:`UserError` if it cannot be rebuilt."""
    kind = meta.source.get("kind", "unknown")
    if kind not in _BUILDERS and kind in _KIND_MODULES:
        importlib.import_module(_KIND_MODULES[kind])
    if kind not in _BUILDERS:
        raise UserError(f"cannot rebuild a source of kind {kind!r}; known kinds: {', '.join(sorted(_KIND_MODULES))}")
    module = _BUILDERS[kind](meta)
    if meta.kv_cache:  # a KV-cache graph: the same model over the flat past/present tensors
        from rmsnorm_deploy.exporter.kv_cache import layout_of
        from rmsnorm_deploy.exporter.kv_model import KVCacheLM

        module = KVCacheLM(module.model, layout_of(meta))
    return module.eval()


class StandaloneNorm(torch.nn.Module):
    """The source of ``rmsnorm_model``: the spec's reference on the ``x`` and ``weight`` inputs."""

    def __init__(self, meta: ModelMetadata):
        super().__init__()
        (self.spec,) = meta.specs.values()

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        from rmsnorm_deploy.contract.reference import reference

        return {"y": reference(self.spec, x, weight)}


@source_builder("standalone")
def _standalone(meta: ModelMetadata) -> torch.nn.Module:
    if len(meta.specs) != 1:
        raise UserError(f"a standalone model holds one RMSNorm, this metadata lists {len(meta.specs)}")
    return StandaloneNorm(meta)
