"""Nodes and initializers of a graph written node by node; its weights kept in memory or streamed to a file.

:class:`GraphWriter` names nodes and tensors uniquely and hands every initializer to a sink:

- :class:`InMemory`: the weights go into the ``ModelProto`` (a graph to run from memory, as the
  tests do);
- :class:`ExternalData`: each weight is appended to an external-data file as soon as it is
  made, aligned to 4 KiB, and the graph keeps only its location, offset and length. A weight
  given in blocks of rows (an 8B model's embedding, its LM head) is written block by block and
  never held whole. Tensors under 1 KiB stay in the graph (the shapes and constants the audit
  reads), as ``onnx.save_model``'s own threshold keeps them.

Both sinks give the same graph once the external data is loaded: the same names, in the same
order, with the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from rmsnorm_deploy.contract.dtypes import numpy_dtype

#: Tensors smaller than this stay in the graph.
INLINE_BYTES = 1024
#: Offsets of external tensors are multiples of this (a page: ONNX Runtime may map them).
ALIGNMENT = 4096


class InMemory:
    """Initializers kept in the graph."""

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        return numpy_helper.from_array(np.ascontiguousarray(array), name)

    def add_blocks(self, name: str, shape: tuple[int, ...], dtype: np.dtype, blocks: Iterable[np.ndarray]) -> TensorProto:
        array = np.concatenate([np.ascontiguousarray(b, dtype=dtype) for b in blocks], axis=0)
        return self.add(name, array.reshape(shape))

    def close(self) -> None:
        pass


class ExternalData:
    """Initializers appended to ``path`` as they are made; the graph names the file ``location``."""

    def __init__(self, path: str | os.PathLike, location: str | None = None):
        self.path = Path(path)
        self.location = location or self.path.name
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self.offset = 0

    def _align(self) -> None:
        pad = -self.offset % ALIGNMENT
        if pad:
            self._file.write(b"\0" * pad)
            self.offset += pad

    def _tensor(self, name: str, shape: tuple[int, ...], dtype: np.dtype, offset: int, length: int) -> TensorProto:
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
        return tensor

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        array = np.ascontiguousarray(array)
        if array.nbytes < INLINE_BYTES:
            return numpy_helper.from_array(array, name)
        return self.add_blocks(name, array.shape, array.dtype, [array])

    def add_blocks(self, name: str, shape: tuple[int, ...], dtype: np.dtype, blocks: Iterable[np.ndarray]) -> TensorProto:
        """``shape`` written from ``blocks`` of its first dim, in order; each block written and dropped."""
        self._align()
        start = self.offset
        for block in blocks:
            data = np.ascontiguousarray(block, dtype=dtype)
            self._file.write(memoryview(data).cast("B"))
            self.offset += data.nbytes
        length = self.offset - start
        expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if length != expected:
            raise ValueError(f"{name}: {length} bytes written for a {list(shape)} {np.dtype(dtype)} tensor ({expected})")
        return self._tensor(name, tuple(shape), dtype, start, length)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class GraphWriter:
    """Nodes and initializers with unique names; float weights cast to the graph's dtype."""

    def __init__(self, dtype: str, sink: InMemory | ExternalData | None = None):
        self.dtype = dtype
        self.np_dtype = numpy_dtype(dtype)
        self.torch_dtype = torch.float32 if dtype == "float32" else torch.float16
        self.sink = sink or InMemory()
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self._names: set[str] = set()

    def name(self, base: str) -> str:
        name, i = base, 1
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def node(self, op: str, inputs: list[str], base: str, *, outputs: int = 1, domain: str = "", **attrs: Any) -> list[str]:
        outs = [self.name(f"{base}/out{i}" if outputs > 1 else base) for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.name(f"{base}/{op}"), domain=domain or None,
                                           **attrs))
        return outs

    def one(self, op: str, inputs: list[str], base: str, **attrs: Any) -> str:
        return self.node(op, inputs, base, **attrs)[0]

    def init(self, name: str, array: np.ndarray) -> str:
        name = self.name(name)
        self.inits.append(self.sink.add(name, array))
        return name

    def blocks(self, name: str, shape: tuple[int, ...], dtype: Any, blocks: Iterable[np.ndarray]) -> str:
        """An initializer written from blocks of its first dim (see :class:`ExternalData`)."""
        name = self.name(name)
        self.inits.append(self.sink.add_blocks(name, tuple(shape), np.dtype(dtype), blocks))
        return name

    def cast(self, tensor: torch.Tensor) -> np.ndarray:
        """A float tensor (any stored dtype) as a numpy array of the graph's dtype."""
        return tensor.detach().to(self.torch_dtype).cpu().numpy()

    def cast_transposed(self, tensor: torch.Tensor) -> np.ndarray:
        """A 2-D float tensor's transpose, contiguous, in the graph's dtype (torch transposes a
        [14336, 4096] block 4x faster than numpy)."""
        return tensor.detach().t().contiguous().to(self.torch_dtype).cpu().numpy()

    def weight(self, name: str, tensor: torch.Tensor) -> str:
        return self.init(name, self.cast(tensor))
