"""TensorRT runner: runs an engine built by ``rmsnorm-deploy build``, on the GPU.

Before TensorRT deserializes anything, the engine's sidecar is checked: the TensorRT version
and the GPU must be the ones it was built for, the file must be the one the sidecar hashed,
and the plugin must be requested exactly when the engine holds it (asking for the plugin
and getting an engine without it is as wrong as the reverse). Buffers are torch CUDA
tensors; shapes are checked against the engine's optimization profile before
``set_input_shape``; float32, float16 and bfloat16 (``ml_dtypes.bfloat16`` in numpy) go in
and come out. The runner owns a CUDA stream (``torch.cuda.Stream``): the copies, the engine
and the synchronization run on it, not on the legacy default stream, which synchronizes with
every other stream of the device (and TensorRT warns that it costs extra synchronization).
The plugin is loaded with the implementation (``aot``/``jit``) the engine was built with.

A KV-cache engine (``export --kv-cache``, built with a prefill and a decode profile) also runs
the decode loop, :meth:`TensorRTRunner.generate`: the one loop of ``decoder.loop``
(``decode_loop``: mask, positions, token choice, stopping) over :class:`TensorRTStep`, which
holds one execution context per profile: a step with an empty past runs on profile 0 (prefill),
every other on profile 1 (decode), each step's ``present`` tensors (torch CUDA tensors) bound as
the next step's ``past`` without leaving the GPU; only the last position's logits come back.

TensorRT API used (10.9 to 11.x): ``Runtime.deserialize_cuda_engine``,
``ICudaEngine.num_io_tensors/get_tensor_name/get_tensor_mode/get_tensor_dtype/
get_tensor_profile_shape/num_optimization_profiles``, ``create_execution_context``,
``IExecutionContext.set_optimization_profile_async``, ``set_input_shape``,
``get_tensor_shape``, ``set_tensor_address``, ``execute_async_v3``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rmsnorm_deploy.contract.dtypes import dtype_name, to_numpy, to_torch
from rmsnorm_deploy.decoder.convention import ATTENTION_MASK, INPUT_IDS, LOGITS, POSITION_IDS, left_padded
from rmsnorm_deploy.decoder.loop import decode_loop
from rmsnorm_deploy.errors import InputError, UserError
from rmsnorm_deploy.runners.base import Runner
from rmsnorm_deploy.tensorrt.profiles import profiles_from_dict
from rmsnorm_deploy.tensorrt.runtime import (
    PluginError,
    import_tensorrt,
    make_logger,
    register_plugin,
    trt_dtype_name,
    trt_version,
)
from rmsnorm_deploy.tensorrt.sidecar import (
    Device,
    check_compatible,
    check_engine_hash,
    read_sidecar,
)

if TYPE_CHECKING:
    from rmsnorm_deploy.tensorrt.sidecar import Sidecar

_TORCH_DTYPES = ("float32", "float16", "bfloat16", "int32", "int64", "bool", "int8", "uint8")


class TensorRTRunner(Runner):
    """Runs a TensorRT engine (and its sidecar) on CUDA device 0."""

    backend = "tensorrt"

    def __init__(self, engine_path: str | os.PathLike, *, plugin: bool = False):
        super().__init__()
        self.engine_path = Path(engine_path)
        self.plugin = bool(plugin)
        self.sidecar: Sidecar | None = None
        self.engine: Any = None  # a tensorrt.ICudaEngine while active
        self.context: Any = None  # its tensorrt.IExecutionContext
        self.io: dict[str, dict[str, Any]] = {}

    @property
    def name(self) -> str:
        return "tensorrt[plugin]" if self.plugin else "tensorrt"

    def _activate(self) -> None:
        sidecar = read_sidecar(self.engine_path)
        built_with_plugin = sidecar.plugin is not None
        if built_with_plugin and not self.plugin:
            raise PluginError(f"{self.engine_path} holds the RMSNorm plugin; run it with the plugin (plugin=True, "
                              "--plugin) so that it is loaded")
        if self.plugin and not built_with_plugin:
            raise PluginError(f"the plugin was requested but {self.engine_path} was built without it; rebuild it with "
                              "`rmsnorm-deploy build --plugin` or run it without the plugin")

        trt = import_tensorrt("the TensorRT runner")
        check_compatible(sidecar, Device.current(trt_version(trt)), engine_path=self.engine_path)
        check_engine_hash(sidecar, self.engine_path)
        if self.plugin:
            register_plugin(implementation=str((sidecar.plugin or {}).get("implementation") or "aot"))
        self.logger = make_logger(trt)
        self.runtime = trt.Runtime(self.logger)
        engine = self.runtime.deserialize_cuda_engine(self.engine_path.read_bytes())
        if engine is None:
            raise UserError(f"TensorRT cannot load {self.engine_path}: {self.logger.last_errors()}")
        context = engine.create_execution_context()
        if context is None:
            raise UserError(f"TensorRT cannot create an execution context for {self.engine_path} (out of GPU memory?): "
                            f"{self.logger.last_errors()}")
        self.trt, self.engine, self.context, self.sidecar = trt, engine, context, sidecar
        self.stream = _new_stream(_cuda_device())
        self.profile_set = profiles_from_dict(sidecar.profiles)
        self.profiles = self.profile_set[0]
        self.io = self._io_tensors()

    def _io_tensors(self) -> dict[str, dict[str, Any]]:

        trt, engine = self.trt, self.engine
        io = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            dtype = trt_dtype_name(engine.get_tensor_dtype(name))
            if dtype not in _TORCH_DTYPES:
                raise UserError(f"engine tensor {name!r} is {dtype}, which this runner cannot feed or fetch")
            shape = tuple(engine.get_tensor_shape(name))
            entry: dict[str, Any] = {"input": is_input, "dtype": dtype, "shape": shape}
            if is_input and any(d < 0 for d in shape):
                lo, opt, hi = engine.get_tensor_profile_shape(name, 0)
                entry["profile"] = (tuple(lo), tuple(opt), tuple(hi))
            elif is_input:
                entry["profile"] = (shape, shape, shape)
            io[name] = entry
        return io

    def _deactivate(self) -> None:
        self.stream = None
        self.context = None
        self.engine = None
        self.runtime = None

    def input_names(self) -> list[str]:
        return [n for n, e in self.io.items() if e["input"]]

    def output_names(self) -> list[str]:
        return [n for n, e in self.io.items() if not e["input"]]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = self.input_names()
        unknown, missing = sorted(set(feed) - set(inputs)), sorted(set(inputs) - set(feed))
        if unknown or missing:
            raise InputError(f"inputs do not match the engine: missing {missing}, unexpected {unknown}; "
                             f"the engine takes {sorted(inputs)}")
        device = _cuda_device()
        with _on_stream(self.stream):
            return self._run(feed, inputs, device)

    def _run(self, feed: dict[str, np.ndarray], inputs: list[str], device: Any) -> dict[str, np.ndarray]:
        """Copies in, the engine, copies out: all on the runner's stream (the current one here)."""
        import torch

        keep: dict[str, torch.Tensor] = {}
        for name in inputs:
            array = np.ascontiguousarray(feed[name])
            entry = self.io[name]
            got = _dtype_of(array)
            if got != entry["dtype"]:
                raise InputError(f"input {name!r} is {got} but the engine wants {entry['dtype']}; convert it first")
            self._check_profile(name, array.shape)
            if not self.context.set_input_shape(name, tuple(int(d) for d in array.shape)):
                raise InputError(f"TensorRT refused shape {list(array.shape)} for input {name!r}: "
                                 f"{self.logger.last_errors()}")
            tensor = to_torch(array).to(device).contiguous()
            keep[name] = tensor
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs: dict[str, torch.Tensor] = {}
        for name in self.output_names():
            shape = tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise UserError(f"output {name!r} has a data-dependent shape {list(shape)}, which this runner does "
                                "not support")
            tensor = torch.empty(shape, dtype=_torch_dtype(self.io[name]["dtype"]), device=device)
            outputs[name] = tensor
            self.context.set_tensor_address(name, tensor.data_ptr())
        stream = self.stream
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise UserError(f"TensorRT failed to run {self.engine_path}: {self.logger.last_errors()}")
        stream.synchronize()
        return {name: to_numpy(t) for name, t in outputs.items()}

    def generate(self, layout: Any, prompts: Any, *, max_new_tokens: int, eos_token_id: Any = None,
                 pad_token_id: int = 0) -> list[list[int]]:
        """Greedy decoding on a KV-cache engine (see the module docstring): the new tokens of each prompt.

        ``layout``: the model's ``decoder.convention.KVCacheLayout``; ``prompts``: token-id lists,
        left-padded here with ``pad_token_id``.
        """
        if not self.is_active:
            raise RuntimeError("TensorRTRunner.generate used outside its `with` block; call activate() first")
        return _generate(self, layout, prompts, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id)

    def _check_profile(self, name: str, shape: tuple[int, ...]) -> None:
        if name in self.profiles.inputs:
            self.profiles.check_shape(name, shape)
            return
        lo, _, hi = self.io[name]["profile"]
        if len(shape) != len(lo) or any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            raise InputError(f"input {name!r} shape {list(shape)} is outside the engine's profile "
                             f"{list(lo)} .. {list(hi)}; rebuild the engine with a wider --profile")


def _cuda_device():
    """CUDA device 0: where TensorRT runs and the buffers live."""
    import torch

    return torch.device("cuda", 0)


def _new_stream(device: Any) -> Any:
    """A CUDA stream of the runner's own on ``device`` (never the legacy default stream 0)."""
    import torch

    return torch.cuda.Stream(device=device)


def _on_stream(stream: Any) -> Any:
    """Make ``stream`` current, so that torch's copies and allocations are ordered on it."""
    import torch

    return torch.cuda.stream(stream)


def _dtype_of(array: np.ndarray) -> str:
    try:
        return dtype_name(array.dtype)
    except UserError:
        return str(array.dtype)


def _torch_dtype(name: str):
    import torch

    return {
        "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32,
        "int64": torch.int64, "bool": torch.bool, "int8": torch.int8, "uint8": torch.uint8,
    }[name]


class _Step:
    """One execution context on one optimization profile, with its stream."""

    def __init__(self, runner: TensorRTRunner, index: int, stream: Any):
        self.runner = runner
        context = runner.engine.create_execution_context() if index else runner.context
        if context is None or not context.set_optimization_profile_async(index, stream.cuda_stream):
            raise UserError(f"TensorRT cannot select optimization profile {index} of {runner.engine_path}: "
                            f"{runner.logger.last_errors()}")
        self.context, self.stream, self.profile = context, stream, runner.profile_set[index]

    def run(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Bind torch CUDA tensors, run, return the outputs as torch CUDA tensors."""
        import torch

        device = _cuda_device()
        placeholder = torch.empty(1, dtype=torch.uint8, device=device)  # empty tensors still need an address
        for name in self.runner.input_names():
            tensor = inputs[name]
            self.profile.check_shape(name, tuple(tensor.shape))
            if not self.context.set_input_shape(name, tuple(int(d) for d in tensor.shape)):
                raise InputError(f"TensorRT refused shape {list(tensor.shape)} for input {name!r}: "
                                 f"{self.runner.logger.last_errors()}")
            self.context.set_tensor_address(name, tensor.data_ptr() if tensor.numel() else placeholder.data_ptr())
        outputs = {}
        for name in self.runner.output_names():
            shape = tuple(self.context.get_tensor_shape(name))
            tensor = torch.empty(shape, dtype=_torch_dtype(self.runner.io[name]["dtype"]), device=device)
            outputs[name] = tensor
            self.context.set_tensor_address(name, tensor.data_ptr() if tensor.numel() else placeholder.data_ptr())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise UserError(f"TensorRT failed to run {self.runner.engine_path}: {self.runner.logger.last_errors()}")
        return outputs


class TensorRTStep:
    """TensorRT's step of ``decoder.loop.decode_loop`` on a KV-cache engine (see the module docstring)."""

    def __init__(self, runner: TensorRTRunner, layout: Any):
        if len(runner.profile_set) < 2 or runner.engine.num_optimization_profiles < 2:
            raise UserError(f"{runner.engine_path} has no decode profile; build it from a KV-cache model "
                            "(`export --kv-cache`, then `build`)")
        self.layout = layout
        self.device = _cuda_device()
        self.stream = _new_stream(self.device)
        self.prefill, self.decode = _Step(runner, 0, self.stream), _Step(runner, 1, self.stream)

    def empty_cache(self, batch: int) -> dict[str, Any]:
        import torch

        lay = self.layout
        dtype = _torch_dtype(lay.dtype)
        return {n: torch.empty((batch, lay.kv_heads, 0, lay.head_dim), dtype=dtype, device=self.device)
                for n in lay.past_names()}

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
        import torch


        lay = self.layout
        first = next(iter(cache.values()), None)
        step = self.prefill if first is None or first.shape[2] == 0 else self.decode
        with _on_stream(self.stream):
            feed = {INPUT_IDS: torch.from_numpy(input_ids).to(self.device),
                    ATTENTION_MASK: torch.from_numpy(attention_mask).to(self.device),
                    POSITION_IDS: torch.from_numpy(position_ids).to(self.device), **cache}
            out = step.run(feed)
            logits = out[LOGITS][:, -1, :].float().cpu().numpy()  # synchronizes the stream
        return logits, {p: out[q] for p, q in zip(lay.past_names(), lay.present_names())}


def _generate(runner: TensorRTRunner, layout: Any, prompts: Any, *, max_new_tokens: int,
              eos_token_id: Any = None, pad_token_id: int = 0) -> list[list[int]]:

    step = TensorRTStep(runner, layout)
    ids, mask = left_padded(prompts, pad_token_id)
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    run = decode_loop(step, ids, mask, max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=pad_token_id)
    return run.tokens.tolist()
