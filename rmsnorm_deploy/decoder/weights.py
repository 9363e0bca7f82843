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

Mixture-of-experts checkpoints of Qwen3-MoE and Mixtral store each expert's projections apart
(``mlp.experts.{e}.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.w1.weight``), and
transformers 5 still saves them so; its module tree holds them fused (``mlp.experts.gate_up_proj``
[experts, 2I, hidden], ``down_proj``), as it merges them on load. Given the family's names
(``MoEFamily.checkpoint_experts``), :class:`SafetensorsTensors` answers the fused names the same
way, one expert (a block of rows of the fused tensor) at a time.
"""

from __future__ import annotations

import os
import re
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

    def __init__(self, folder: str | os.PathLike, *, experts: tuple[str, str, str, str] | None = None):
        self.folder = Path(folder)
        self._safe_open = require("safetensors", "reading a checkpoint tensor by tensor").safe_open
        self.files = self._index()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in sorted(set(self.files.values())):
            self._read_header(file)
        #: fused name -> per expert, the stored tensors whose rows it stacks; renamed name -> stored name
        self.stacked: dict[str, list[list[str]]] = {}
        self.renamed: dict[str, str] = {}
        if experts is not None:
            self._fuse_experts(*experts)

    def _fuse_experts(self, block: str, gate: str, up: str, down: str) -> None:
        """The fused names of the experts stored apart as ``{layer}.{block}.experts.{e}.{gate|up|down}.weight``
        (see the module docstring); the router ``{layer}.{block}.gate.weight`` by the module tree's name."""
        pattern = re.compile(rf"^(.*)\.{re.escape(block)}\.experts\.(\d+)\.({re.escape(gate)}|{re.escape(up)}|"
                             rf"{re.escape(down)})\.weight$")
        layers: dict[str, dict[int, dict[str, str]]] = {}
        for name in self.files:
            m = pattern.match(name)
            if m:
                layers.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = name
        for layer, experts in layers.items():
            count = len(experts)
            if sorted(experts) != list(range(count)) or any(len(parts) != 3 for parts in experts.values()):
                raise CheckpointError(f"{self.folder}: {layer}.{block}.experts does not hold {gate}, {up} and {down} "
                                      f"for experts 0..{count - 1}; is the checkpoint complete?")
            self._stack(f"{layer}.mlp.experts.gate_up_proj", [[experts[e][gate], experts[e][up]] for e in range(count)])
            self._stack(f"{layer}.mlp.experts.down_proj", [[experts[e][down]] for e in range(count)])
            router = f"{layer}.{block}.gate.weight"
            if block != "mlp" and router in self.files:
                self.renamed[f"{layer}.mlp.gate.weight"] = router
                self.shapes[f"{layer}.mlp.gate.weight"] = self.shapes[router]
                self.dtypes[f"{layer}.mlp.gate.weight"] = self.dtypes[router]

    def _stack(self, name: str, parts: list[list[str]]) -> None:
        first = self.shapes[parts[0][0]]
        shapes = [[self.shapes[p] for p in expert] for expert in parts]
        if any(len(sh) != 2 or sh[1] != first[1] for expert in shapes for sh in expert) or len(
                {sum(sh[0] for sh in expert) for expert in shapes}) != 1:
            raise CheckpointError(f"{self.folder}: the experts stacked as {name!r} do not all have the same shapes")
        self.stacked[name] = parts
        self.shapes[name] = (len(parts), sum(sh[0] for sh in shapes[0]), first[1])
        self.dtypes[name] = self.dtypes[parts[0][0]]

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
        if name not in self.shapes:
            raise CheckpointError(f"{self.folder}: the checkpoint has no tensor {name!r} ({what}); is it complete?")
        where = self.files.get(self.renamed.get(name, name), self.folder)
        if self.shapes[name] != tuple(shape):
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(self.shapes[name])}; the "
                                  f"config makes {what} {list(shape)}")
        if self.dtypes[name] not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} is stored as {self.dtypes[name]}; weights are "
                                  f"read from {', '.join(FLOAT_DTYPES)} checkpoints (a quantized checkpoint is not)")

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        name = self.renamed.get(name, name)
        if name in self.stacked:  # experts stored apart: only those of the rows asked for are read
            experts = range(len(self.stacked[name]))[index[0] if index else slice(None)]
            whole = torch.stack([torch.cat([self._read(p, ()) for p in self.stacked[name][e]]) for e in experts])
            return whole[(slice(None), *index[1:])]
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
