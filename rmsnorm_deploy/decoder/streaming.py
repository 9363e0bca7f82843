"""A Hugging Face folder opened for a streamed export: the module tree without its weights.

``export HF_FOLDER --kv-cache --target onnxruntime`` never loads the model. :func:`open_folder`
builds the model class from the folder's config with every parameter on the meta device (nothing
allocated; buffers such as the rotary inverse frequencies and Gemma's embedding scale are computed
for real, as the model computes them), then gives the norms their real weights from the checkpoint,
so that ``exporter.detect`` confirms each norm's spec bit for bit on the real module, as for a
model in memory. The projections' and embedding's weights stay on disk: the graph writer reads
them one block at a time from the safetensors files (``weights.SafetensorsTensors``), casts or
quantizes each block and appends it to the external-data file. Peak memory is then set by the
largest block, not by the model (``benchmarks/results/export_scale.md``: an 8B model).

:func:`reference_fits` says whether the whole model, loaded for the parity check after the graph
is written, fits beside ONNX Runtime's session; when it does not, the check runs one layer at a
time (``layer_parity``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.decoder.families import MoEFamily, family_of
from rmsnorm_deploy.decoder.weights import SafetensorsTensors, parameter_names
from rmsnorm_deploy.errors import one_line
from rmsnorm_deploy.exporter import hf
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.resources import memory_budget

#: The parity check holds the model in its dtype, a dequantized copy of its projections, and ONNX
#: Runtime's session of the graph: at most 3x the weights.
PARITY_PEAK_FACTOR = 3.0
#: Modules whose weights the writer reads from the checkpoint itself, block by block.
_STREAMED = (torch.nn.Linear, torch.nn.Embedding)


@contextlib.contextmanager
def parameters_on_meta(dtype: torch.dtype) -> Iterator[None]:
    """Every parameter registered inside goes to the meta device as it is made (a layer's
    ``torch.empty`` is never written, so never resident); buffers stay real. Floats default to
    ``dtype``, as ``from_pretrained(dtype=...)`` builds a model."""
    register = torch.nn.Module.register_parameter
    default = torch.get_default_dtype()

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
        torch.set_default_dtype(default)


def open_folder(folder: str | os.PathLike, dtype: str) -> tuple[LoadedModel, SafetensorsTensors]:
    """The causal LM of ``folder`` (or of the GGUF file it names: ``hf.read_checkpoint``) with its
    parameters on the meta device but its norms' real weights, and the checkpoint's tensors to stream
    the rest from."""
    checkpoint = hf.read_checkpoint(folder)
    path, config, model_cls = checkpoint.path, checkpoint.config, checkpoint.model_cls
    family = family_of(config)
    moe = family if isinstance(family, MoEFamily) else None
    tensors = SafetensorsTensors(path, experts=moe.checkpoint_experts if moe is not None else None)
    try:
        with parameters_on_meta(torch_dtype(dtype)):
            model = model_cls(config)
    except Exception as exc:  # transformers raises many kinds on a config it cannot build
        raise hf.HFModelError(f"{path}: transformers cannot build this config ({type(exc).__name__}: "
                              f"{one_line(exc)})") from None
    _materialize_small_parameters(model, tensors, torch_dtype(dtype),
                                  streamed=f".mlp.{moe.experts}" if moe is not None else None)
    loaded = hf.loaded_model(model, config, dtype, name=checkpoint.name, source=checkpoint.source, folder=path)
    return loaded, tensors


@torch.no_grad()
def _materialize_small_parameters(model: torch.nn.Module, tensors: SafetensorsTensors, dtype: torch.dtype, *,
                                  streamed: str | None = None) -> None:
    """The parameters of every module but Linear and Embedding and the experts (modules whose path ends
    with ``streamed``) read from the checkpoint (the norms' gains, routers, sinks), checked and cast to
    ``dtype`` as ``from_pretrained`` casts them."""
    names = parameter_names(model)
    for path, module in model.named_modules():
        if isinstance(module, _STREAMED) or (streamed is not None and path.endswith(streamed)):
            continue
        for attr, param in list(module.named_parameters(recurse=False)):
            name = names[id(param)]
            tensors.check(name, tuple(param.shape), f"{path}.{attr}")
            setattr(module, attr, torch.nn.Parameter(tensors.get(name).to(dtype), requires_grad=False))


def reference_fits(loaded: LoadedModel) -> str | None:
    """Why the whole model cannot be loaded for the parity check beside ONNX Runtime's session, or None."""
    budget = memory_budget()
    need = loaded.parameter_count() * torch_dtype(loaded.dtype).itemsize * PARITY_PEAK_FACTOR
    if budget is None or need <= budget:
        return None
    return (f"the whole PyTorch model beside ONNX Runtime's session needs about {need / 2**30:,.1f} GiB, over this "
            f"machine's budget of {budget / 2**30:,.1f} GiB")
