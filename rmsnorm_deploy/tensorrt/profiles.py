"""TensorRT optimization profiles from a model's dynamic axes.

A profile is given per *dynamic dim*, not per input: ``d0:1,64,256`` sets the range of the dim
named ``d0`` wherever it appears, so inputs that share a dim (batch, sequence) always get
consistent shapes. Named dims keep their ONNX ``dim_param``; an unnamed dynamic dim is called
``<input>.<axis>`` (e.g. ``x.0``). Ranges come from ``--profile`` first, then from the export
metadata (``ModelMetadata.dims``); a dynamic dim with neither is an error that says what to pass.

A KV-cache graph (``export --kv-cache``, metadata ``kv_cache``) gets two profiles
(:func:`kv_cache_profiles`), because one range cannot hold both of its phases well: **prefill**
(``past`` 0, ``sequence`` 1..max) and **decode** (``sequence`` 1, ``past`` 1..max - 1); the
attention mask's ``total`` follows as ``past + sequence``. ``batch`` and the maximum length come
from ``--profile batch:...`` / ``--profile sequence:...``, then from the metadata.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping, Sequence

import onnx

from rmsnorm_deploy.decoder.convention import BATCH, PAST, SEQUENCE, TOTAL, layout_of
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
    name: str = ""  # "prefill" / "decode" for a KV-cache engine's two profiles

    def to_dict(self) -> dict[str, Any]:
        return {
            **({"name": self.name} if self.name else {}),
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
        return cls(dims, inputs, str(data.get("name", "")))

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
        result[name] = values
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


# -- KV-cache graphs: a prefill and a decode profile --------------------------------------------
#: The sidecar key holding several profiles (a KV-cache engine's prefill and decode).
PROFILE_SET = "profile_set"


def profiles_to_dict(profiles: Sequence[Profiles]) -> dict[str, Any]:
    """One profile as before; several as ``{"profile_set": [...]}`` (in the engine's profile order)."""
    if len(profiles) == 1:
        return profiles[0].to_dict()
    return {PROFILE_SET: [p.to_dict() for p in profiles]}


def profiles_from_dict(data: Mapping[str, Any]) -> list[Profiles]:
    if isinstance(data.get(PROFILE_SET), list):
        return [Profiles.from_dict(p) for p in data[PROFILE_SET]]
    return [Profiles.from_dict(data)]


def kv_cache_profiles(
    model: onnx.ModelProto,
    layout: Any,
    profiles: Mapping[str, Sequence[int]] | Iterable[str] | None = None,
    metadata_dims: Mapping[str, Sequence[int]] | None = None,
) -> list[Profiles]:
    """The prefill and decode profiles of a KV-cache graph (``decoder.convention.KVCacheLayout``).

    ``--profile`` may give ``batch`` and ``sequence`` (its max is the longest past + sequence);
    ``past`` and ``total`` follow from them and cannot be given.
    """

    inputs = model_input_dims(model)
    dynamic = {d for dims in inputs.values() for d in dims if isinstance(d, str)}
    unknown = sorted(dynamic - {BATCH, SEQUENCE, PAST, TOTAL})
    if unknown:
        raise UserError(f"the KV-cache graph has dynamic dims {unknown} besides {BATCH}, {SEQUENCE}, {PAST}, "
                        f"{TOTAL}; export it again with `export --kv-cache`")
    overrides = _overrides(profiles)
    fixed = sorted(set(overrides) - {BATCH, SEQUENCE})
    if fixed:
        raise UserError(f"--profile {fixed[0]}: a KV-cache engine's {PAST} and {TOTAL} follow from {BATCH} and "
                        f"{SEQUENCE} (prefill: past 0; decode: sequence 1); give only --profile {BATCH}:... and "
                        f"--profile {SEQUENCE}:MIN,OPT,MAX")
    metadata_dims = metadata_dims or {}

    def pick(name: str, default: Sequence[int]) -> tuple[tuple[int, int, int], str]:
        if name in overrides:
            return overrides[name], "--profile"
        values = metadata_dims.get(name)
        if isinstance(values, (list, tuple)) and len(values) == 3 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in values):
            return (int(values[0]), int(values[1]), int(values[2])), "model metadata"
        return tuple(default), "default"  # type: ignore[return-value]

    batch, batch_src = pick(BATCH, (1, 1, 8))
    seq, seq_src = pick(SEQUENCE, (1, min(128, layout.max_length), layout.max_length))
    for dim, (lo, opt, hi), src in ((BATCH, batch, batch_src), (SEQUENCE, seq, seq_src)):
        if not 1 <= lo <= opt <= hi:
            raise UserError(f"profile of {dim!r} from {src}: need 1 <= min <= opt <= max, got {lo},{opt},{hi}")
    longest = seq[2]
    if longest > layout.max_length:
        raise UserError(f"profile of {SEQUENCE!r}: max {longest} exceeds the model's {layout.max_length} positions")
    if longest < 2:
        raise UserError(f"profile of {SEQUENCE!r}: max must be at least 2 (a prompt and one new token), got {longest}")
    opt_past = max(1, min(seq[1], longest - 1))
    phases = {
        "prefill": {BATCH: (batch, batch_src), SEQUENCE: (seq, seq_src), PAST: ((0, 0, 0), "prefill"),
                    TOTAL: (seq, "past + sequence")},
        "decode": {BATCH: (batch, batch_src), SEQUENCE: ((1, 1, 1), "decode"),
                   PAST: ((1, opt_past, longest - 1), "decode"), TOTAL: ((2, opt_past + 1, longest), "past + sequence")},
    }
    result = []
    for phase, ranges in phases.items():
        dims = {d: DimRange(d, *ranges[d][0], source=ranges[d][1]) for d in (BATCH, SEQUENCE, PAST, TOTAL)
                if d in dynamic}
        shaped = {}
        for name, shape in inputs.items():
            sel = lambda i: tuple(dims[d].as_list()[i] if isinstance(d, str) else d for d in shape)  # noqa: E731
            shaped[name] = InputProfile(name, shape, sel(0), sel(1), sel(2))
        result.append(Profiles(dims, shaped, phase))
    return result


def engine_profiles(model: onnx.ModelProto, meta: Any,
                    profiles: Mapping[str, Sequence[int]] | Iterable[str] | None = None) -> list[Profiles]:
    """The optimization profiles ``build`` gives TensorRT: prefill and decode for a KV-cache graph
    (its metadata says so), else the one profile of :func:`resolve_profiles`."""
    dims = meta.dims if meta is not None else None
    if meta is not None and getattr(meta, "kv_cache", None):

        return kv_cache_profiles(model, layout_of(meta), profiles, dims)
    return [resolve_profiles(model, profiles, dims)]
