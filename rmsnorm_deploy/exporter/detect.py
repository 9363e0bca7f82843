"""Find every norm of an ``nn.Module``, map it to its :class:`RMSNormSpec`, and prove the mapping.

Long: the known classes' spec readers and the search that proves each mapping read as one table and one walk.

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
  the normalized shape in ``normalized_shape``;
* any module the user declares a spec for: ``export --norm-spec CLASS_OR_PATH=SPEC``
  (:func:`parse_norm_spec`, :class:`NormSpecOverride`); it takes precedence over the class;
* any other module whose class name says it is a norm: *probed* (``probing.py``) and taken
  when exactly one candidate spec reproduces it bit for bit ("confirmed by probing").
  A weightless module without a ``normalized_shape`` is probed at the width it sees inside
  the model, recorded during one run of the model on ``example`` inputs. Embeddings, linear
  and convolution layers are never norms whatever their name (their inner norms are still
  seen), nor is a module with children whose ``forward(x)`` does not map a float tensor to
  one of the same shape or that computes no candidate spec (a block named like a norm).
  Mean-subtracting norms are refused as LayerNorms.
  A weightless module without a ``normalized_shape`` that this run never calls is not on the
  exported path (the export traces the same forward on the same input): it is left out and
  listed (:attr:`Detection.not_exported`), and :func:`refuse_calls_of_not_exported` stops an
  export whose traced run calls it after all.

Every spec is then *confirmed*: the module and ``reference(spec, x, weight)`` run on seeded
random inputs in the module's own dtype (rows from 1e-3 to 1e2 in magnitude, so epsilon
matters in some) and must agree bit for bit; a mismatch is refused with its distance in ULPs.
A module whose class name says it is a norm but that none of the above maps to one spec stops
the export, naming its path and class: a norm is never guessed. Normalizations that are not
RMSNorm (``LayerNorm``, ``GroupNorm``, batch and instance norms) are left as they are and listed.

Paths in messages and in :attr:`DetectedNorm.name` are the model's own (Hugging Face) module
paths: the wrapper's attribute (``TokenLogits.model``) is not part of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Callable, Iterator

import torch

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.contract.reference import SpecRMSNorm, reference
from rmsnorm_deploy.contract.spec import RMSNormSpec, named_specs, spec_fields
from rmsnorm_deploy.contract.tolerances import Tolerance
from rmsnorm_deploy.errors import SpecError, UserError, one_line
from rmsnorm_deploy.exporter.gated import GAINLESS_CAPABLE_CLASSES, GATED_CLASSES, PROBE_WIDTH, call_norm, gate_input
from rmsnorm_deploy.exporter.probing import (
    NOT_NORMS,
    NotANormError,
    ProbeCache,
    ProbeError,
    epsilons_of,
)

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
    how: str  # "known class", "declared rmsnorm_spec", "declared --norm-spec", "confirmed by probing: llama (...)"
    name: str = ""  # the model's own module path (``path`` without the wrapper's prefix)

    def __post_init__(self) -> None:
        self.name = self.name or self.path

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "class": self.class_name, "spec": self.spec.to_dict(),
                "how": self.how,
                "normalized_shape": list(self.normalized_shape), "dtype": str(self.dtype).removeprefix("torch.")}


#: Why a module in :attr:`Detection.not_exported` is left out.
NOT_CALLED = ("has no weight and no normalized_shape, and the model's forward does not call it on the example "
              "input, so it is not on the exported path")
#: Why a detected norm is left out after the run the export traces (:func:`without_uncalled`).
NOT_CALLED_BY_RUN = ("is not called by the forward the export traces, on its input, so it is not on the exported "
                     "path")


@dataclasses.dataclass(frozen=True)
class NotExportedNorm:
    """A module named like a norm that the example run never calls: not in the exported graph, so not checked."""

    path: str
    name: str  # the model's own module path
    class_name: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "name": self.name, "class": self.class_name, "reason": self.reason}


@dataclasses.dataclass
class Detection:
    norms: list[DetectedNorm]
    #: (name, class) of normalizations that are not RMSNorm and are exported as they are; the
    #: name as the wrapped model says it (``model_path``; ``root_path`` gives the path back).
    other_norms: list[tuple[str, str]]
    #: Norm-like modules left out because the example run never calls them (none of ``norms``).
    not_exported: list[NotExportedNorm] = dataclasses.field(default_factory=list)

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


#: The attribute of a wrapper module (``TokenLogits``) giving the prefix its own attribute adds to
#: the wrapped model's module paths (``"model."``); messages name modules without it.
PATH_PREFIX_ATTRIBUTE = "module_path_prefix"


def model_path(root: torch.nn.Module, path: str) -> str:
    """``path`` (relative to ``root``) as the wrapped model names it."""
    prefix = getattr(root, PATH_PREFIX_ATTRIBUTE, "")
    return path[len(prefix):] if prefix and path.startswith(prefix) else path


def root_path(root: torch.nn.Module, name: str) -> str:
    """``name`` (as the wrapped model names it, :func:`model_path`) as a path relative to ``root``."""
    prefix = getattr(root, PATH_PREFIX_ATTRIBUTE, "")
    if prefix:
        try:
            root.get_submodule(prefix + name)
            return prefix + name
        except AttributeError:
            pass
    return name


# -- --norm-spec CLASS_OR_PATH=SPEC ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NormSpecOverride:
    """A spec the user declares for the modules of a class or at a path (``--norm-spec``).

    ``fields`` are :class:`RMSNormSpec` fields; without ``epsilon`` the module's epsilon
    attribute is read (it must have exactly one), without ``normalized_dims`` its weight's.
    """

    selector: str  # class name (short or full) or module path
    fields: tuple[tuple[str, Any], ...]
    text: str  # as the user wrote it

    def spec_for(self, module: torch.nn.Module, where: str) -> RMSNormSpec:
        fields = dict(self.fields)
        if "epsilon" not in fields:
            eps = epsilons_of(module)
            if len(eps) != 1:
                found = f"its epsilon attributes hold {eps}" if eps else "it has no epsilon attribute"
                raise UserError(f"--norm-spec {self.text}: {where}: {found}; give it as eps=VALUE")
            fields["epsilon"] = eps[0]
        if "normalized_dims" not in fields:
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and fields.get("gain", "weight") != "none":
                fields["normalized_dims"] = max(1, weight.dim())
        try:
            return RMSNormSpec(**fields)
        except SpecError as exc:
            raise UserError(f"--norm-spec {self.text}: {exc}") from None


def parse_norm_spec(text: str) -> NormSpecOverride:
    """``CLASS_OR_PATH=SPEC``: SPEC as :func:`~rmsnorm_deploy.contract.spec.parse_spec` reads it
    (``llama``, ``eps=1e-6,gain=offset,order=scale_then_cast``, ``gemma,eps=1e-5``), except that a
    named spec lends its gain, order, accumulation and epsilon placement only: epsilon and the
    normalized dims come from the module unless given."""
    usage = ("give CLASS_OR_PATH=SPEC, SPEC a named spec (" + ", ".join(named_specs()) +
             ") or fields (e.g. eps=1e-6,gain=offset,order=scale_then_cast)")
    if not isinstance(text, str) or "=" not in text:
        raise UserError(f"--norm-spec {text!r}: {usage}")
    selector, _, spec_text = text.partition("=")
    selector, spec_text = selector.strip(), spec_text.strip()
    if not selector or not spec_text:
        raise UserError(f"--norm-spec {text!r}: {usage}")
    try:
        named, given = spec_fields(spec_text)
        fields = {**{k: v for k, v in named.items() if k not in ("epsilon", "normalized_dims")}, **given}
        RMSNormSpec(**{"epsilon": 1e-6, **fields})  # every field checked now, before any work
    except SpecError as exc:
        raise UserError(f"--norm-spec {text!r}: {exc}") from None
    return NormSpecOverride(selector, tuple(sorted(fields.items())), text)


def _override_for(overrides: dict[str, NormSpecOverride], path: str, name: str, module: torch.nn.Module,
                  used: set[str]) -> NormSpecOverride | None:
    cls = type(module)
    for key in (path, name, class_path(cls), cls.__qualname__, cls.__name__):
        if key in overrides:
            used.add(key)
            return overrides[key]
    return None


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


def detect_norms(model: torch.nn.Module, *, dtype: Any = None, confirm: bool = True, seed: int = 0,
                 overrides: Any = (), example: dict[str, Any] | None = None) -> Detection:
    """Every RMSNorm of ``model`` with its spec (confirmed unless ``confirm=False``).

    ``dtype``: the activation dtype, for norms without a weight (default: the model's first
    floating-point parameter's dtype). ``overrides``: :class:`NormSpecOverride` objects (each
    must match a module). ``example``: keyword inputs of ``model`` for one run that records the
    width weightless norms see.

    Raises :class:`UnknownNormError` for a module that looks like a norm but whose spec cannot
    be found, and :class:`NormMismatchError` for a spec that does not reproduce its module.
    """
    default_dtype = torch_dtype(dtype) if dtype is not None else _first_float_dtype(model)
    table = {o.selector: o for o in overrides}
    used: set[str] = set()
    cache = ProbeCache()
    widths: dict[str, Any] | None = None
    norms: list[DetectedNorm] = []
    others: list[tuple[str, str]] = []
    not_exported: list[NotExportedNorm] = []
    skip_under: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(prefix + ".") for prefix in skip_under):
            continue
        name = model_path(model, path)
        where = f"module {name or '<root>'!r} ({class_path(type(module))})"
        override = _override_for(table, path, name, module, used)
        how = "declared --norm-spec"
        found = (override.spec_for(module, where), how) if override is not None else spec_of(module)
        shape: tuple[int, ...] | None = None
        if found is None:
            if isinstance(module, OTHER_NORMS):
                others.append((name, class_path(type(module))))
                skip_under.append(path)
                continue
            if isinstance(module, NOT_NORMS) or not _NORM_LIKE.search(type(module).__name__) or \
                    isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                continue
            module_dtype = _module_dtype(module) or default_dtype
            shape = _probe_shape(module)
            if shape is None:
                if widths is None:
                    widths = _record_inputs(model, example, where)
                if _not_called(widths, path, module):
                    not_exported.append(NotExportedNorm(path, name, class_path(type(module)), NOT_CALLED))
                    continue
                shape = _recorded_width(widths, path, module, where)
            if shape is None:  # a container that is not itself a norm
                continue
            try:
                result = cache.probe(module, name, class_path(type(module)), shape, module_dtype, seed=seed)
            except NotANormError as exc:
                if any(True for _ in module.children()):
                    continue  # not a normalization; its inner norms are still seen
                raise UnknownNormError(f"{where} is named like a normalization but {exc}; this exporter cannot "
                                       "confirm what it computes (a gated norm takes a second input)") from None
            except ProbeError as exc:
                if exc.kind == "none" and any(True for _ in module.children()):
                    continue  # a block named like a norm that computes none: not claimed; its inner norms are seen
                raise UnknownNormError(str(exc)) from None
            found = (result.spec, f"confirmed by probing: {result.name}")
        spec, how = found
        weight = getattr(module, "weight", None) if spec.has_gain else None
        if spec.has_gain and not isinstance(weight, torch.Tensor):
            raise UnknownNormError(f"{where} has gain {spec.gain!r} but no tensor 'weight' attribute")
        # A weightless norm's width is what it sees in the model; a known class without a run to
        # read it from is checked at PROBE_WIDTH (nothing in it depends on the width).
        if shape is None and weight is None and _probe_shape(module) is None and not (
                example is None and how == "known class"):
            if widths is None:
                widths = _record_inputs(model, example, where)
            if _not_called(widths, path, module):
                not_exported.append(NotExportedNorm(path, name, class_path(type(module)), NOT_CALLED))
                continue
            shape = _recorded_width(widths, path, module, where)
        if shape is None or spec.has_gain:
            shape = _normalized_shape(module, spec, weight, where, recorded=shape, how=how)
        norm_dtype = weight.dtype if weight is not None else (_module_dtype(module) or default_dtype)
        # Specs whose epsilon depends on the dtype (torch.nn.RMSNorm with eps=None) are read in it.
        if how in ("known class", "SpecRMSNorm") or how.startswith("declared rmsnorm"):
            spec = spec_of(module, norm_dtype)[0]  # type: ignore[index]
        norm = DetectedNorm(path, class_path(type(module)), spec, module, weight, shape, norm_dtype, how, name)
        if confirm:
            confirm_norm(norm, seed=seed + len(norms))
        norms.append(norm)
        skip_under.append(path)
    unused = [k for k in table if k not in used]
    if unused:
        raise UserError(f"--norm-spec {table[unused[0]].text}: no module of the model has the class or path "
                        f"{unused[0]!r}")
    return Detection(norms, others, not_exported)


def _probe_shape(module: torch.nn.Module) -> tuple[int, ...] | None:
    """The normalized shape a module states: its weight's, or its ``normalized_shape``."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() >= 1:
        return tuple(int(d) for d in weight.shape)
    declared = getattr(module, "normalized_shape", None)
    if isinstance(declared, int):
        return (declared,)
    if isinstance(declared, (tuple, list, torch.Size)) and all(isinstance(d, int) for d in declared):
        return tuple(declared)
    return None


def _record_inputs(model: torch.nn.Module, example: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """The first call's tensor arguments of every module, from one run of ``model``."""
    if example is None:
        raise UnknownNormError(f"{where} has no weight and no normalized_shape, so its width is read from a run "
                               "of the model; give example inputs (the export does)")
    calls: dict[str, Any] = {}
    handles = []

    def recorder(path: str):
        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if path not in calls:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
                calls[path] = tensors
        return hook

    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(recorder(path), with_kwargs=True))
    try:
        with torch.no_grad():
            model(**example)
    except Exception as exc:  # the model's own failure, in one line
        raise UnknownNormError(f"the model run that records the width of its weightless norms failed: "
                               f"{type(exc).__name__}: {one_line(exc)}") from None
    finally:
        for h in handles:
            h.remove()
    return calls


def _not_called(widths: dict[str, Any], path: str, module: torch.nn.Module) -> bool:
    """A leaf module the recorded run never calls (a container is seen through instead)."""
    return path not in widths and not any(True for _ in module.children())


def _recorded_width(widths: dict[str, Any], path: str, module: torch.nn.Module, where: str) -> tuple[int, ...] | None:
    tensors = widths.get(path)
    if tensors is None:  # a container not called (a leaf is :func:`_not_called`)
        return None
    if len(tensors) != 1:
        if any(True for _ in module.children()):
            return None
        raise UnknownNormError(f"{where} is called with {len(tensors)} tensors inside the model, not one; this "
                               "exporter cannot confirm what it computes (a gated norm takes a second input)")
    x = tensors[0]
    if not x.is_floating_point() or x.dim() < 1:
        return None
    return (int(x.shape[-1]),)


@contextlib.contextmanager
def norm_calls(model: torch.nn.Module, detection: Detection) -> Iterator[set[str]]:
    """The paths of the detected norms that the run inside this block calls."""
    called: set[str] = set()
    handles = [model.get_submodule(n.path).register_forward_pre_hook(lambda *_, p=n.path: called.add(p))
               for n in detection.norms]
    try:
        yield called
    finally:
        for h in handles:
            h.remove()


def without_uncalled(detection: Detection, called: set[str]) -> Detection:
    """``detection`` with the norms the run the export traces never called moved to ``not_exported``:
    a norm with a weight (a multimodal projector's on text input) that cannot be in the graph."""
    uncalled = [n for n in detection.norms if n.path not in called]
    if not uncalled:
        return detection
    return Detection([n for n in detection.norms if n.path in called], detection.other_norms,
                     detection.not_exported + [NotExportedNorm(n.path, n.name, n.class_name, NOT_CALLED_BY_RUN)
                                               for n in uncalled])


@contextlib.contextmanager
def refuse_calls_of_not_exported(model: torch.nn.Module, detection: Detection) -> Iterator[None]:
    """Around the run whose forward the export traces: a module left out as not on the exported
    path that this run calls is refused (it would be in the graph, unchecked)."""
    called: list[NotExportedNorm] = []
    handles = [model.get_submodule(n.path).register_forward_pre_hook(lambda *_, n=n: called.append(n))
               for n in detection.not_exported]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    if called:
        first = called[0]
        raise UnknownNormError(f"module {first.name!r} ({first.class_name}) is called by the forward the export "
                               "traces but not by the example run that detected the norms, so it is unchecked; "
                               "give it a normalized_shape attribute so that its spec can be confirmed")


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
            raise NormMismatchError(f"norm {norm.name!r} ({norm.class_name}) failed on a {list(shape)} "
                                    f"{norm.dtype} input: {exc}") from None
        want = reference(norm.spec, x, norm.weight, z)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        raise NormMismatchError(
            f"norm {norm.name!r} ({norm.class_name}) returned {_describe(got)}; its spec gives {_describe(want)}"
        )
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(same.all()):
        bad = int((~same).sum())
        err = float((got.double() - want.double()).abs().max())
        ulp = compare(got, want, Tolerance(reason="confirmation: bit for bit"), dtype=want.dtype).max_ulp
        raise NormMismatchError(
            f"norm {norm.name!r} ({norm.class_name}) differs from its spec [{norm.spec.describe()}] in {bad} of "
            f"{got.numel()} {norm.dtype} elements (max abs {err:.3g}, {ulp:.3g} ULP); its class computes something "
            f"else: declare its real spec (an {SPEC_ATTRIBUTE} attribute, or export --norm-spec)"
        )


def _normalized_shape(module: torch.nn.Module, spec: RMSNormSpec, weight: Any, where: str,
                      recorded: tuple[int, ...] | None = None, how: str = "") -> tuple[int, ...]:
    if weight is not None:
        shape = tuple(int(d) for d in weight.shape)
    elif recorded is not None:
        shape = recorded
    else:
        declared = getattr(module, "normalized_shape", None)
        if declared is None and how == "known class" and spec.normalized_dims == 1 and spec.group_size is None:
            declared = PROBE_WIDTH  # a known gainless class: nothing in it depends on the width
        if declared is None:
            raise UnknownNormError(f"{where} has no weight and no normalized_shape attribute, so it cannot be "
                                   "checked; give it a normalized_shape")
        shape = (int(declared),) if isinstance(declared, int) else tuple(int(d) for d in declared)
    if len(shape) != spec.normalized_dims:
        raise UnknownNormError(f"{where} normalizes shape {list(shape)} but its spec normalizes "
                               f"{spec.normalized_dims} dim(s)")
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
