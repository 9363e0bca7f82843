"""Where each norm stands in the PyTorch model: the source side of the placement contract.

The module runs once, eagerly, under a :class:`torch.overrides.TorchFunctionMode` that records
every torch function it calls (``F.linear``, ``Tensor.__add__``, ``torch.matmul``,
``F.scaled_dot_product_attention``, views, casts...) with the identities of the tensors it reads
and writes (an in-place write into a view also writes the view's base: MLA fills its keys with
``keys[..., n:].copy_(k_rot)``); each detected norm is recorded as one op (forward hooks on its
module; what it does inside is not recorded). That is the op graph of ``graph/placement.py``, and
the same rules place each norm there (``pre``, ``post``, ``sublayer_output``, ``qk``, ``final``,
``other``). Eager execution sees what the model computes whatever its code looks like (HF models,
our blocks, user modules), with no tracer to satisfy. A norm called more than once gets one
placement per call, named ``path``, ``path#2``, ... as the exported nodes are.

Export compares these placements with the ONNX graph's (:func:`check_placements`) and refuses
a mismatch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from rmsnorm_deploy.exporter.detect import DetectedNorm
from rmsnorm_deploy.exporter.plan import ExportError
from rmsnorm_deploy.graph.placement import Op, OpGraph, place_norms

_ADD = {"add", "__add__", "__radd__", "__iadd__", "add_"}
_MATMUL = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum", "baddbmm", "addmm"}
_SOFTMAX = {"softmax", "log_softmax", "_softmax"}
_SCALE = {"mul", "__mul__", "__rmul__", "mul_", "__imul__", "div", "__truediv__", "div_", "__itruediv__"}
_CAST = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "clone", "contiguous", "detach"}
_ATTENTION = {"scaled_dot_product_attention": (0, 1)}
_IN_PLACE_DUNDER = {"__iadd__", "__imul__", "__isub__", "__itruediv__", "__setitem__"}


class _Recorder(TorchFunctionMode):
    """Records torch functions as :class:`Op`s over tensor identities."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.names: dict[int, str] = {}
        self.keep: list[torch.Tensor] = []  # tensors stay alive so that their ids are not reused
        self.counter = itertools.count()
        self.depth = 0  # > 0 inside a norm module: its own ops are not recorded

    def name(self, t: torch.Tensor, *, new: bool = False) -> str:
        key = id(t)
        if new or key not in self.names:
            self.names[key] = f"v{next(self.counter)}"
            self.keep.append(t)
        return self.names[key]

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth == 0:
            self.record(func, args, kwargs, out)
        return out

    def record(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        fname = getattr(func, "__name__", "")
        inputs = [self.name(t) for t in _tensors((args, kwargs))]
        in_place = fname in _IN_PLACE_DUNDER or (fname.endswith("_") and not fname.startswith("__"))
        results = _tensors(out)
        if in_place and args and isinstance(args[0], torch.Tensor) and not results:
            results = [args[0]]
        if not results:
            return
        outputs = [self.name(t, new=True) for t in results]
        if fname in _ATTENTION:
            self.ops.append(Op("attention", inputs, outputs, qk_inputs=_ATTENTION[fname]))
            return
        kind = ("add" if fname in _ADD else "matmul" if fname in _MATMUL else "softmax" if fname in _SOFTMAX
                else "cast" if fname in _CAST and len(inputs) == 1 else "scale" if fname in _SCALE else "op")
        if kind == "matmul" and fname in ("baddbmm", "addmm"):
            inputs = inputs[1:3]
        self.ops.append(Op(kind, inputs, outputs, name=fname))
        base = args[0]._base if in_place and args and isinstance(args[0], torch.Tensor) else None
        if base is not None:  # a write into a view (``buf[..., :n].copy_(k)``) writes its base too
            self.ops.append(Op("op", [self.name(base), outputs[0]], [self.name(base, new=True)], name=fname))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if hasattr(obj, "to_tuple"):  # transformers' ModelOutput
        return _tensors(obj.to_tuple())
    return []


def torch_op_graph(module: torch.nn.Module, norms: Iterable[DetectedNorm], kwargs: dict[str, torch.Tensor],
                   others: Iterable[str] = ()) -> OpGraph:
    """The op graph of ``module(**kwargs)`` run once, each call of a norm in ``norms`` one ``norm`` op.

    ``others``: paths of the model's other normalizations (LayerNorms, exported as they are),
    also one ``norm`` op each, as the ONNX side sees them."""
    recorder = _Recorder()
    calls: dict[str, int] = {}
    handles = []

    def pre_hook(path: str) -> Callable:
        def hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            recorder.depth += 1

        return hook

    def post_hook(path: str) -> Callable:
        def hook(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            recorder.depth -= 1
            if recorder.depth:
                return
            ins, outs = _tensors((args, kwargs))[:1], _tensors(output)
            if not ins or not outs:
                return
            count = calls.get(path, 0) + 1
            calls[path] = count
            name = path if count == 1 else f"{path}#{count}"
            recorder.ops.append(Op("norm", [recorder.name(ins[0])], [recorder.name(outs[0], new=True)], name=name))

        return hook

    modules = [(n.path, n.module) for n in norms] + [(p, module.get_submodule(p)) for p in others]
    for path, mod in modules:
        handles.append(mod.register_forward_pre_hook(pre_hook(path), with_kwargs=True))
        handles.append(mod.register_forward_hook(post_hook(path), with_kwargs=True))
    inputs = {recorder.name(t) for t in kwargs.values()}
    try:
        with torch.no_grad(), recorder:
            result = module(**kwargs)
    finally:
        for h in handles:
            h.remove()
    outputs = {recorder.names[id(t)] for t in _tensors(result) if id(t) in recorder.names}
    return OpGraph(recorder.ops, inputs, outputs)


def torch_placements(module: torch.nn.Module, norms: Iterable[DetectedNorm],
                     kwargs: dict[str, torch.Tensor], others: Iterable[str] = ()) -> dict[str, str]:
    """``{norm call name: placement}`` of each norm in ``norms`` of ``module`` run on ``kwargs`` (see the
    module docstring); ``others`` (paths of other normalizations) are norms of the graph, not placed."""
    others = list(others)
    placed = place_norms(torch_op_graph(module, norms, kwargs, others))
    return {k: v for k, v in placed.items() if k.split("#")[0] not in others}


def check_placements(source: dict[str, str], graph: dict[str, str]) -> None:
    """Raise :class:`ExportError` naming the first norm the graph places other than the source does."""
    for name, want in source.items():
        got = graph.get(name, "not found")
        if got != want:
            raise ExportError(f"norm {name!r}: the exported graph places it {got!r}, the PyTorch model {want!r}; "
                              "the graph does not compute the model's architecture")
    extra = sorted(set(graph) - set(source))
    if extra:
        raise ExportError(f"norm {extra[0]!r}: the exported graph places it {graph[extra[0]]!r}, the PyTorch model "
                          "never calls it")
