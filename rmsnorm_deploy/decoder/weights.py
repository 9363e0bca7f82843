"""Where the decoder graph writer reads its weights from: a module tree, or safetensors files.

The writer asks for one tensor at a time by its state-dict name (``model.layers.0.mlp.up_proj.weight``),
or for a block of its rows or columns, so that a tensor larger than memory never has to be
whole: the embedding and the LM head of an 8B model (128256 x 4096) are written in row or column
blocks. Two sources answer:

- :class:`ModuleTensors`: the parameters of a model in memory (the tests' models, a preset);
- :class:`SafetensorsTensors`: a Hugging Face folder's ``*.safetensors`` files, sharded or not,
  bfloat16, float16 or float32. Each read opens the file, maps it, copies the block asked for
  and closes it again, so a mapped 5 GB shard never stays resident in the process.

Every tensor is checked against the shape the module tree expects (the checkpoint is untrusted
input): a missing tensor, another shape or a non-float dtype is a one-line error naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import torch

from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.exporter import hf
from rmsnorm_deploy.optional import require

#: The dtypes a checkpoint's weights may be stored in (safetensors' names).
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class CheckpointError(UserError):
    """A checkpoint whose tensors do not match the model its config describes."""


class TensorSource(Protocol):
    """Tensors by state-dict name, whole or a block of rows or columns, in their stored dtype."""

    def get(self, name: str) -> torch.Tensor: ...

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def columns(self, name: str, start: int, stop: int) -> torch.Tensor: ...


def parameter_names(lm: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> state-dict name`` of every parameter of ``lm``; a tied parameter by the
    first name it has (the embedding's, as a checkpoint with tied embeddings stores it)."""
    return {id(p): name for name, p in lm.named_parameters()}


class ModuleTensors:
    """The parameters of a module tree in memory."""

    def __init__(self, lm: torch.nn.Module):
        self._tensors = dict(lm.named_parameters())

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name].detach()
        except KeyError:
            raise CheckpointError(f"the model has no parameter {name!r}") from None

    def get(self, name: str) -> torch.Tensor:
        return self._tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._tensor(name)[start:stop]

    def columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._tensor(name)[:, start:stop]


class SafetensorsTensors:
    """The tensors of a folder's ``*.safetensors`` files, read block by block through a memory map."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._safe_open = require("safetensors", "reading a checkpoint tensor by tensor").safe_open
        self.files = self._index()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in sorted(set(self.files.values())):
            self._read_header(file)

    def _index(self) -> dict[str, Path]:
        """``name -> file`` from the headers of the folder's weight files: those of its shard index, or
        every ``*.safetensors`` (``exporter.hf.weight_files``: each resolved inside the folder)."""
        return {name: file for file in hf.weight_files(self.folder) for name in self._keys(file)}

    def _keys(self, file: Path) -> list[str]:
        with self._open(file) as f:
            return list(f.keys())

    def _open(self, file: Path):
        try:
            return self._safe_open(str(file), framework="pt")
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
            raise CheckpointError(f"{file}: not a readable safetensors file ({one_line(exc)})") from None

    def _read_header(self, file: Path) -> None:
        names = [n for n, f in self.files.items() if f == file]
        with self._open(file) as f:
            for name in names:
                piece = f.get_slice(name)
                self.shapes[name] = tuple(int(d) for d in piece.get_shape())
                self.dtypes[name] = str(piece.get_dtype())

    def check(self, name: str, shape: tuple[int, ...], what: str) -> None:
        """That ``name`` is stored with ``shape`` in a float dtype, or a one-line error naming it."""
        if name not in self.files:
            raise CheckpointError(f"{self.folder}: the checkpoint has no tensor {name!r} ({what}); is it complete?")
        if self.shapes[name] != tuple(shape):
            raise CheckpointError(f"{self.files[name]}: tensor {name!r} has shape {list(self.shapes[name])}; the "
                                  f"config makes {what} {list(shape)}")
        if self.dtypes[name] not in FLOAT_DTYPES:
            raise CheckpointError(f"{self.files[name]}: tensor {name!r} is stored as {self.dtypes[name]}; weights are "
                                  f"read from {', '.join(FLOAT_DTYPES)} checkpoints (a quantized checkpoint is not)")

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        with self._open(self.files[name]) as f:
            piece = f.get_slice(name)
            return piece[index] if index else f.get_tensor(name)

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, ())

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, (slice(start, stop),))

    def columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, (slice(None), slice(start, stop)))
