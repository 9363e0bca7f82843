"""Find every norm of an ``nn.Module``, map it to its :class:`RMSNormSpec`, and prove the mapping.

Known classes (matched by their exact class, never by a name pattern):

* ``torch.nn.RMSNorm`` (``eps=None`` means float32's machine epsilon, also for half inputs:
  torch computes them in float32);
* transformers' ``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, ``Qwen3RMSNorm``,
  ``Phi3RMSNorm``, ``DeepseekV3RMSNorm`` and T5's ``T5LayerNorm`` (cast, then scale);
  ``GemmaRMSNorm``, ``Gemma2RMSNorm``, ``Gemma3RMSNorm`` (``1 + w`` in float32, then cast);
  ``Olmo2RMSNorm`` (scale in float32, then cast);
* the gated norms of the hybrid families and Gemma3n/Gemma4's norms, with or without a gain
  (``gated.py``); a gated norm is confirmed with a seeded gate input;
* this project's :class:`SpecRMSNorm`;
* any class that declares its spec: an ``rmsnorm_spec`` attribute holding an
  :class:`RMSNormSpec` (or its dict), with the gain in ``weight`` and, when it has no weight,
  the normalized shape in ``normalized_shape``.

Every spec is then *confirmed*: the module and ``reference(spec, x, weight)`` run on seeded
random inputs in the module's own dtype (rows from 1e-3 to 1e2 in magnitude, so epsilon
matters in some) and must agree bit for bit. A module whose class name says it is a norm but
that is none of the above stops the export, naming its path and class: a norm is never guessed.
Normalizations that are not RMSNorm (``LayerNorm``, ``GroupNorm``, batch and instance norms)
are left as they are and listed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.contract.reference import SpecRMSNorm, reference
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.gated import GAINLESS_CAPABLE_CLASSES, GATED_CLASSES, PROBE_WIDTH, call_norm, gate_input

#: The attribute a user class sets to declare its spec.
SPEC_ATTRIBUTE = "rmsnorm_spec"


class UnknownNormError(UserError):
    """A module that looks like a norm but whose computation is not known."""


class NormMismatchError(UserError):
    """A detected spec that does not reproduce its module bit for bit."""


@dataclasses.dataclass
class DetectedNorm:
    """One norm of a model: where it is, what it is, and the spec proven to compute it."""

    path: str
    class_name: str
    spec: RMSNormSpec
    module: torch.nn.Module
    weight: torch.Tensor | None
    normalized_shape: tuple[int, ...]
    dtype: torch.dtype
    how: str  # "known class", "declared spec", ...

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "class": self.class_name, "spec": self.spec.to_dict(), "how": self.how,
                "normalized_shape": list(self.normalized_shape), "dtype": str(self.dtype).removeprefix("torch.")}


@dataclasses.dataclass
class Detection:
    norms: list[DetectedNorm]
    #: (path, class) of normalizations that are not RMSNorm and are exported as they are.
    other_norms: list[tuple[str, str]]

    @property
    def specs(self) -> dict[str, RMSNormSpec]:
        return {n.path: n.spec for n in self.norms}


def _hf_llama(module: Any, dtype: torch.dtype) -> RMSNormSpec:
    return RMSNormSpec.llama(module.variance_epsilon)


def _hf_gemma(module: Any, dtype: torch.dtype) -> RMSNormSpec:
    return RMSNormSpec.gemma(module.eps)


def _hf_olmo2(module: Any, dtype: torch.dtype) -> RMSNormSpec:
    return RMSNormSpec.olmo2(module.variance_epsilon)


def _torch_rmsnorm(module: Any, dtype: torch.dtype) -> RMSNormSpec:
    # eps=None: the machine epsilon of the dtype torch computes in (float32 for half inputs too).
    eps = module.eps if module.eps is not None else torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    return RMSNormSpec.torch_rmsnorm(eps, normalized_dims=len(module.normalized_shape),
                                     affine=module.weight is not None)


_HF = "transformers.models"
#: exact class (module.qualname) -> spec of a module of that class
KNOWN_CLASSES: dict[str, Callable[[Any, torch.dtype], RMSNormSpec]] = {
    "torch.nn.modules.normalization.RMSNorm": _torch_rmsnorm,
    f"{_HF}.llama.modeling_llama.LlamaRMSNorm": _hf_llama,
    f"{_HF}.mistral.modeling_mistral.MistralRMSNorm": _hf_llama,
    f"{_HF}.qwen2.modeling_qwen2.Qwen2RMSNorm": _hf_llama,
    f"{_HF}.qwen3.modeling_qwen3.Qwen3RMSNorm": _hf_llama,
    f"{_HF}.phi3.modeling_phi3.Phi3RMSNorm": _hf_llama,
    f"{_HF}.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm": _hf_llama,
    f"{_HF}.t5.modeling_t5.T5LayerNorm": _hf_llama,
    f"{_HF}.gemma.modeling_gemma.GemmaRMSNorm": _hf_gemma,
    f"{_HF}.gemma2.modeling_gemma2.Gemma2RMSNorm": _hf_gemma,
    f"{_HF}.gemma3.modeling_gemma3.Gemma3RMSNorm": _hf_gemma,
    f"{_HF}.olmo2.modeling_olmo2.Olmo2RMSNorm": _hf_olmo2,
}

# -- gated norms and Gemma3n/Gemma4's norms (with_scale=False: no gain): see gated.py ------
KNOWN_CLASSES.update(GATED_CLASSES)
KNOWN_CLASSES.update(GAINLESS_CAPABLE_CLASSES)

#: Normalizations that are not RMSNorm: exported as torch exports them, and listed.
OTHER_NORMS: tuple[type, ...] = (
    torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.LocalResponseNorm,
    torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm,
)

_NORM_LIKE = re.compile(r"norm", re.IGNORECASE)


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def spec_of(module: torch.nn.Module, dtype: torch.dtype | None = None) -> tuple[RMSNormSpec, str] | None:
    """The spec a module's class says it computes, and how it was found; ``None`` if it says nothing."""
    dtype = dtype or _module_dtype(module) or torch.float32
    if isinstance(module, SpecRMSNorm):
        return module.spec, "SpecRMSNorm"
    declared = getattr(module, SPEC_ATTRIBUTE, None)
    if declared is not None:
        if isinstance(declared, dict):
            declared = RMSNormSpec.from_dict(declared)
        if not isinstance(declared, RMSNormSpec):
            raise UnknownNormError(
                f"{type(module).__name__}.{SPEC_ATTRIBUTE} is a {type(declared).__name__}; set it to an RMSNormSpec"
            )
        return declared, f"declared {SPEC_ATTRIBUTE}"
    known = KNOWN_CLASSES.get(class_path(type(module)))
    if known is not None:
        return known(module, dtype), "known class"
    return None


def detect_norms(model: torch.nn.Module, *, dtype: Any = None, confirm: bool = True, seed: int = 0) -> Detection:
    """Every RMSNorm of ``model`` with its spec (confirmed unless ``confirm=False``).

    ``dtype``: the activation dtype, for norms without a weight (default: the model's first
    floating-point parameter's dtype).

    Raises :class:`UnknownNormError` for a module that looks like a norm but is not known,
    and :class:`NormMismatchError` for a spec that does not reproduce its module.
    """
    default_dtype = torch_dtype(dtype) if dtype is not None else _first_float_dtype(model)
    norms: list[DetectedNorm] = []
    others: list[tuple[str, str]] = []
    skip_under: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(prefix + ".") for prefix in skip_under):
            continue
        cls_name = type(module).__name__
        found = spec_of(module)
        if found is None:
            if isinstance(module, OTHER_NORMS):
                others.append((path, class_path(type(module))))
                skip_under.append(path)
            elif _NORM_LIKE.search(cls_name) and not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                raise UnknownNormError(
                    f"module {path or '<root>'!r} ({class_path(type(module))}) looks like a normalization but its "
                    f"computation is not known; declare it with an {SPEC_ATTRIBUTE} attribute (an RMSNormSpec) or "
                    "replace it with torch.nn.RMSNorm"
                )
            continue
        spec, how = found
        weight = getattr(module, "weight", None) if spec.has_gain else None
        if spec.has_gain and not isinstance(weight, torch.Tensor):
            raise UnknownNormError(
                f"module {path!r} ({class_path(type(module))}) has gain {spec.gain!r} but no tensor 'weight' attribute"
            )
        shape = _normalized_shape(module, spec, weight, path, how)
        norm_dtype = weight.dtype if weight is not None else (_module_dtype(module) or default_dtype)
        # Specs whose epsilon depends on the dtype (torch.nn.RMSNorm with eps=None) are read in it.
        spec = spec_of(module, norm_dtype)[0]  # type: ignore[index]
        norm = DetectedNorm(path, class_path(type(module)), spec, module, weight, shape, norm_dtype, how)
        if confirm:
            confirm_norm(norm, seed=seed + len(norms))
        norms.append(norm)
        skip_under.append(path)
    return Detection(norms, others)


def confirm_norm(norm: DetectedNorm, *, seed: int = 0, rows: int = 16) -> None:
    """Run the module and the spec's reference on the same seeded input; demand identical bits."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, rows) + norm.normalized_shape
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    # Row magnitudes from 1e-3 to 1e2: small rows make epsilon visible, large ones the rounding.
    scale = 10.0 ** torch.empty((2, rows) + (1,) * len(norm.normalized_shape)).uniform_(-3, 2, generator=gen)
    x = (x * scale).to(norm.dtype)
    z = gate_input(norm.spec, x, gen)
    with torch.no_grad():
        try:
            got = call_norm(norm.module, x, z)
        except Exception as exc:  # the module's own failure, reported with its path
            raise NormMismatchError(f"norm {norm.path!r} ({norm.class_name}) failed on a {list(shape)} "
                                    f"{norm.dtype} input: {exc}") from None
        want = reference(norm.spec, x, norm.weight, z)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        raise NormMismatchError(
            f"norm {norm.path!r} ({norm.class_name}) returned {_describe(got)}; its spec gives {_describe(want)}"
        )
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(same.all()):
        bad = int((~same).sum())
        err = float((got.double() - want.double()).abs().max())
        raise NormMismatchError(
            f"norm {norm.path!r} ({norm.class_name}) differs from its spec [{norm.spec.describe()}] in {bad} of "
            f"{got.numel()} {norm.dtype} elements (max abs {err:.3g}); its class computes something else: declare "
            f"its real spec with an {SPEC_ATTRIBUTE} attribute"
        )


def _normalized_shape(module: torch.nn.Module, spec: RMSNormSpec, weight: Any, path: str,
                      how: str = "") -> tuple[int, ...]:
    if weight is not None:
        shape = tuple(int(d) for d in weight.shape)
    else:
        declared = getattr(module, "normalized_shape", None)
        if declared is None and how == "known class" and spec.normalized_dims == 1 and spec.group_size is None:
            declared = PROBE_WIDTH  # a known gainless class: nothing in it depends on the width
        if declared is None:
            raise UnknownNormError(
                f"module {path!r} ({class_path(type(module))}) has no weight and no normalized_shape attribute, "
                "so it cannot be checked; give it a normalized_shape"
            )
        shape = (int(declared),) if isinstance(declared, int) else tuple(int(d) for d in declared)
    if len(shape) != spec.normalized_dims:
        raise UnknownNormError(
            f"module {path!r} ({class_path(type(module))}) normalizes shape {list(shape)} but its spec normalizes "
            f"{spec.normalized_dims} dim(s)"
        )
    return shape


def _first_float_dtype(model: torch.nn.Module) -> torch.dtype:
    for t in model.parameters():
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def _module_dtype(module: torch.nn.Module) -> torch.dtype | None:
    for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        if t.is_floating_point():
            return t.dtype
    return None


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    return type(t).__name__
