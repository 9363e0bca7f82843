"""What the audit finds: each normalization reduction (``Reduction``), the tensors at its boundary
(``NormTensors``), and the findings read from a list of them (low precision, broken)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError

LOW_PRECISION = ("float16", "bfloat16")
DTYPE_WIDTH = {"float64": 64, "float32": 32, "float16": 16, "bfloat16": 16}


@dataclasses.dataclass
class NormTensors:
    """The tensors at a norm's boundary: what ``validate`` exposes to check it in isolation.

    ``inputs`` are added to form the normalized value (one tensor, or input and skip [and
    bias] for the Skip ops); ``sum_output`` is the Skip ops' own ``input + skip`` output when
    the graph uses it; ``gain`` multiplies the normalized value (a weight, Gemma's ``1 + w``,
    or any tensor the graph multiplies by at that point), ``bias`` is LayerNorm's.
    """

    inputs: list[str]
    output: str
    gain: str | None = None
    bias: str | None = None
    sum_output: str | None = None
    gate: str | None = None  # the second input ``z`` of a gated rmsnorm_deploy::RMSNorm node

    def names(self) -> list[str]:
        return [n for n in [*self.inputs, self.gain, self.gate, self.bias, self.sum_output, self.output] if n]


@dataclasses.dataclass
class Reduction:
    """One normalization reduction found in a graph."""

    stage: str  # "as written" or "after onnxruntime (<level>)"
    node: str  # node name (or output name) of the op that reduces
    kind: str  # RMSNorm, LayerNorm, RMSNorm (skip), ...
    op: str  # the op or op chain, e.g. "SimplifiedLayerNormalization" or "Pow>ReduceMean>Add>Sqrt"
    input_dtype: str
    accumulation: str
    epsilon: float | None
    axes: list[int] | None
    note: str = ""
    spec: dict[str, Any] | None = None
    squares: str = ""  # dtype the squares are computed in ("" when the op does it internally)
    epsilon_placement: str = "inside_sqrt"
    order: str = "scale_then_cast"  # cast_then_scale when the normalized value is narrowed before the gain
    normalized_dims: int | None = None
    tensors: NormTensors | None = None
    placement: str = ""  # pre, post, sublayer_output, qk, final, other (graph/placement.py); "" if not placed
    gate: str = ""  # a gated norm's gate, e.g. "silu(z) before_norm" (our nodes: from the spec)

    @property
    def problem(self) -> str:
        """Why this norm cannot compute a correct result whatever its inputs ("" if none): an
        epsilon that is NaN, infinite, zero or negative (NaN, all-zero or NaN rows out)."""
        eps = self.epsilon
        if eps is None:
            return ""
        if math.isnan(eps):
            return "its epsilon is NaN: every output is NaN; the graph is broken, re-export it with a positive epsilon"
        if math.isinf(eps):
            return (f"its epsilon is {eps}: every output is 0 or NaN; the graph is broken, re-export it with a "
                    "finite positive epsilon")
        if eps <= 0:
            return (f"its epsilon is {eps:g}, not positive: rows of small or zero values give NaN or Inf; "
                    "re-export it with a positive epsilon")
        return ""

    @property
    def low_precision(self) -> bool:
        return self.accumulation in LOW_PRECISION or self.squares in LOW_PRECISION

    @property
    def precision(self) -> str:
        """Squares and sum in one word when they agree, e.g. ``float32`` or ``float16 squares, float32 sum``."""
        if not self.squares or self.squares == self.accumulation:
            return self.accumulation
        return f"{self.squares} squares, {self.accumulation} sum"

    def implied_spec(self) -> RMSNormSpec | None:
        """The RMSNorm spec this reduction computes (ours: the node's own), or ``None`` if it is no RMSNorm.

        The float64 oracle of this spec is what the norm's output is measured against; rounding
        order does not change the oracle, so it is left at its default.
        """
        if self.spec is not None:
            return RMSNormSpec.from_dict(self.spec)
        if not self.kind.startswith("RMSNorm") or self.epsilon is None or not self.normalized_dims:
            return None
        gain = "weight" if self.tensors is not None and self.tensors.gain else "none"
        try:
            return RMSNormSpec(self.epsilon, self.normalized_dims, gain, self.order,  # type: ignore[arg-type]
                               epsilon_placement=self.epsilon_placement)
        except UserError:
            return None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["low_precision"] = self.low_precision
        data["problem"] = self.problem
        if data["epsilon"] is not None and not math.isfinite(data["epsilon"]):
            data["epsilon"] = str(data["epsilon"])  # JSON has no NaN or Infinity
        return data


def low_precision_reductions(reductions: Iterable[Reduction]) -> list[Reduction]:
    return [r for r in reductions if r.low_precision]


def broken_reductions(reductions: Iterable[Reduction]) -> list[Reduction]:
    """Reductions that cannot give a correct result (``Reduction.problem``: e.g. a NaN or negative epsilon)."""
    return [r for r in reductions if r.problem]
