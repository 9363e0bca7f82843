"""Run a model in float64 without holding a float64 copy of it.

The export-time parity check compares the ONNX model with the PyTorch module in its own
dtype *and* with a float64 run of the same module, whose norms compute the spec's
float64 oracle (``reference.oracle``: no rounding at all). A 1B-parameter float16 model
would need 8 GB more to be copied to float64, so :func:`float64_view` upcasts one module
at a time, only while that module runs:

* exact ``nn.Linear``: the float64 product computed over chunks of output rows, so at most
  :data:`CHUNK_BYTES` of a weight is widened at once;
* exact ``nn.Embedding``: rows gathered in the weight's dtype, then widened (exact);
* subclasses of ``nn.Embedding`` (Gemma's scaled embedding: ``super().forward(ids) * scale``):
  their weight reads as float64 while it is only a view (:class:`WidenedOnGather`): the rows
  the embedding gathers are widened, the table is not (262144 x 640 in float64 is 1.3 GB);
* detected norms: replaced by :class:`OracleRMSNorm`;
* any other module with its own floating-point parameters or buffers: those are widened
  for the duration of its forward and put back afterwards; so are the parameters of the
  children its class's code reads directly (``self.dt_proj.weight @ x`` in Mamba and Jamba's
  mixers: without this the parent would multiply float64 by the child's float32 weight);
* mixture-of-experts blocks of transformers (``@use_experts_implementation``): their default
  ``grouped_mm`` kernel has no float64 version, so for the duration of their forward their
  config says ``"eager"`` (the class's own loop over experts, float64-capable); the
  same-dtype run keeps the implementation the model was loaded with;
* ``softmax(x, dtype=torch.float32)`` (transformers' eager attention "upcasting" its scores):
  on float64 scores it keeps float64 (:func:`softmax_never_narrows`).

A float64 run that still fails is a one-line :class:`Float64RunError`: the reference is never
skipped silently.

The result equals ``copy.deepcopy(model).double()`` with oracle norms (tests/exporter/test_pipeline.py
checks it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from rmsnorm_deploy.contract.reference import oracle
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.exporter.gated import check_gate_call
from rmsnorm_deploy.exporter.surgery import swapped_modules

#: At most this many bytes of a Linear weight are widened to float64 at once.
CHUNK_BYTES = 64 << 20
#: The experts implementation of transformers' MoE blocks during the float64 run.
FLOAT64_EXPERTS = "eager"


class Float64RunError(UserError):
    """The float64 reference run of a model failed (the export stops: parity needs it)."""


_CHILD_TENSOR = re.compile(r"self\.(\w+)\.(?:weight|bias)\b")


@functools.lru_cache(maxsize=None)
def _children_read_directly(cls: type) -> frozenset[str]:
    """Names ``x`` for which the source of ``cls`` (and its bases) reads ``self.x.weight`` or ``self.x.bias``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.nn") or klass is object:
            continue
        for value in vars(klass).values():
            if inspect.isfunction(value):
                try:
                    names.update(_CHILD_TENSOR.findall(inspect.getsource(value)))
                except (OSError, TypeError):
                    continue
    return frozenset(names)


def _is_experts_block(module: torch.nn.Module) -> bool:
    config = getattr(module, "config", None)
    impl = getattr(config, "_experts_implementation_internal", None)
    return hasattr(type(module), "_apply_gate") and isinstance(impl, str) and impl != FLOAT64_EXPERTS


class OracleRMSNorm(torch.nn.Module):
    """A norm computing its spec's float64 oracle (the ideal the runtimes are measured against)."""

    def __init__(self, spec: RMSNormSpec, weight: torch.Tensor | None, name: str = ""):
        super().__init__()
        self.spec = spec
        self.weight = weight
        self.norm_name = name

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        check_gate_call(self.spec, gate, self.norm_name)
        return oracle(self.spec, x, self.weight if self.spec.has_gain else None, gate)


class WidenedOnGather(torch.Tensor):
    """A weight that reads as float64 and holds only its own dtype: an embedding lookup gathers
    rows in that dtype and widens them (exact, as widening the whole table then gathering); any
    other use of it widens the whole weight for that op only."""

    @staticmethod
    def __new__(cls, weight: torch.Tensor) -> WidenedOnGather:
        return torch.Tensor._make_wrapper_subclass(cls, weight.shape, dtype=torch.float64, device=weight.device)

    def __init__(self, weight: torch.Tensor):
        self.narrow = weight

    def __repr__(self) -> str:
        return f"WidenedOnGather({self.narrow.dtype}, {list(self.narrow.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.embedding.default and isinstance(args[0], cls):
            return func(args[0].narrow, *args[1:], **(kwargs or {})).to(torch.float64)

        def unwrap(t: Any) -> Any:
            return t.narrow.to(torch.float64) if isinstance(t, cls) else t

        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def _widened(module: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a parameter or buffer of ``module`` named ``name``) as the float64 run reads it."""
    if name == "weight" and isinstance(module, torch.nn.Embedding) and module.max_norm is None:
        return WidenedOnGather(t.detach())
    return t.detach().to(torch.float64)


def _linear64(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        x64 = x.to(torch.float64)
        weight = module.weight
        rows = max(1, CHUNK_BYTES // max(1, weight.shape[1] * 8))
        parts = [x64 @ weight[i:i + rows].to(torch.float64).T for i in range(0, weight.shape[0], rows)]
        out = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        if module.bias is not None:
            out = out + module.bias.to(torch.float64)
        return out

    return forward


def _embedding64(module: torch.nn.Embedding):
    def forward(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, module.weight, module.padding_idx).to(torch.float64)

    return forward


@contextlib.contextmanager
def softmax_never_narrows() -> Iterator[None]:
    """``torch.nn.functional.softmax(x, dtype=...)`` on float64 ``x`` computes in float64 inside the block.

    transformers' eager attention (Gemma 2 has no other on CPU) writes ``softmax(scores,
    dtype=torch.float32)`` to upcast; on float64 scores that narrows them, and float64's mask value
    (-1.8e308) becomes -inf in float32: a query row that sees only padding is all -inf, its softmax
    NaN, and NaN values times zero weights spread it to every position of a left-padded row.
    """
    original = F.softmax

    def softmax(input: torch.Tensor, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> torch.Tensor:
        if input.dtype == torch.float64 and dtype is not None:
            dtype = torch.float64
        return original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    F.softmax = softmax
    try:
        yield
    finally:
        F.softmax = original


@contextlib.contextmanager
def float64_view(model: torch.nn.Module, norms: Sequence[Any] = ()) -> Iterator[torch.nn.Module]:
    """``model`` computing in float64 inside the block; restored exactly on exit.

    ``norms``: :class:`~rmsnorm_deploy.exporter.detect.DetectedNorm` objects (``path``, ``spec``,
    ``weight``) whose modules become :class:`OracleRMSNorm`.
    """

    replacements = {n.path: OracleRMSNorm(n.spec, n.weight, n.path) for n in norms}
    patched: list[torch.nn.Module] = []
    handles: list[Any] = []
    saved: dict[int, dict[str, Any]] = {}
    norm_paths = set(replacements)

    owners: dict[int, torch.nn.Module] = {}
    experts: dict[int, str] = {}

    def widen_own(module: torch.nn.Module) -> None:
        store = saved.setdefault(id(module), {})
        owners[id(module)] = module
        for group in ("_parameters", "_buffers"):
            table = getattr(module, group)
            for name, t in table.items():
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                    store[(group, name)] = t
                    table[name] = _widened(module, name, t)

    def widen(module: torch.nn.Module, _inputs: Any) -> None:
        widen_own(module)
        for child_name in _children_read_directly(type(module)):
            child = module._modules.get(child_name)
            if child is not None and id(child) not in saved:
                widen_own(child)
        if _is_experts_block(module):
            experts[id(module)] = module.config._experts_implementation_internal
            module.config._experts_implementation_internal = FLOAT64_EXPERTS

    def restore(module: torch.nn.Module, *_: Any) -> None:
        if id(module) in experts:
            module.config._experts_implementation_internal = experts.pop(id(module))
        children = [module._modules.get(n) for n in _children_read_directly(type(module))]
        for m in [module] + [c for c in children if c is not None]:
            for (group, name), t in saved.pop(id(m), {}).items():
                getattr(m, group)[name] = t

    try:
        with swapped_modules(model, replacements), softmax_never_narrows():
            for path, module in model.named_modules():
                if path in norm_paths or isinstance(module, OracleRMSNorm):
                    continue
                if type(module) is torch.nn.Linear:
                    module.forward = _linear64(module)  # type: ignore[method-assign]
                    patched.append(module)
                elif type(module) is torch.nn.Embedding:
                    module.forward = _embedding64(module)  # type: ignore[method-assign]
                    patched.append(module)
                elif (any(t.is_floating_point() for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))
                      or _children_read_directly(type(module)) or _is_experts_block(module)):
                    handles.append(module.register_forward_pre_hook(widen))
                    handles.append(module.register_forward_hook(restore, always_call=True))
            yield model
    finally:
        for h in handles:
            h.remove()
        for module in patched:
            del module.forward
        for key in list(saved):  # a forward that raised midway
            for (group, name), t in saved.pop(key).items():
                getattr(owners[key], group)[name] = t
        for key, impl in experts.items():
            for m in model.modules():
                if id(m) == key:
                    m.config._experts_implementation_internal = impl


#: The experts implementation of transformers' MoE blocks while torch.onnx traces them: the
#: default ``grouped_mm`` is a custom op torch.onnx cannot translate.
EXPORT_EXPERTS = "batched_mm"


@contextlib.contextmanager
def experts_implementation(model: torch.nn.Module, implementation: str = EXPORT_EXPERTS) -> Iterator[int]:
    """Inside the block, every MoE block of ``model`` runs ``implementation``; yields how many there are."""
    changed: list[tuple[Any, str]] = []
    try:
        for module in model.modules():
            if _is_experts_block(module) and module.config._experts_implementation_internal != implementation:
                changed.append((module.config, module.config._experts_implementation_internal))
                module.config._experts_implementation_internal = implementation
        yield len(changed)
    finally:
        for config, impl in reversed(changed):
            config._experts_implementation_internal = impl


@torch.no_grad()
def float64_outputs(model: torch.nn.Module, norms: Sequence[Any], **inputs: Any) -> Any:
    """``model(**inputs)`` computed in float64 (see :func:`float64_view`); a failure is one line."""
    with float64_view(model, norms) as m:
        try:
            return m(**inputs)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            raise Float64RunError(f"the float64 reference run of the model failed, so its parity cannot be checked: "
                                  f"{type(exc).__name__}: {one_line(exc)}") from None
