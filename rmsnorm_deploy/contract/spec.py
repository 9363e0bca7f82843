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

GAINS: tuple[str, ...] = ("none", "weight", "offset")
ORDERS: tuple[str, ...] = ("scale_then_cast", "cast_then_scale")
ACCUMULATIONS: tuple[str, ...] = ("float32", "float64")
EPSILON_PLACEMENTS: tuple[str, ...] = ("inside_sqrt", "outside_sqrt")

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


@dataclasses.dataclass(frozen=True)
class RMSNormSpec:
    """Everything that decides the numbers an RMSNorm produces.

    ``y = gain(x / sqrt(mean(x**2 over the last `normalized_dims` dims) + epsilon))``,
    computed in ``accumulation`` precision, with the gain applied before or after the
    rounding back to the input dtype as ``order`` says.
    """

    epsilon: float = 1e-6
    normalized_dims: int = 1
    gain: Gain = "weight"
    order: Order = "scale_then_cast"
    accumulation: Accumulation = "float32"
    epsilon_placement: EpsilonPlacement = "inside_sqrt"

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
        parts.append("upcast" if upcast else "same_dtype")
        return ".".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

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
        return f"x / {inner}{gain} over the {axes}, accumulated in {self.accumulation}{order}"

    @staticmethod
    def field_help() -> dict[str, dict[str, str]]:
        return {"gain": dict(_GAIN_HELP), "order": dict(_ORDER_HELP)}


def named_specs() -> dict[str, RMSNormSpec]:
    """The specs of the implementations users bring most often, by a short name."""
    return {
        "torch": RMSNormSpec.torch_rmsnorm(1e-6),
        "llama": RMSNormSpec.llama(1e-6),
        "gemma": RMSNormSpec.gemma(1e-6),
        "olmo2": RMSNormSpec.olmo2(1e-6),
        "nogain": RMSNormSpec(1e-6, gain="none"),
    }


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")
