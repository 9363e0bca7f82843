"""The RMSNorm formula, written once.

Every implementation that is *derived* from a spec evaluates this one function against
its own set of primitive operations (:class:`RMSNormOps`): the torch reference
(``reference.py``), the float64 oracle (same file) and the ONNX function body
(``onnx_function.py``, through onnxscript's tracer). The Triton kernel cannot be
traced, so it is written by hand and tested against the reference.

The steps and their rounding points::

    xa   = to_accumulation(x)                       # exact widening
    ms   = mean_square(xa, axes)                    # the reduction, in the accumulation dtype
    n    = normalize(xa, ms + eps)                  # x / sqrt(ms + eps)    (inside_sqrt)
         | divide(xa, sqrt(ms) + eps)               #                      (outside_sqrt)
    g    = to_accumulation(w) [+ 1 for offset]
    y    = to_input_dtype(n * g)                    # scale_then_cast: one rounding
         | to_input_dtype(round(n) * round(g))      # cast_then_scale: both factors rounded to the
                                                    # input dtype first, the product rounded once

A gated spec has a second input ``z``; ``a = activation(to_accumulation(z))`` (silu, sigmoid)::

    before_norm:  xa = xa * a before the mean square    (Mamba2: normalize x * silu(z))
    after_norm:   y  = to_input_dtype(n * g * a)        (one rounding)
    after_cast:   y  = to_input_dtype(round(n * g) * a) (the norm rounded, then gated, rounded again)

``group_size`` reshapes the last axis into groups before the mean square and back after the
normalization (``group``/``ungroup``), so each group has its own mean square.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from rmsnorm_deploy.contract.spec import RMSNormSpec

T = TypeVar("T")


class RMSNormOps(Protocol[T]):
    """The primitive operations the formula is written in.

    ``like`` is always the original input ``x``: it carries the dtype to round back to.
    """

    def to_accumulation(self, t: T) -> T: ...

    def to_input_dtype(self, t: T, like: T) -> T: ...

    def round_to_input_dtype(self, t: T, like: T) -> T:
        """Round to the input dtype and widen back: the value a cast-back would keep."""
        ...

    def mean_square(self, t: T, axes: tuple[int, ...]) -> T: ...

    def add_epsilon(self, t: T) -> T: ...

    def add_one(self, t: T) -> T: ...

    def sqrt(self, t: T) -> T: ...

    def normalize(self, t: T, mean_square_plus_eps: T) -> T:
        """``t / sqrt(mean_square_plus_eps)``; each backend picks its exact op form."""
        ...

    def divide(self, a: T, b: T) -> T: ...

    def multiply(self, a: T, b: T) -> T: ...

    def activation(self, t: T, name: str) -> T:
        """The gate's activation (``silu``: ``t * sigmoid(t)``; ``sigmoid``) in ``t``'s dtype."""
        ...

    def group(self, t: T, group_size: int) -> T:
        """Split the last axis into ``(-1, group_size)``."""
        ...

    def ungroup(self, t: T, like: T) -> T:
        """Merge the groups back into ``like``'s shape."""
        ...


def rms_norm(ops: RMSNormOps[T], spec: RMSNormSpec, x: T, weight: T | None, gate: T | None = None) -> T:
    """Evaluate ``spec`` on ``x`` (with ``weight`` when the spec has a gain, ``gate`` when it is
    gated) with ``ops``."""
    if spec.has_gain and weight is None:
        raise ValueError(f"spec has gain {spec.gain!r} but no weight was given")
    if spec.has_gate and gate is None:
        raise ValueError(f"spec is gated by {spec.gate}(z) but no gate input z was given")
    xa = ops.to_accumulation(x)
    act: Any = ops.activation(ops.to_accumulation(gate), spec.gate) if spec.has_gate else None
    if spec.gate_placement == "before_norm" and act is not None:
        xa = ops.multiply(xa, act)
    if spec.group_size is not None:
        xa = ops.group(xa, spec.group_size)
    mean_sq = ops.mean_square(xa, spec.axes)
    if spec.epsilon_placement == "inside_sqrt":
        normed = ops.normalize(xa, ops.add_epsilon(mean_sq))
    else:
        normed = ops.divide(xa, ops.add_epsilon(ops.sqrt(mean_sq)))
    if spec.group_size is not None:
        normed = ops.ungroup(normed, like=x)
    if spec.has_gain:
        gain: Any = ops.to_accumulation(weight)
        if spec.gain == "offset":
            gain = ops.add_one(gain)
        if spec.order == "cast_then_scale":
            normed = ops.round_to_input_dtype(normed, like=x)
            gain = ops.round_to_input_dtype(gain, like=x)
        normed = ops.multiply(normed, gain)
    if act is not None and spec.gate_placement != "before_norm":
        if spec.gate_placement == "after_cast":
            normed = ops.round_to_input_dtype(normed, like=x)
        normed = ops.multiply(normed, act)
    return ops.to_input_dtype(normed, like=x)
