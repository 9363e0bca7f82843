"""The numerics contract of one RMSNorm.

A checkpoint trained with one RMSNorm must be served with exactly that RMSNorm: the
same epsilon in the same place, the same normalized axes, the same gain, the same
rounding order, and a reduction that accumulates in float32 (or wider) even when the
activations are float16 or bfloat16. :class:`RMSNormSpec` names each of those choices;
the formula (``formula.py``), the references, the ONNX function, the lowerings, the
kernel and the tolerances are all derived from it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import numpy as np

from rmsnorm_deploy.errors import SpecError

Gain = Literal["none", "weight", "offset"]
Order = Literal["scale_then_cast", "cast_then_scale"]
Accumulation = Literal["float32", "float64"]
EpsilonPlacement = Literal["inside_sqrt", "outside_sqrt"]
Gate = Literal["none", "silu", "sigmoid"]
GatePlacement = Literal["before_norm", "after_norm", "after_cast"]

GAINS: tuple[str, ...] = ("none", "weight", "offset")
ORDERS: tuple[str, ...] = ("scale_then_cast", "cast_then_scale")
ACCUMULATIONS: tuple[str, ...] = ("float32", "float64")
EPSILON_PLACEMENTS: tuple[str, ...] = ("inside_sqrt", "outside_sqrt")
GATES: tuple[str, ...] = ("none", "silu", "sigmoid")
GATE_PLACEMENTS: tuple[str, ...] = ("before_norm", "after_norm", "after_cast")
#: The gate fields and their defaults: a spec at these values is an ungated RMSNorm, and its
#: dict (stored in ONNX metadata and compared) leaves them out, as it did before they existed.
_GATE_DEFAULTS: dict[str, Any] = {"gate": "none", "gate_placement": "after_norm", "group_size": None}

_GAIN_HELP = {
    "none": "no learned scale",
    "weight": "y = norm(x) * w",
    "offset": "y = norm(x) * (1 + w), as in Gemma",
}
_ORDER_HELP = {
    "scale_then_cast": "gain applied in the accumulation dtype, then one rounding to the input dtype "
    "(torch.nn.RMSNorm, Gemma, OLMo2)",
    "cast_then_scale": "normalized value rounded to the input dtype, then multiplied by the gain in that "
    "dtype (HF Llama, Mistral, Qwen2/3, Phi-3, DeepSeek-V3, T5, ONNX RMSNormalization)",
}
_GATE_HELP = {
    "none": "no gate: an RMSNorm of one input",
    "silu": "the norm is gated by silu(z) = z * sigmoid(z) of a second input z (Mamba2, Qwen3-Next, ...)",
    "sigmoid": "the norm is gated by sigmoid(z) of a second input z (Kimi-Linear, Bailing-Hybrid, GLM-5-Next)",
}
_GATE_PLACEMENT_HELP = {
    "before_norm": "x * act(z), in the accumulation dtype, is what is normalized (Mamba2, Bamba, Zamba2, "
    "Nemotron-H, GraniteMoeHybrid)",
    "after_norm": "the gained norm is multiplied by act(z) in the accumulation dtype, then rounded once to the "
    "input dtype (Kimi-Linear, Falcon-H1)",
    "after_cast": "the gained norm is rounded to the input dtype, then multiplied by act(z) in the accumulation "
    "dtype and rounded again (Qwen3-Next, Qwen3.5, OLMo-Hybrid)",
}


@dataclasses.dataclass(frozen=True)
class RMSNormSpec:
    """Everything that decides the numbers an RMSNorm produces.

    ``y = gain(x / sqrt(mean(x**2 over the last `normalized_dims` dims) + epsilon))``,
    computed in ``accumulation`` precision, with the gain applied before or after the
    rounding back to the input dtype as ``order`` says.

    Optionally *gated* (``gate``): a second input ``z`` of the shape and dtype of ``x`` is
    activated (``silu`` or ``sigmoid``, in the accumulation dtype) and multiplies ``x`` before
    the normalization, the gained norm before the rounding back, or the rounded norm after it
    (``gate_placement``). ``group_size`` normalizes the last axis in groups of that many
    elements (Mamba2's ``n_groups``): the mean square is taken per group.
    """

    epsilon: float = 1e-6
    normalized_dims: int = 1
    gain: Gain = "weight"
    order: Order = "scale_then_cast"
    accumulation: Accumulation = "float32"
    epsilon_placement: EpsilonPlacement = "inside_sqrt"
    gate: Gate = "none"
    gate_placement: GatePlacement = "after_norm"
    group_size: int | None = None

    def __post_init__(self) -> None:
        eps = self.epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise SpecError(f"epsilon must be a number, got {eps!r}")
        if not math.isfinite(eps) or eps <= 0:
            raise SpecError(f"epsilon must be finite and > 0, got {eps!r}; use e.g. 1e-6")
        object.__setattr__(self, "epsilon", float(eps))
        dims = self.normalized_dims
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise SpecError(f"normalized_dims must be an integer >= 1 (the trailing dims to normalize), got {dims!r}")
        _check_choice("gain", self.gain, GAINS)
        _check_choice("order", self.order, ORDERS)
        _check_choice("accumulation", self.accumulation, ACCUMULATIONS)
        _check_choice("epsilon_placement", self.epsilon_placement, EPSILON_PLACEMENTS)
        _check_choice("gate", self.gate, GATES)
        _check_choice("gate_placement", self.gate_placement, GATE_PLACEMENTS)
        if self.gate == "none" and self.gate_placement != _GATE_DEFAULTS["gate_placement"]:
            raise SpecError(f"gate_placement {self.gate_placement!r} needs a gate; set gate to one of "
                            f"{', '.join(GATES[1:])}, or leave gate_placement out")
        size = self.group_size
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise SpecError(f"group_size must be an integer >= 1 (elements of the last dim per group), got {size!r}")
            if dims != 1:
                raise SpecError(f"group_size groups the last dim; it needs normalized_dims 1, got {dims}")

    # -- named specs of well-known implementations ---------------------------------------
    @classmethod
    def torch_rmsnorm(cls, epsilon: float = 1e-6, *, normalized_dims: int = 1, affine: bool = True) -> RMSNormSpec:
        """``torch.nn.RMSNorm``: scales in float32, then casts."""
        return cls(epsilon, normalized_dims, "weight" if affine else "none", "scale_then_cast")

    @classmethod
    def llama(cls, epsilon: float = 1e-6) -> RMSNormSpec:
        """HF ``LlamaRMSNorm`` (and Mistral, Qwen2/3, Phi-3, DeepSeek-V3, T5): casts, then scales."""
        return cls(epsilon, 1, "weight", "cast_then_scale")

    @classmethod
    def gemma(cls, epsilon: float = 1e-6) -> RMSNormSpec:
        """HF ``GemmaRMSNorm`` (Gemma 1/2/3): ``(1 + w)`` applied in float32, then cast."""
        return cls(epsilon, 1, "offset", "scale_then_cast")

    @classmethod
    def olmo2(cls, epsilon: float = 1e-6) -> RMSNormSpec:
        """HF ``Olmo2RMSNorm``: weight applied in float32, then cast."""
        return cls(epsilon, 1, "weight", "scale_then_cast")

    @classmethod
    def mamba2_gated(cls, epsilon: float = 1e-6, group_size: int | None = None) -> RMSNormSpec:
        """HF ``MambaRMSNormGated`` (and Bamba, Zamba2, Nemotron-H, GraniteMoeHybrid): ``x * silu(z)``
        normalized per group in float32, rounded, then times ``w``."""
        return cls(epsilon, 1, "weight", "cast_then_scale", gate="silu", gate_placement="before_norm",
                   group_size=group_size)

    @classmethod
    def qwen3_next_gated(cls, epsilon: float = 1e-6) -> RMSNormSpec:
        """HF ``Qwen3NextRMSNormGated`` (and Qwen3.5, OLMo-Hybrid): the Llama norm, rounded, then times
        ``silu(z)`` in float32 and rounded again."""
        return cls(epsilon, 1, "weight", "cast_then_scale", gate="silu", gate_placement="after_cast")

    @classmethod
    def kimi_gated(cls, epsilon: float = 1e-6, gate: Gate = "sigmoid") -> RMSNormSpec:
        """HF ``KimiLinearRMSNormGated`` (and Bailing-Hybrid, GLM-5-Next; LaraMini with silu): weight and
        gate applied in float32, one rounding."""
        return cls(epsilon, 1, "weight", "scale_then_cast", gate=gate, gate_placement="after_norm")

    # -- derived facts -------------------------------------------------------------------
    @property
    def axes(self) -> tuple[int, ...]:
        """The normalized axes, counted from the end: ``(-k, ..., -1)``."""
        return tuple(range(-self.normalized_dims, 0))

    @property
    def epsilon_float32(self) -> float:
        """Epsilon as the float32 every model and graph actually adds (ONNX float attributes are float32)."""
        return float(np.float32(self.epsilon))

    @property
    def has_gain(self) -> bool:
        return self.gain != "none"

    @property
    def has_gate(self) -> bool:
        return self.gate != "none"

    def without_gate(self) -> RMSNormSpec:
        """The same norm with no gate (what a gated module computes when it is called without one)."""
        return dataclasses.replace(self, gate="none", gate_placement=_GATE_DEFAULTS["gate_placement"])

    def upcasts(self, input_dtype: str) -> bool:
        """Whether inputs of ``input_dtype`` are converted to the accumulation dtype before the reduction."""
        return input_dtype != self.accumulation

    def variant(self, upcast: bool) -> str:
        """The structure of the computation, as a short key (``upcast``: see :meth:`upcasts`).

        Specs that differ only in epsilon or axes share a variant (those are attributes);
        the ONNX function of each variant is one overload of ``rmsnorm_deploy::RMSNorm``.
        Without a gain, or without conversion, both orders round once at the same place,
        so the order is left out of the key.
        """
        parts = [self.gain]
        if self.has_gain and upcast:
            parts.append(self.order)
        parts.append(f"acc_{self.accumulation}")
        if self.epsilon_placement != "inside_sqrt":
            parts.append("eps_outside_sqrt")
        if self.group_size is not None:
            parts.append("grouped")
        if self.has_gate:
            parts.append(f"gate_{self.gate}_{self.gate_placement}")
        parts.append("upcast" if upcast else "same_dtype")
        return ".".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; the gate fields only where they differ from an ungated norm."""
        data = dataclasses.asdict(self)
        for key, default in _GATE_DEFAULTS.items():
            if data[key] == default:
                del data[key]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RMSNormSpec:
        if not isinstance(data, dict):
            raise SpecError(f"a spec must be a mapping of field to value, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SpecError(f"unknown spec field(s) {unknown}; known fields: {sorted(names)}")
        return cls(**data)

    def describe(self) -> str:
        """One line a person can read: the formula with this spec's choices."""
        eps = f"{self.epsilon:g}"
        inner = f"sqrt(mean(x^2) + {eps})" if self.epsilon_placement == "inside_sqrt" else f"(sqrt(mean(x^2)) + {eps})"
        gain = {"none": "", "weight": " * w", "offset": " * (1 + w)"}[self.gain]
        axes = "last dim" if self.normalized_dims == 1 else f"last {self.normalized_dims} dims"
        order = "" if not self.has_gain else f", {self.order}"
        if self.group_size is not None:
            axes += f" in groups of {self.group_size}"
        text = f"x / {inner}{gain} over the {axes}, accumulated in {self.accumulation}{order}"
        if self.has_gate:
            where = {"before_norm": "x * {a} normalized in place of x",
                     "after_norm": "times {a} before the rounding back",
                     "after_cast": "times {a} after the rounding back, rounded again"}[self.gate_placement]
            text += ", gated: " + where.format(a=f"{self.gate}(z)")
        return text

    @staticmethod
    def field_help() -> dict[str, dict[str, str]]:
        return {"gain": dict(_GAIN_HELP), "order": dict(_ORDER_HELP), "gate": dict(_GATE_HELP),
                "gate_placement": dict(_GATE_PLACEMENT_HELP)}


def named_specs() -> dict[str, RMSNormSpec]:
    """The specs of the implementations users bring most often, by a short name."""
    return {
        "torch": RMSNormSpec.torch_rmsnorm(1e-6),
        "llama": RMSNormSpec.llama(1e-6),
        "gemma": RMSNormSpec.gemma(1e-6),
        "olmo2": RMSNormSpec.olmo2(1e-6),
        "nogain": RMSNormSpec(1e-6, gain="none"),
    }


def gated_named_specs() -> dict[str, RMSNormSpec]:
    """The gated specs of the hybrid families, by a short name (kept apart from :func:`named_specs`,
    whose every spec each lowering and the TensorRT plugin represent)."""
    return {
        "mamba2_gated": RMSNormSpec.mamba2_gated(1e-6),
        "qwen3_next_gated": RMSNormSpec.qwen3_next_gated(1e-6),
        "kimi_gated": RMSNormSpec.kimi_gated(1e-6),
    }


def parse_spec(text: str) -> RMSNormSpec:
    """A spec from text: a named spec (``llama``), fields (``eps=1e-5,gain=offset``) or both, the name
    first (``mamba2_gated,eps=1e-5,group_size=64``). ``eps`` is short for ``epsilon``; a field
    given after a name replaces the name's value."""
    named, given = spec_fields(text)
    return RMSNormSpec(**{**named, **given})


def spec_fields(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields ``text`` names (see :func:`parse_spec`): those of its named spec, if it starts
    with one, and those given as ``FIELD=VALUE``, each read into its type."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError("an empty spec; give a named spec (" + ", ".join({**named_specs(), **gated_named_specs()})
                        + ") or fields like eps=1e-6")
    parts = [p.strip() for p in text.split(",") if p.strip()]
    named: dict[str, Any] = {}
    if "=" not in parts[0]:
        names = {**named_specs(), **gated_named_specs()}
        if parts[0] not in names:
            raise SpecError(f"unknown named spec {parts[0]!r}; choose one of {', '.join(names)}")
        named = dataclasses.asdict(names[parts.pop(0)])
    known = {f.name: f for f in dataclasses.fields(RMSNormSpec)}
    given: dict[str, Any] = {}
    for part in parts:
        key, sep, value = (s.strip() for s in part.partition("="))
        key = _FIELD_ALIASES.get(key, key)
        if not sep or key not in known:
            raise SpecError(f"cannot read {part!r} in spec {text!r}: expected FIELD=VALUE with a field of "
                            f"{', '.join(sorted(known))}")
        given[key] = _parse_value(key, value, text)
    return named, given


#: short names accepted for spec fields in text
_FIELD_ALIASES = {"eps": "epsilon", "dims": "normalized_dims", "placement": "epsilon_placement"}


def _parse_value(key: str, value: str, text: str) -> Any:
    if key == "epsilon":
        try:
            return float(value)
        except ValueError:
            raise SpecError(f"epsilon {value!r} in spec {text!r} is not a number") from None
    if key in ("normalized_dims", "group_size"):
        if key == "group_size" and value.lower() in ("none", ""):
            return None
        try:
            return int(value)
        except ValueError:
            raise SpecError(f"{key} {value!r} in spec {text!r} is not an integer") from None
    return value


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")
