"""References derived from a spec: a rounding-faithful torch one and a float64 oracle.

``reference(spec, x, w)`` rounds exactly where the spec says, so it is bit-equal to the
module the spec was taken from (torch.nn.RMSNorm, HF LlamaRMSNorm, GemmaRMSNorm, ...):
the tests prove it. ``oracle(spec, x, w)`` evaluates the same formula in float64 with no
rounding back: the ideal value that every backend is measured against.
"""

from __future__ import annotations

from typing import Any

import torch

from rmsnorm_deploy.contract import formula
from rmsnorm_deploy.contract.dtypes import to_torch, torch_dtype
from rmsnorm_deploy.contract.spec import RMSNormSpec


class TorchOps:
    """Torch primitives in the op forms the HF and torch modules use (``x * rsqrt(v)``)."""

    def __init__(self, spec: RMSNormSpec):
        self.spec = spec
        self.acc = torch_dtype(spec.accumulation)

    def to_accumulation(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.acc)

    def to_input_dtype(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.to(like.dtype)

    def round_to_input_dtype(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.to(like.dtype).to(self.acc)

    def mean_square(self, t: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        return t.pow(2).mean(dim=axes, keepdim=True)

    def add_epsilon(self, t: torch.Tensor) -> torch.Tensor:
        return t + self.spec.epsilon_float32

    def add_one(self, t: torch.Tensor) -> torch.Tensor:
        return 1.0 + t

    def sqrt(self, t: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(t)

    def normalize(self, t: torch.Tensor, mean_square_plus_eps: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(mean_square_plus_eps)

    def divide(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a / b

    def multiply(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    def activation(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.silu(t) if name == "silu" else torch.sigmoid(t)

    def group(self, t: torch.Tensor, group_size: int) -> torch.Tensor:
        return t.reshape(*t.shape[:-1], -1, group_size)

    def ungroup(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.reshape(like.shape)


class Float64Ops(TorchOps):
    """The same formula in float64, never rounded back: the oracle."""

    def __init__(self, spec: RMSNormSpec):
        super().__init__(spec)
        self.acc = torch.float64

    def to_input_dtype(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t

    def round_to_input_dtype(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t

    def normalize(self, t: torch.Tensor, mean_square_plus_eps: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt(mean_square_plus_eps)


def reference(spec: RMSNormSpec, x: Any, weight: Any = None, gate: Any = None) -> torch.Tensor:
    """The spec evaluated with torch, rounding where the spec rounds; output dtype = ``x``'s.

    ``gate``: the second input ``z`` of a gated spec (same shape and dtype as ``x``)."""
    x_t, w_t, z_t = _as_tensors(x, weight, gate)
    _check_gate(spec, x_t, z_t)
    return formula.rms_norm(TorchOps(spec), spec, x_t, w_t, z_t)


def oracle(spec: RMSNormSpec, x: Any, weight: Any = None, gate: Any = None) -> torch.Tensor:
    """The spec evaluated in float64 with no rounding back: a float64 tensor."""
    x_t, w_t, z_t = _as_tensors(x, weight, gate)
    _check_gate(spec, x_t, z_t)
    return formula.rms_norm(Float64Ops(spec), spec, x_t, w_t, z_t)


def _check_gate(spec: RMSNormSpec, x: torch.Tensor, gate: torch.Tensor | None) -> None:
    if spec.group_size is not None and x.shape[-1] % spec.group_size:
        raise ValueError(f"the last dim {x.shape[-1]} is not a multiple of group_size {spec.group_size}")
    if gate is not None and not spec.has_gate:
        raise ValueError("a gate input was given but the spec has no gate")
    if gate is not None and (gate.shape != x.shape or gate.dtype != x.dtype):
        raise ValueError(f"the gate input must have the shape and dtype of x: got {str(gate.dtype).removeprefix('torch.')}"
                         f"{list(gate.shape)} for x {str(x.dtype).removeprefix('torch.')}{list(x.shape)}")


class SpecRMSNorm(torch.nn.Module):
    """An ``nn.Module`` that computes :func:`reference` for its spec (weight as a parameter)."""

    def __init__(self, spec: RMSNormSpec, normalized_shape: int | tuple[int, ...], dtype: Any = torch.float32):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != spec.normalized_dims:
            raise ValueError(f"normalized_shape {shape} has {len(shape)} dims but the spec normalizes {spec.normalized_dims}")
        self.spec = spec
        self.normalized_shape = shape
        if spec.has_gain:
            init = torch.zeros if spec.gain == "offset" else torch.ones
            self.weight = torch.nn.Parameter(init(shape, dtype=torch_dtype(dtype)))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference(self.spec, x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, {self.spec.describe()}"


def _as_tensors(x: Any, weight: Any, gate: Any = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:

    def conv(a: Any) -> torch.Tensor | None:
        if a is None or isinstance(a, torch.Tensor):
            return a
        return to_torch(a)

    return conv(x), conv(weight), conv(gate)
