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


def rms_norm(ops: RMSNormOps[T], spec: RMSNormSpec, x: T, weight: T | None) -> T:
    """Evaluate ``spec`` on ``x`` (and ``weight`` when the spec has a gain) with ``ops``."""
    if spec.has_gain and weight is None:
        raise ValueError(f"spec has gain {spec.gain!r} but no weight was given")
    xa = ops.to_accumulation(x)
    mean_sq = ops.mean_square(xa, spec.axes)
    if spec.epsilon_placement == "inside_sqrt":
        normed = ops.normalize(xa, ops.add_epsilon(mean_sq))
    else:
        normed = ops.divide(xa, ops.add_epsilon(ops.sqrt(mean_sq)))
    if not spec.has_gain:
        return ops.to_input_dtype(normed, like=x)
    gain: Any = ops.to_accumulation(weight)
    if spec.gain == "offset":
        gain = ops.add_one(gain)
    if spec.order == "cast_then_scale":
        normed = ops.round_to_input_dtype(normed, like=x)
        gain = ops.round_to_input_dtype(gain, like=x)
    return ops.to_input_dtype(ops.multiply(normed, gain), like=x)
