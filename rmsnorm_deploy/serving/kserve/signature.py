"""What a server needs to know about a model: its tensors, its batch dimension, its kind.

Read from the ONNX graph itself (names, element types, dynamic dims), never from a second
description, so the server's config and the model cannot disagree. Our metadata adds the
range of the batch dim (``dims["batch"]``) where the model has it.

The batch dimension is the leading dim when every input and every output starts with the same
dynamic dim (``batch`` in our exports): Triton then owns it (``max_batch_size > 0``, the dims
in the config leave it out) and its dynamic batcher may stack requests along it. A graph
without one is served unbatched, with its full shapes.

A KV-cache graph (inputs ``past_key_values.{i}.key/value``, outputs ``present.{i}.key/value``,
the convention optimum and onnxruntime-genai read) is stateful: each step's ``present`` is the
next step's ``past``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from rmsnorm_deploy.errors import ModelFileError, UserError
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_file import load_onnx

#: ONNX element type -> (numpy dtype name, Triton config type, KServe v2 datatype)
_TYPES: dict[int, tuple[str, str, str]] = {
    onnx.TensorProto.FLOAT: ("float32", "TYPE_FP32", "FP32"),
    onnx.TensorProto.FLOAT16: ("float16", "TYPE_FP16", "FP16"),
    onnx.TensorProto.BFLOAT16: ("bfloat16", "TYPE_BF16", "BF16"),
    onnx.TensorProto.DOUBLE: ("float64", "TYPE_FP64", "FP64"),
    onnx.TensorProto.INT64: ("int64", "TYPE_INT64", "INT64"),
    onnx.TensorProto.INT32: ("int32", "TYPE_INT32", "INT32"),
    onnx.TensorProto.INT8: ("int8", "TYPE_INT8", "INT8"),
    onnx.TensorProto.UINT8: ("uint8", "TYPE_UINT8", "UINT8"),
    onnx.TensorProto.BOOL: ("bool", "TYPE_BOOL", "BOOL"),
}
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output: its name, dtype and shape (ints, or dim names for dynamic dims)."""

    name: str
    dtype: str  # numpy name: float32, int64, ...
    shape: tuple[int | str, ...]

    @property
    def triton_type(self) -> str:
        return next(t for d, t, _ in _TYPES.values() if d == self.dtype)

    @property
    def kserve_type(self) -> str:
        return next(k for d, _, k in _TYPES.values() if d == self.dtype)

    def dims(self, *, batched: bool) -> list[int]:
        """The shape as Triton's config writes it: dynamic dims as -1, without the batch dim if batched."""
        dims = [d if isinstance(d, int) else -1 for d in self.shape]
        return dims[1:] if batched else dims


@dataclasses.dataclass(frozen=True)
class Signature:
    """A model's inputs and outputs, its batch dim (or none) and whether it carries a KV cache."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_dim: str | None
    max_batch: int
    #: ``[(past input, present output)]`` pairs of a KV-cache graph, in layer order; empty otherwise
    cache: tuple[tuple[str, str], ...] = ()
    #: ``{dim name: (min, max)}``: the range each dynamic dim has in the model's metadata (``dims``)
    ranges: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def batched(self) -> bool:
        return self.batch_dim is not None

    @property
    def is_kv_cache(self) -> bool:
        return bool(self.cache)

    def stateless_inputs(self) -> tuple[TensorSpec, ...]:
        past = {p for p, _ in self.cache}
        return tuple(t for t in self.inputs if t.name not in past)

    def stateless_outputs(self) -> tuple[TensorSpec, ...]:
        present = {p for _, p in self.cache}
        return tuple(t for t in self.outputs if t.name not in present)

    def tensor(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs + self.outputs if t.name == name)


#: Default largest batch when the model's metadata does not give one.
DEFAULT_MAX_BATCH = 8


def model_path(path: str | os.PathLike) -> Path:
    """An exported ``model.onnx`` or the folder that holds it (``export/…/``)."""
    p = Path(path)
    if p.is_dir():
        candidate = p / "model.onnx"
        if not candidate.is_file():
            found = sorted(q.name for q in p.glob("*.onnx"))
            raise ModelFileError(f"{p}: no model.onnx in this folder" + (f" (it has {', '.join(found)}; give the file)"
                                 if found else "; give an exported model folder or .onnx file"))
        return candidate
    if not p.exists():
        raise ModelFileError(f"{p}: no such file or folder; give an exported model folder or its model.onnx")
    return p


def read_signature(path: str | os.PathLike, *, max_batch: int | None = None) -> Signature:
    """The signature of the ONNX file (or export folder) at ``path``; external data is not loaded."""

    path = model_path(path)
    model = load_onnx(path, load_external=False)
    meta = ModelMetadata.read(model)
    return signature_of(model, dims=meta.dims if meta else {}, max_batch=max_batch, where=str(path))


def signature_of(model: onnx.ModelProto, *, dims: dict[str, Any] | None = None, max_batch: int | None = None,
                 where: str = "the model") -> Signature:
    initializers = {i.name for i in model.graph.initializer}
    inputs = tuple(_tensor(v, where) for v in model.graph.input if v.name not in initializers)
    outputs = tuple(_tensor(v, where) for v in model.graph.output)
    if not inputs or not outputs:
        raise ModelFileError(f"{where}: the graph has no {'inputs' if not inputs else 'outputs'} to serve")
    leading = {t.shape[0] if t.shape else None for t in inputs + outputs}
    batch_dim = next(iter(leading)) if len(leading) == 1 and isinstance(next(iter(leading)), str) else None
    if max_batch is not None and max_batch < 0:
        raise UserError(f"--max-batch {max_batch}: give 0 (no batching) or a positive number of rows")
    if max_batch == 0:
        batch_dim = None
    elif max_batch is not None and batch_dim is None:
        raise UserError(f"{where}: --max-batch {max_batch} needs a leading dynamic batch dim shared by every input "
                        f"and output, and this graph has none ({_shapes(inputs + outputs)}); use --max-batch 0")
    limit = 0
    if batch_dim is not None:
        limit = max_batch or _metadata_max(dims or {}, batch_dim) or DEFAULT_MAX_BATCH
    ranges = {name: (int(r[0]), int(r[2])) for name, r in (dims or {}).items() if _metadata_max(dims or {}, name)}
    return Signature(inputs, outputs, batch_dim, limit, _cache_pairs(inputs, outputs, where), ranges)


def _tensor(value: onnx.ValueInfoProto, where: str) -> TensorSpec:
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        raise ModelFileError(f"{where}: {value.name!r} is a {kind or 'typeless value'}, not a tensor; only tensors "
                             "can be served")
    elem = value.type.tensor_type.elem_type
    if elem not in _TYPES:
        raise ModelFileError(f"{where}: {value.name!r} has ONNX element type "
                             f"{onnx.TensorProto.DataType.Name(elem) if elem else 'unset'}, which this server does "
                             f"not map; supported: {', '.join(d for d, _, _ in _TYPES.values())}")
    if not value.type.tensor_type.HasField("shape"):
        raise ModelFileError(f"{where}: {value.name!r} has no shape (not even its rank); export it with shapes")
    shape: list[int | str] = []
    for i, d in enumerate(value.type.tensor_type.shape.dim):
        if d.HasField("dim_value"):
            shape.append(int(d.dim_value))
        else:
            shape.append(d.dim_param or f"{value.name}.{i}")
    return TensorSpec(value.name, _TYPES[elem][0], tuple(shape))


def numpy_dtype_of_kserve(datatype: str) -> np.dtype | None:
    """The numpy dtype of a KServe v2 datatype (``INT64`` -> int64), ``None`` for one no model here has."""
    for numpy_name, _, kserve in _TYPES.values():
        if kserve == datatype:
            return None if numpy_name == "bfloat16" else np.dtype(numpy_name)
    return None


def _metadata_max(dims: dict[str, Any], name: str) -> int:
    entry = dims.get(name)
    if isinstance(entry, list) and len(entry) == 3 and all(isinstance(v, int) for v in entry) and entry[2] >= 1:
        return int(entry[2])
    return 0


def _cache_pairs(inputs, outputs, where: str) -> tuple[tuple[str, str], ...]:
    past = {(int(m[1]), m[2]): t.name for t in inputs if (m := _PAST.match(t.name))}
    present = {(int(m[1]), m[2]): t.name for t in outputs if (m := _PRESENT.match(t.name))}
    if not past and not present:
        return ()
    if set(past) != set(present):
        raise ModelFileError(f"{where}: KV-cache inputs and outputs do not pair up: past without present "
                             f"{sorted(past.keys() - present.keys())}, present without past "
                             f"{sorted(present.keys() - past.keys())}")
    return tuple((past[k], present[k]) for k in sorted(past))


def _shapes(tensors) -> str:
    return ", ".join(f"{t.name} {list(t.shape)}" for t in tensors)
