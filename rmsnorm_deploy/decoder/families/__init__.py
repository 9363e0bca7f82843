"""The model families ``--target onnxruntime`` writes: one module each, found by this package.

Each module here defines ``FAMILY`` (a :class:`~rmsnorm_deploy.decoder.families.base.Family`,
or a tuple of them for families that share a module) and may define ``REFUSED``, the model types
of its kin it does not write, each with the reason: adding a family is one module. A
``model_type`` without a family is refused with that reason, or with the list of those written.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from rmsnorm_deploy.decoder.families.base import ACTIVATIONS, Family, LayerNorms, MoEFamily

__all__ = ["ACTIVATIONS", "FAMILIES", "Family", "LayerNorms", "MoEFamily", "REFUSED", "family_of", "refusal"]


def _discover() -> tuple[dict[str, Family], dict[str, str]]:
    found: dict[str, Family] = {}
    refused: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        value = getattr(module, "FAMILY", ())
        for family in value if isinstance(value, tuple) else (value,):
            if family.model_type in found:
                raise RuntimeError(f"two family modules define {family.model_type!r}")
            found[family.model_type] = family
        refused.update(getattr(module, "REFUSED", {}))
    if set(found) & set(refused):
        raise RuntimeError(f"model types both written and refused: {sorted(set(found) & set(refused))}")
    return found, refused


#: model_type -> its family; model_type -> why it is not written: every module of this package.
FAMILIES, REFUSED = _discover()


def refusal(model_type: str) -> str:
    """The one-line reason a ``model_type`` without a family is refused."""
    if model_type in REFUSED:
        return f"--target onnxruntime does not write {model_type!r} models: {REFUSED[model_type]}"
    return (f"--target onnxruntime does not write {model_type!r} models yet; it writes "
            f"{', '.join(sorted(FAMILIES))} (use --target portable)")


def family_of(config: Any) -> Family | None:
    """The family of a transformers config, or ``None`` (see :func:`refusal`)."""
    return FAMILIES.get(getattr(config, "model_type", ""))
