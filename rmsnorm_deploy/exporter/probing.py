"""What an unknown norm module computes, found by running it: detection by probing.

A module whose class is not known (``detect.KNOWN_CLASSES``) and that declares no spec is
run, with every *candidate* spec's reference (``reference.reference``), on probe inputs.

Candidates
    the epsilons read from the module's attributes (:data:`EPSILON_ATTRIBUTES`; when it has
    none, :data:`DEFAULT_EPSILONS`) x gain ``none`` / ``weight`` / ``offset`` (the last two
    only for a module with a tensor ``weight`` of the normalized shape) x both orders x both
    epsilon placements, over as many trailing dims as the weight has (1 without a weight).
    The named specs (``spec.named_specs``) are among them, up to epsilon.

Probes
    float32, float16 and bfloat16 (the module is copied and converted for the dtypes it is
    not in; a dtype the copy cannot run in is left out, but never the model's own); each at
    the module's real weight and at a seeded random weight around 1 (so that a gain that is
    all ones today, or all zeros for ``1 + w``, still shows whether and how it is applied);
    rows of normal values, of magnitudes from 1e-3 to 1e2, of magnitudes around
    ``sqrt(eps)`` and ``eps`` of every candidate epsilon (where the epsilon and its placement
    decide the result), stress values up to 6e4, and zero rows. A weightless module is
    probed at the width it sees inside the model (recorded during a model run by
    ``detect.detect_norms``).

Decision
    a candidate *matches* when it is bit-identical to the module on every probe (NaN where
    the module gives NaN). Two matching candidates are *equivalent* when they are the same
    spec after :func:`normal_form`: the epsilon compared as the float32 every graph adds, and
    the order left out for a spec without a gain (both orders round once at the same place).
    Nothing else is equivalent: gain ``none`` and ``weight`` differ as soon as the weight is
    not all ones (the random-weight probes see it), and two specs that only the untried
    dtypes could tell apart are *ambiguous*: the module is refused and the user declares its
    spec (``export --norm-spec``). Accepted only when the matches form exactly one class.
    A module matching none is refused with the closest candidate and its distance in ULPs;
    a module whose output does not change when a constant is added to a row subtracts the
    mean (a LayerNorm): refused as such.

The probed function ``(x, weight) -> y`` is the same for every module of one class with the
same attributes and shapes, so :class:`ProbeCache` probes each such group once; each module
is still confirmed on its own weight (``detect.confirm_norm``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Iterable

import torch

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.reference import reference
from rmsnorm_deploy.contract.spec import EPSILON_PLACEMENTS, GAINS, ORDERS, RMSNormSpec, named_specs
from rmsnorm_deploy.contract.tolerances import Tolerance
from rmsnorm_deploy.errors import SpecError, UserError, one_line

#: Attributes an epsilon is read from, in this order.
EPSILON_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon", "norm_eps", "rms_norm_eps", "layer_norm_eps",
                      "layer_norm_epsilon")
#: Candidate epsilons of a module that has no epsilon attribute: the common ones, and
#: ``torch.nn.RMSNorm``'s default (float32's machine epsilon).
DEFAULT_EPSILONS = (1e-6, 1e-5, float(torch.finfo(torch.float32).eps))
PROBE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Leading shape of each probe: 2 x rows (rows: see :func:`probe_inputs`).
_BATCH = 2
#: Modules that are never normalizations, whatever their class name says.
NOT_NORMS: tuple[type, ...] = (torch.nn.Embedding, torch.nn.EmbeddingBag, torch.nn.Linear,
                               torch.nn.modules.conv._ConvNd)


class ProbeError(UserError):
    """A module probing cannot map to exactly one spec: ``kind`` is ``ambiguous``, ``layernorm`` or ``none``."""

    def __init__(self, message: str, kind: str = "none"):
        super().__init__(message)
        self.kind = kind


class NotANormError(Exception):
    """The module does not map a float tensor to a float tensor of the same shape (internal)."""


@dataclasses.dataclass(frozen=True)
class Probe:
    label: str
    x: torch.Tensor
    weight: torch.Tensor | None
    got: torch.Tensor


@dataclasses.dataclass
class ProbeResult:
    """The spec a module computes, as probing found it."""

    spec: RMSNormSpec
    name: str  # e.g. "llama (eps 1e-05)"
    dtypes: tuple[str, ...]  # the dtypes probed
    candidates: int  # how many candidate specs were tried


def epsilons_of(module: torch.nn.Module) -> list[float]:
    """The finite positive numbers in the module's epsilon attributes (deduplicated, in order)."""
    found: list[float] = []
    for name in EPSILON_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value) and value > 0 and float(value) not in found:
            found.append(float(value))
    return found


def normal_form(spec: RMSNormSpec) -> RMSNormSpec:
    """The spec with what cannot change a result normalized away (see the module docstring)."""
    spec = dataclasses.replace(spec, epsilon=spec.epsilon_float32)
    if not spec.has_gain:
        spec = dataclasses.replace(spec, order="scale_then_cast")
    return spec


def spec_name(spec: RMSNormSpec) -> str:
    """A named spec with ``spec``'s epsilon (``llama (eps 1e-05)``), or the spec's formula."""
    for name, named in named_specs().items():
        if normal_form(dataclasses.replace(named, epsilon=spec.epsilon, normalized_dims=spec.normalized_dims)) \
                == normal_form(spec):
            return f"{name} (eps {spec.epsilon:g})"
    return spec.describe()


def candidate_specs(module: torch.nn.Module, dims: int, *, with_weight: bool) -> list[RMSNormSpec]:
    """Every candidate spec of ``module`` (see the module docstring), one per normal form."""
    eps = epsilons_of(module) or list(DEFAULT_EPSILONS)
    gains = GAINS if with_weight else ("none",)
    seen: dict[RMSNormSpec, RMSNormSpec] = {}
    for e in eps:
        for gain in gains:
            for order in ORDERS:
                for placement in EPSILON_PLACEMENTS:
                    spec = RMSNormSpec(e, dims, gain, order, "float32", placement)
                    seen.setdefault(normal_form(spec), spec)
    return list(seen.values())


def has_gain_weight(module: torch.nn.Module, shape: tuple[int, ...]) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.is_floating_point() and tuple(weight.shape) == tuple(shape)


def probe_inputs(shape: tuple[int, ...], dtype: torch.dtype, epsilons: Iterable[float], seed: int) -> torch.Tensor:
    """``[2, rows, *shape]`` of ``dtype``: normal rows, magnitudes 1e-3..1e2, rows around sqrt(eps)
    and eps of each candidate epsilon, stress rows, zero rows."""
    gen = torch.Generator().manual_seed(seed)
    scales = [1.0, 1.0] + [10.0 ** v for v in (-3, -2, -1, 0.5, 1, 2)]
    for e in sorted(set(epsilons)):
        scales += [math.sqrt(e) * f for f in (0.25, 1.0, 4.0)] + [e, 4 * e]
    rows = len(scales) + 3  # + two stress rows and a zero row
    x = torch.randn((_BATCH, rows) + shape, generator=gen, dtype=torch.float64)
    per_row = torch.tensor(scales + [1.0, 1.0, 0.0], dtype=torch.float64).view((1, rows) + (1,) * len(shape))
    x = x * per_row
    # stress rows: magnitudes 300..60000 (float16's range ends at 65504), signs random
    stress = torch.empty((_BATCH, 2) + shape, dtype=torch.float64).uniform_(300.0, 60000.0, generator=gen)
    sign = torch.randint(0, 2, stress.shape, generator=gen).to(torch.float64) * 2 - 1
    x[:, len(scales):len(scales) + 2] = stress * sign
    return x.to(dtype)


def _random_weight(weight: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(weight.shape, generator=gen, dtype=torch.float32)).to(weight.dtype)


def _copy_in(module: torch.nn.Module, dtype: torch.dtype, own_dtype: torch.dtype) -> torch.nn.Module:
    copied = copy.deepcopy(module)
    return copied if dtype == own_dtype else copied.to(dtype)


def _run(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        try:
            y = module(x)
        except Exception as exc:  # any failure of forward(x) means: not a one-input normalization
            raise NotANormError(f"forward(x) fails on a {list(x.shape)} {str(x.dtype).removeprefix('torch.')} "
                                f"tensor: {type(exc).__name__}: {one_line(exc, limit=160)}") from None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not y.is_floating_point():
        what = f"{str(y.dtype).removeprefix('torch.')}{list(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise NotANormError(f"forward(x) maps a {list(x.shape)} tensor to {what}")
    return y


def run_probes(module: torch.nn.Module, shape: tuple[int, ...], own_dtype: torch.dtype,
               epsilons: Iterable[float], *, with_weight: bool, seed: int = 0) -> list[Probe]:
    """The module's outputs on every probe; raises :class:`NotANormError` when it does not run in
    its own dtype or does not map a tensor to one of the same shape."""
    epsilons = list(epsilons)
    probes: list[Probe] = []
    for i, dtype in enumerate(PROBE_DTYPES if own_dtype in PROBE_DTYPES else (own_dtype,) + PROBE_DTYPES):
        try:
            copied = _copy_in(module, dtype, own_dtype)
        except Exception as exc:  # a module that cannot be copied cannot be probed
            raise NotANormError(f"it cannot be copied for probing ({type(exc).__name__}: {one_line(exc, limit=120)})") \
                from None
        x = probe_inputs(shape, dtype, epsilons, seed + i)
        weights: list[tuple[str, torch.Tensor | None]] = [("", None)]
        if with_weight:
            real = copied.weight.detach().clone()
            weights = [("real weight", real), ("random weight", _random_weight(real, seed + 100 + i))]
        for label, weight in weights:
            if weight is not None:
                with torch.no_grad():
                    copied.weight.copy_(weight)
            try:
                got = _run(copied, x)
            except NotANormError:
                if dtype == own_dtype:
                    raise
                break  # a dtype the module does not support is not probed (never its own)
            dt = str(dtype).removeprefix("torch.")
            probes.append(Probe(f"{dt} {label}".strip(), x, weight, got))
    return probes


def _bit_identical(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    return bool(((got == want) | (torch.isnan(got) & torch.isnan(want))).all())


def _ulp_distance(spec: RMSNormSpec, probes: list[Probe]) -> tuple[float, str, float]:
    """The largest ULP distance of ``spec``'s reference from the module over the probes, where, and
    the sum over the probes of each one's largest (it ranks candidates whose worst probe ties)."""
    worst, where, total = 0.0, "", 0.0
    exact = Tolerance(reason="probing: bit for bit")
    for p in probes:
        want = reference(spec, p.x, p.weight if spec.has_gain else None)
        if want.dtype != p.got.dtype:
            return math.inf, f"{p.label}: the module returns {p.got.dtype}, the spec {want.dtype}", math.inf
        result = compare(p.got, want, exact, dtype=want.dtype)
        ulp = result.max_ulp if not (result.nan_mismatch or result.inf_mismatch) else math.inf
        total += ulp
        if ulp > worst or not where:
            worst, where = ulp, p.label
    return worst, where, total


def subtracts_mean(module: torch.nn.Module, probes: list[Probe]) -> bool:
    """Whether adding a constant to every element of a row leaves the output (nearly) unchanged:
    true of LayerNorm (it subtracts the mean), false of any RMS norm."""
    p = next((p for p in probes if p.x.dtype == torch.float32), None)
    if p is None:
        return False
    x = p.x[:, :2]  # two rows of normal values
    try:
        with torch.no_grad():
            copied = copy.deepcopy(module).to(torch.float32)
            if p.weight is not None:
                copied.weight.copy_(p.weight)
            a, b = copied(x), copied(x + 3.0)
    except Exception:  # noqa: BLE001 - a module that fails here is simply not shown to be a LayerNorm
        return False
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
        bool(torch.allclose(a, b, rtol=1e-3, atol=1e-3))


def probe_norm(module: torch.nn.Module, name: str, class_name: str, shape: tuple[int, ...],
               own_dtype: torch.dtype, *, seed: int = 0) -> ProbeResult:
    """The one spec (up to equivalence) ``module`` computes bit for bit on every probe.

    Raises :class:`NotANormError` when it does not map a float tensor to one of the same shape,
    and :class:`ProbeError` (one line, naming ``name`` and ``class_name``) when no candidate or
    more than one matches.
    """
    with_weight = has_gain_weight(module, shape)
    candidates = candidate_specs(module, len(shape), with_weight=with_weight)
    eps = sorted({c.epsilon for c in candidates})
    probes = run_probes(module, shape, own_dtype, eps, with_weight=with_weight, seed=seed)
    matches = [c for c in candidates
               if all(_bit_identical(p.got, reference(c, p.x, p.weight if c.has_gain else None)) for p in probes)]
    dtypes = tuple(dict.fromkeys(str(p.x.dtype).removeprefix("torch.") for p in probes))
    where = f"module {name!r} ({class_name})"
    classes = list(dict.fromkeys(normal_form(c) for c in matches))
    if len(classes) == 1:
        spec = matches[0]
        return ProbeResult(spec, spec_name(spec), dtypes, len(candidates))
    if len(classes) > 1:
        listed = "; ".join(spec_name(c) for c in classes[:3])
        untried = [str(d).removeprefix("torch.") for d in PROBE_DTYPES if str(d).removeprefix("torch.") not in dtypes]
        why = f" (it does not run in {', '.join(untried)})" if untried else ""
        raise ProbeError(f"{where}: probing cannot decide between {len(classes)} specs that all reproduce it bit for "
                         f"bit in {', '.join(dtypes)}{why}: {listed}; declare the right one with "
                         f"--norm-spec {class_name.rsplit('.', 1)[-1]}=SPEC or an rmsnorm_spec attribute", "ambiguous")
    if subtracts_mean(module, probes):
        raise ProbeError(f"{where} is a LayerNorm (it subtracts the mean: its output does not change when a "
                         "constant is added to its input), not an RMSNorm; this exporter does not guarantee "
                         "LayerNorms, so it does not export this model", "layernorm")
    ranked = sorted(((_ulp_distance(c, probes), c) for c in candidates), key=lambda t: (t[0][0], t[0][2]))
    (ulp, at, _), best = ranked[0]
    distance = "NaN/Inf where the module is finite" if math.isinf(ulp) else f"{ulp:.3g} ULP"
    raise ProbeError(f"{where} computes none of the {len(candidates)} candidate RMSNorm specs bit for bit "
                     f"(probed in {', '.join(dtypes)}); closest: {spec_name(best)} [{best.describe()}], "
                     f"{distance} off at {at}; if it is an RMSNorm, declare its spec with "
                     f"--norm-spec {class_name.rsplit('.', 1)[-1]}=SPEC or an rmsnorm_spec attribute")


class ProbeCache:
    """Probe results shared by modules of one class with the same epsilons, shape and dtype."""

    def __init__(self) -> None:
        self._results: dict[tuple[Any, ...], ProbeResult | BaseException] = {}

    def probe(self, module: torch.nn.Module, name: str, class_name: str, shape: tuple[int, ...],
              own_dtype: torch.dtype, *, seed: int = 0) -> ProbeResult:
        key = (type(module), tuple(epsilons_of(module)), shape, own_dtype, has_gain_weight(module, shape))
        cached = self._results.get(key)
        if cached is None:
            try:
                cached = probe_norm(module, name, class_name, shape, own_dtype, seed=seed)
            except (ProbeError, NotANormError, SpecError) as exc:
                cached = exc
            self._results[key] = cached
        if isinstance(cached, BaseException):
            raise cached
        return cached
