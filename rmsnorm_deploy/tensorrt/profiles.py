"""TensorRT optimization profiles from a model's dynamic axes.

A profile is given per *dynamic dim*, not per input: ``d0:1,64,256`` sets the range of the dim
named ``d0`` wherever it appears, so inputs that share a dim (batch, sequence) always get
consistent shapes. Named dims keep their ONNX ``dim_param``; an unnamed dynamic dim is called
``<input>.<axis>`` (e.g. ``x.0``). Ranges come from ``--profile`` first, then from the export
metadata (``ModelMetadata.dims``); a dynamic dim with neither is an error that says what to pass.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping, Sequence

import onnx

from rmsnorm_deploy.errors import InputError, UserError

_PROFILE_RE = re.compile(r"^\s*([^:\s][^:]*?)\s*:\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class DimRange:
    """The ``min <= opt <= max`` range of one dynamic dim, and where the range came from."""

    name: str
    min: int
    opt: int
    max: int
    source: str = "--profile"

    def as_list(self) -> list[int]:
        return [self.min, self.opt, self.max]


@dataclasses.dataclass(frozen=True)
class InputProfile:
    """The min/opt/max shapes of one model input (equal for static inputs)."""

    name: str
    dims: tuple[int | str, ...]  # ints for static dims, dim names for dynamic ones
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    @property
    def dynamic(self) -> bool:
        return self.min != self.max or any(isinstance(d, str) for d in self.dims)


@dataclasses.dataclass
class Profiles:
    """One optimization profile: a range per dynamic dim and the shapes it gives each input."""

    dims: dict[str, DimRange]
    inputs: dict[str, InputProfile]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dims": {name: {"min": r.min, "opt": r.opt, "max": r.max, "source": r.source} for name, r in self.dims.items()},
            "inputs": {
                name: {"dims": list(p.dims), "min": list(p.min), "opt": list(p.opt), "max": list(p.max)}
                for name, p in self.inputs.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profiles:
        dims = {
            name: DimRange(name, int(r["min"]), int(r["opt"]), int(r["max"]), str(r.get("source", "")))
            for name, r in data.get("dims", {}).items()
        }
        inputs = {
            name: InputProfile(name, tuple(p["dims"]), tuple(p["min"]), tuple(p["opt"]), tuple(p["max"]))
            for name, p in data.get("inputs", {}).items()
        }
        return cls(dims, inputs)

    def check_shape(self, name: str, shape: Sequence[int]) -> None:
        """Raise :class:`InputError` unless ``shape`` lies within the profile of input ``name``."""
        profile = self.inputs.get(name)
        if profile is None:
            raise InputError(f"input {name!r} is not in the engine's profile (it has {sorted(self.inputs)})")
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(profile.min):
            raise InputError(f"input {name!r} has shape {list(shape)} but the engine takes rank {len(profile.min)} "
                             f"({_shape_text(profile.dims)})")
        outside = [
            f"{_dim_label(d, i)}={s} not in {lo}..{hi}"
            for i, (d, s, lo, hi) in enumerate(zip(profile.dims, shape, profile.min, profile.max))
            if not lo <= s <= hi
        ]
        if outside:
            dyn = [d for d in profile.dims if isinstance(d, str)]
            hint = (f"; rebuild the engine with a wider --profile ({', '.join(f'{d}:MIN,OPT,MAX' for d in dyn)})"
                    if dyn else "")
            raise InputError(f"input {name!r} shape {list(shape)} is outside the engine's profile: "
                             f"{'; '.join(outside)}{hint}")

    def describe(self) -> str:
        return ", ".join(f"{r.name}:{r.min},{r.opt},{r.max}" for r in self.dims.values()) or "static shapes"


def _dim_label(dim: int | str, axis: int) -> str:
    return dim if isinstance(dim, str) else f"axis {axis}"


def _shape_text(dims: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def model_input_dims(model: onnx.ModelProto) -> dict[str, tuple[int | str, ...]]:
    """Each graph input (initializers excluded) with its dims: ints, or names for dynamic dims."""
    initializers = {init.name for init in model.graph.initializer}
    result: dict[str, tuple[int | str, ...]] = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        ttype = vi.type.tensor_type
        if not ttype.HasField("shape"):
            raise UserError(f"input {vi.name!r} has no shape in the model, so no TensorRT profile can be made for it; "
                            "export the model with input shapes (dynamic dims named)")
        dims: list[int | str] = []
        for axis, dim in enumerate(ttype.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                dims.append(int(dim.dim_value))
            elif dim.HasField("dim_param") and dim.dim_param:
                dims.append(dim.dim_param)
            else:
                dims.append(f"{vi.name}.{axis}")
        result[vi.name] = tuple(dims)
    return result


def parse_profile_arg(text: str) -> tuple[str, tuple[int, int, int]]:
    """``"d0:1,64,256"`` -> ``("d0", (1, 64, 256))``; a one-line error for anything else."""
    match = _PROFILE_RE.match(text)
    if not match:
        raise UserError(f"--profile {text!r} is not NAME:MIN,OPT,MAX (for example d0:1,64,256)")
    name = match.group(1)
    lo, opt, hi = (int(match.group(i)) for i in (2, 3, 4))
    return name, (lo, opt, hi)


def _overrides(profiles: Mapping[str, Sequence[int]] | Iterable[str] | None) -> dict[str, tuple[int, int, int]]:
    if profiles is None:
        return {}
    if isinstance(profiles, Mapping):
        items = []
        for name, values in profiles.items():
            values = tuple(values)
            if len(values) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise UserError(f"profile {name!r}: give three integers (min, opt, max), got {list(values)}")
            items.append((str(name), values))
    else:
        if isinstance(profiles, str):
            profiles = [profiles]
        items = [parse_profile_arg(p) for p in profiles]
    result: dict[str, tuple[int, int, int]] = {}
    for name, values in items:
        if name in result:
            raise UserError(f"--profile {name} is given twice; give each dynamic dim once")
        result[name] = values  # type: ignore[assignment]
    return result


def resolve_profiles(
    model: onnx.ModelProto,
    profiles: Mapping[str, Sequence[int]] | Iterable[str] | None = None,
    metadata_dims: Mapping[str, Sequence[int]] | None = None,
) -> Profiles:
    """The optimization profile of ``model``: ranges from ``profiles``, then from ``metadata_dims``.

    Raises :class:`UserError` for a range given for a dim the model does not have, a range
    that is not ``1 <= min <= opt <= max``, and a dynamic dim left without a range.
    """
    inputs = model_input_dims(model)
    where: dict[str, list[str]] = {}
    for name, dims in inputs.items():
        for axis, dim in enumerate(dims):
            if isinstance(dim, str):
                where.setdefault(dim, []).append(f"{name} axis {axis}")
    overrides = _overrides(profiles)
    for name in overrides:
        if name not in where:
            known = ", ".join(f"{d} ({'; '.join(w)})" for d, w in where.items()) or "none (all input shapes are static)"
            hint = f"; {name!r} is an input: profiles are given per dynamic dim" if name in inputs else ""
            raise UserError(f"--profile {name}: the model has no dynamic dim {name!r}{hint}; its dynamic dims: {known}")
    metadata_dims = metadata_dims or {}
    ranges: dict[str, DimRange] = {}
    for dim, places in where.items():
        if dim in overrides:
            lo, opt, hi = overrides[dim]
            source = "--profile"
        elif dim in metadata_dims and len(metadata_dims[dim]) == 3:
            lo, opt, hi = (int(v) for v in metadata_dims[dim])
            source = "model metadata"
        else:
            raise UserError(
                f"dynamic dim {dim!r} ({'; '.join(places)}) has no range: the model's metadata gives none; "
                f"pass --profile {dim}:MIN,OPT,MAX"
            )
        if not 1 <= lo <= opt <= hi:
            raise UserError(f"profile of {dim!r} from {source}: need 1 <= min <= opt <= max, got {lo},{opt},{hi}")
        ranges[dim] = DimRange(dim, lo, opt, hi, source)
    shaped = {}
    for name, dims in inputs.items():
        pick = lambda attr: tuple(getattr(ranges[d], attr) if isinstance(d, str) else d for d in dims)  # noqa: E731
        shaped[name] = InputProfile(name, dims, pick("min"), pick("opt"), pick("max"))
    return Profiles(ranges, shaped)
