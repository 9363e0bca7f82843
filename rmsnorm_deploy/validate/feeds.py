"""Inputs for ``validate``: generated from the metadata or the graph's declared inputs, or read
from an ``.npz`` file, and checked against the graph."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import onnx

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.contract.inputs import INPUT_KINDS, activations, gain_weights, token_ids
from rmsnorm_deploy.errors import InputError, ModelFileError, UserError
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.resources import check_memory

#: size given to a dynamic dim that neither the metadata nor ``--dim`` sizes: odd, and > 2 so that
#: stress inputs get their all-zero row
DEFAULT_DYNAMIC_DIM = 3
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_ELEM_NAMES = {
    onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32", onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8",
}


@dataclasses.dataclass
class InputDecl:
    """A graph input: dtype name and dims (ints, dim names, or ``None`` for unnamed dynamic dims)."""

    name: str
    dtype: str
    dims: list[int | str | None]


def graph_inputs(model: onnx.ModelProto) -> list[InputDecl]:
    initializers = {i.name for i in model.graph.initializer}
    decls = []
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        tensor_type = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise InputError(f"input {vi.name!r} is not a tensor; validate feeds tensors only")
        dims: list[int | str | None] = []
        for d in tensor_type.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
        decls.append(InputDecl(vi.name, elem_dtype(tensor_type.elem_type), dims))
    return decls


def elem_dtype(elem: int) -> str:
    if elem in _ELEM_NAMES:
        return _ELEM_NAMES[elem]
    try:
        return dtype_name(elem)
    except UserError:
        return onnx.TensorProto.DataType.Name(elem).lower()


def parse_dims(items: Iterable[str]) -> dict[str, int]:
    """``["batch=2", "seq=7"]`` -> ``{"batch": 2, "seq": 7}``."""
    dims = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise UserError(f"--dim {item!r} is not NAME=SIZE with SIZE >= 1, e.g. --dim batch=2")
        dims[name.strip()] = int(value)
    return dims


def _resolve_shape(decl: InputDecl, sizes: dict[str, int]) -> list[int]:
    return [d if isinstance(d, int) else sizes.get(d or "", DEFAULT_DYNAMIC_DIM) for d in decl.dims]


def generate_feed(
    model: onnx.ModelProto,
    meta: ModelMetadata | None,
    *,
    kind: str = "normal",
    seed: int = 0,
    dims: dict[str, int] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]], list[str]]:
    """Seeded inputs for every graph input, the description of each, and notes."""
    if kind not in INPUT_KINDS:
        raise UserError(f"unknown input kind {kind!r}; choose from {', '.join(INPUT_KINDS)}")
    decls = graph_inputs(model)
    dims = dict(dims or {})
    known_dims = {d for decl in decls for d in decl.dims if isinstance(d, str)}
    unknown = sorted(set(dims) - known_dims)
    if unknown:
        raise UserError(f"--dim {', '.join(unknown)}: no such dynamic dim; the model's are "
                        f"{', '.join(sorted(known_dims)) or 'none (all dims are fixed)'}")
    notes: list[str] = []
    sizes = {name: int(rng[1]) for name, rng in (meta.dims.items() if meta else []) if len(rng) == 3}
    sizes.update(dims)
    unsized = sorted(d for d in known_dims if d not in sizes)
    if unsized or any(d is None for decl in decls for d in decl.dims):
        notes.append(f"dynamic dims without a size ({', '.join(unsized) or 'unnamed'}) were given "
                     f"{DEFAULT_DYNAMIC_DIM}; set them with --dim NAME=SIZE")
    _check_feed_size([_resolve_shape(decl, sizes) for decl in decls])
    feed, described = {}, {}
    gather_sizes = _gather_index_bounds(model)
    for i, decl in enumerate(decls):
        shape = _resolve_shape(decl, sizes)
        info = (meta.inputs.get(decl.name) if meta else None) or {}
        input_kind = info.get("kind") or _guess_kind(decl)
        input_kind = _KIND_ALIASES.get(input_kind, input_kind)
        if input_kind == "activations":
            array = activations(shape, decl.dtype, seed=seed + i, kind=kind)
        elif input_kind == "weight":
            array = gain_weights(shape, decl.dtype, info.get("gain", "weight"), seed=seed + 1 + i)
            if array is None:
                raise ModelFileError(f"input {decl.name!r} is a weight of gain 'none'; the metadata is inconsistent")
        elif input_kind == "token_ids":
            high = int(info.get("high") or gather_sizes.get(decl.name, 2))
            array = token_ids(shape, high, seed=seed + i).astype(np.dtype(decl.dtype))
        elif input_kind == "mask":
            array = np.ones(shape, dtype=np.dtype(decl.dtype))
        elif input_kind == "positions":
            array = np.broadcast_to(np.arange(shape[-1] if shape else 1), shape).astype(np.dtype(decl.dtype))
        else:
            array = np.zeros(shape, dtype=np.dtype(decl.dtype))
        feed[decl.name] = np.ascontiguousarray(array)
        described[decl.name] = {"dtype": decl.dtype, "shape": shape, "kind": input_kind if input_kind != "activations"
                                else f"activations, {kind}"}
    if kind == "stress" and not any(v["kind"].startswith("activations") for v in described.values()):
        notes.append("--inputs stress has no effect: the model has no floating activation input")
    return feed, described, notes


#: bytes per generated value a validation holds at once: the float64 draw, the typed input, each
#: backend's output and the reference's
_BYTES_PER_VALUE = 32


def _check_feed_size(shapes: list[list[int]]) -> None:
    """The inputs about to be generated against the memory budget, before any is allocated."""

    values = sum(math.prod(shape) for shape in shapes)
    check_memory(values * _BYTES_PER_VALUE, f"generating inputs of shapes {shapes} ({values:,} values)",
                 "give smaller sizes of the dynamic dims with --dim NAME=SIZE, or inputs with --feed")


def token_bounds(model: onnx.ModelProto, meta: ModelMetadata | None) -> dict[str, int]:
    """The exclusive upper bound of each token-id input: the metadata's ``high``, else the size of
    the embedding table the graph gathers from."""
    bounds = _gather_index_bounds(model)
    for name, info in (meta.inputs.items() if meta else []):
        if info.get("kind") == "token_ids" and info.get("high"):
            bounds[name] = int(info["high"])
    return bounds


#: Kinds written under other names by earlier ``--target onnxruntime`` exports.
_KIND_ALIASES = {"attention_mask": "mask", "position_ids": "positions"}


def _guess_kind(decl: InputDecl) -> str:
    """A third-party input's role, from its dtype and name."""
    if decl.dtype in FLOAT_DTYPES:
        return "activations"
    lowered = decl.name.lower()
    if decl.dtype == "bool" or "mask" in lowered:
        return "mask"
    if "position" in lowered:
        return "positions"
    if decl.dtype in ("int64", "int32"):
        return "token_ids"
    return "zeros"


def _gather_index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For graph inputs used as Gather indices into an initializer (embeddings): the table's size."""
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    bounds: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[0] in shapes:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = shapes[node.input[0]]
            if dims:
                bounds[node.input[1]] = int(dims[axis])
    return bounds


def load_feed(path: str | Path, model: onnx.ModelProto,
              meta: ModelMetadata | None = None) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    """Inputs from an ``.npz`` file, checked against the graph's inputs."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such file; give an .npz file with one array per model input")
    try:
        with np.load(p, allow_pickle=False) as data:
            feed = {k: np.ascontiguousarray(data[k]) for k in data.files}
    except Exception as exc:
        raise InputError(f"{p}: not a readable .npz file ({type(exc).__name__}: {exc})") from None
    check_feed(feed, model, meta)
    return feed, {k: {"dtype": array_dtype(v), "shape": list(v.shape), "kind": f"from {p.name}"} for k, v in feed.items()}


def array_dtype(array: np.ndarray) -> str:
    try:
        return dtype_name(array.dtype)
    except UserError:
        return str(array.dtype)


def check_feed(feed: dict[str, np.ndarray], model: onnx.ModelProto, meta: ModelMetadata | None = None) -> None:
    """Names, dtypes, ranks and fixed dims of ``feed`` against the graph, and token ids inside the
    embedding table (:func:`token_bounds`); one-line errors."""
    decls = {d.name: d for d in graph_inputs(model)}
    missing, unexpected = sorted(set(decls) - set(feed)), sorted(set(feed) - set(decls))
    if missing or unexpected:
        raise InputError(f"inputs do not match the model: missing {missing}, unexpected {unexpected}; "
                         f"the model takes {sorted(decls)}")
    seen: dict[str, tuple[str, int]] = {}
    for name, array in feed.items():
        decl = decls[name]
        got = array_dtype(array)
        if got != decl.dtype:
            raise InputError(f"input {name!r} is {got} but the model wants {decl.dtype}; convert it first")
        want = ["?" if d is None else d for d in decl.dims]
        if array.ndim != len(decl.dims) or any(isinstance(d, int) and d != s for d, s in zip(decl.dims, array.shape)):
            raise InputError(f"input {name!r} has shape {list(array.shape)} but the model wants {want}")
        for d, size in zip(decl.dims, array.shape):
            if isinstance(d, str):
                if d in seen and seen[d][1] != size:
                    raise InputError(f"dim {d!r} is {seen[d][1]} in input {seen[d][0]!r} but {size} in {name!r}")
                seen[d] = (name, size)
    check_token_ids(feed, token_bounds(model, meta))


def check_token_ids(feed: dict[str, np.ndarray], bounds: dict[str, int]) -> None:
    """Token ids inside ``[0, bound)`` for each input in ``bounds`` (:func:`token_bounds`): a
    ``Gather`` would read past the table's end, or wrap a negative id round to it; one-line error."""
    for name, high in bounds.items():
        array = feed.get(name)
        if array is None or array.size == 0 or array.dtype.kind not in "iu":
            continue
        low_id, high_id = int(array.min()), int(array.max())
        if low_id < 0 or high_id >= high:
            raise InputError(f"input {name!r} holds token ids from {low_id} to {high_id}, outside the embedding "
                             f"table's [0, {high}); give ids in that range")
