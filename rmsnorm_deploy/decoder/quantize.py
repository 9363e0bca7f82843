"""Weight-only int8/int4 MatMuls (``export --quantize``): ONNX Runtime's quantizer, and what it computes.

Each projection weight is quantized by ONNX Runtime's own weight-only quantizer
(``onnxruntime.quantization.matmul_nbits_quantizer.DefaultWeightOnlyQuantizer.qbits_block_quant``,
its C++ ``quantize_matmul_4bits``/``quantize_matmul_8bits`` kernels), one tensor at a time, so the
graph writer can stream: symmetric, one float scale per ``block_size`` values of an input column,
packed as ``com.microsoft.MatMulNBits`` reads it ([N, K / block_size, block_size * bits / 8]
bytes). The norms are not touched: they stay our exact ``rmsnorm_deploy::RMSNorm`` nodes.

What the kernel multiplies by, and so the reference a quantized graph is held to:

- the weights, dequantized: ``(q - 2^(bits-1)) * scale`` (:func:`dequantize`; exact in float32,
  and equal bit for bit to what ``MatMulNBits`` multiplies an identity matrix into);
- at ``accuracy_level`` 0 or 1 the input as it is (float32 compute);
- at ``accuracy_level`` 4 (int8 compute) the input rounded per row and block of ``block_size`` to
  int8, with the scale ``max|x| / 127`` of its block (:func:`round_activations`), before the int8
  dot products are summed in int32.

:func:`dequantized_reference` puts exactly that into a PyTorch model in place of its Linear
weights (and, at int8 compute, on their inputs), for the time of a comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator

import numpy as np
import torch

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.quantized import ACCURACY_COMPUTE
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.resources import package_version

#: ``--quantize`` scheme -> bits per weight.
SCHEMES = {"int8": 8, "int4": 4}
#: ``--accuracy-level`` -> the dtype MatMulNBits computes in on ONNX Runtime CPU.
ACCURACY_LEVELS = ACCURACY_COMPUTE
#: The fastest level at both bit widths on this project's CPU measurement (int8 weights compute
#: 10x slower in float32 than in int8): benchmarks/results/quant_accuracy_levels.md.
DEFAULT_ACCURACY_LEVEL = 4
#: MatMulNBits block sizes: powers of two from 16.
BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 32


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How the projections' weights are quantized: ``scheme`` int8 or int4, ``block_size`` values
    per scale, the kernel's ``accuracy_level``, and whether the LM head is quantized too."""

    scheme: str
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise UserError(f"unknown --quantize {self.scheme!r}; choose one of {', '.join(SCHEMES)}")
        if isinstance(self.block_size, bool) or self.block_size not in BLOCK_SIZES:
            raise UserError(f"--block-size {self.block_size!r} is not one MatMulNBits takes; choose one of "
                            f"{', '.join(map(str, BLOCK_SIZES))}")
        if isinstance(self.accuracy_level, bool) or self.accuracy_level not in ACCURACY_LEVELS:
            raise UserError(f"--accuracy-level {self.accuracy_level!r} is not one of "
                            + ", ".join(f"{k} ({v} compute)" for k, v in ACCURACY_LEVELS.items())
                            + " (2 and 3 ask for float16 and bfloat16 compute, which ONNX Runtime CPU runs as 1)")

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    @property
    def compute(self) -> str:
        """The dtype MatMulNBits computes in: ``float32`` or ``int8``."""
        return ACCURACY_LEVELS[self.accuracy_level]

    def describe(self) -> str:
        head = ", LM head too" if self.lm_head else ", LM head unquantized"
        return (f"{self.scheme} weights (block {self.block_size}, symmetric), accuracy_level {self.accuracy_level} "
                f"({self.compute} compute){head}")

    def node_attributes(self, k: int, n: int) -> dict[str, int]:
        """MatMulNBits' attributes; ``accuracy_level`` 0 is left out, as ONNX Runtime's quantizer does."""
        attrs = {"K": int(k), "N": int(n), "bits": self.bits, "block_size": self.block_size}
        if self.accuracy_level:
            attrs["accuracy_level"] = self.accuracy_level
        return attrs


def _quantizer(q: Quantization) -> Any:
    module = require("onnxruntime.quantization.matmul_nbits_quantizer", "quantizing weights (--quantize)")
    config = module.DefaultWeightOnlyQuantConfig(block_size=q.block_size, is_symmetric=True, bits=q.bits)
    return module.DefaultWeightOnlyQuantizer(config)


class WeightQuantizer:
    """ONNX Runtime's weight-only quantizer, one [K, N] weight (or a block of its columns) at a time."""

    def __init__(self, q: Quantization):
        self.q = q
        self._ort = _quantizer(q)

    def __call__(self, weight_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(packed [N, K/block, block*bits/8] uint8, scales [N, K/block])`` of a [K, N] float weight;
        the scales in its dtype (float32 or float16)."""
        packed, scales, _ = self._ort.qbits_block_quant(np.ascontiguousarray(weight_kn))
        return packed, scales


def dequantize(packed: np.ndarray, scales: np.ndarray, *, bits: int, block_size: int, k: int) -> np.ndarray:
    """The [K, N] float32 weights MatMulNBits multiplies by: ``(q - 2^(bits-1)) * scale``, the
    padding of the last block dropped. int4: two values per byte, the low nibble first."""
    n, blocks = scales.shape[0], int(math.ceil(k / block_size))
    if packed.shape != (n, blocks, block_size * bits // 8):
        raise UserError(f"packed weights of shape {list(packed.shape)} do not hold [{n}, {blocks}, "
                        f"{block_size * bits // 8}] for K={k}, block {block_size}, {bits} bits")
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, block_size)
    else:
        q = packed.reshape(n, blocks, block_size)
    w = (q.astype(np.float32) - float(1 << (bits - 1))) * scales.astype(np.float32).reshape(n, blocks, 1)
    return np.ascontiguousarray(w.reshape(n, blocks * block_size)[:, :k].T)


def round_activations(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` as MatMulNBits at accuracy_level 4 sees it: each block of ``block_size`` values of the
    last dim rounded to int8 with the scale ``max|block| / 127`` (half to even), back in float."""
    k = x.shape[-1]
    blocks = int(math.ceil(k / block_size))
    padded = torch.nn.functional.pad(x.float(), (0, blocks * block_size - k))
    padded = padded.reshape(*x.shape[:-1], blocks, block_size)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(padded * inverse).clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(*x.shape[:-1], blocks * block_size)[..., :k].to(x.dtype)


# -- what the graph records, and the reference built from it -------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantizedLinear:
    """One MatMulNBits of the graph: its packed weight and scales, and the Linear modules (paths in
    the exported module tree) whose weights it holds side by side, with their output rows."""

    packed: str
    scales: str
    k: int
    n: int
    parts: tuple[tuple[str, int], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"packed": self.packed, "scales": self.scales, "K": self.k, "N": self.n,
                "parts": [list(p) for p in self.parts]}


def expert_rows(w: torch.Tensor, *, transposed: bool, halves: bool) -> torch.Tensor:
    """One expert's weight (or bias, 1-D) as ``com.microsoft.MoE`` reads it, [N, K], from the model's
    [N, K] ([K, N] when ``transposed``); ``halves``: the model's N rows are all gates then all ups,
    which the op wants interleaved (gate 0, up 0, gate 1, ...)."""
    w = w.t() if transposed else w
    if halves:
        half = w.shape[0] // 2
        w = torch.stack([w[:half], w[half:]], dim=1).reshape(w.shape)
    return w


def expert_parameter(w: torch.Tensor, *, transposed: bool, halves: bool) -> torch.Tensor:
    """The inverse of :func:`expert_rows`: the op's [N, K] back in the model's layout."""
    if halves:
        w = torch.cat([w[0::2], w[1::2]], dim=0)
    return w.t() if transposed else w


@dataclasses.dataclass(frozen=True)
class QuantizedExperts:
    """One QMoE weight of the graph: packed [experts, N, K * bits / 8] and scales [experts, N, K / block],
    and the model's fused experts parameter (its path) they hold, in the layout :func:`expert_rows` reads."""

    packed: str
    scales: str
    k: int
    n: int
    experts: int
    parameter: str
    transposed: bool
    halves: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def metadata_entry(q: Quantization, linears: list[QuantizedLinear],
                   experts: list[QuantizedExperts] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """The ``quantization`` entry of the model's metadata."""
    return {"scheme": q.scheme, "bits": q.bits, "block_size": q.block_size, "accuracy_level": q.accuracy_level,
            "compute": q.compute, "symmetric": True, "lm_head": q.lm_head,
            "quantizer": f"onnxruntime {package_version('onnxruntime')} DefaultWeightOnlyQuantizer",
            "linears": [lin.to_dict() for lin in linears], "experts": [e.to_dict() for e in experts]}


def quantized_experts_of(entry: Any) -> list[QuantizedExperts]:
    """The QMoE weights of a metadata ``quantization`` entry (none before mixtures of experts were written)."""
    try:
        return [QuantizedExperts(str(e["packed"]), str(e["scales"]), int(e["k"]), int(e["n"]), int(e["experts"]),
                                 str(e["parameter"]), bool(e["transposed"]), bool(e["halves"]))
                for e in entry.get("experts", [])]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"the model's quantization metadata is damaged ({exc}); export it again") from None


def quantization_of(entry: Any) -> tuple[Quantization, list[QuantizedLinear]]:
    """The options and linears of a metadata ``quantization`` entry, every field checked."""
    try:
        q = Quantization(entry["scheme"], int(entry["block_size"]), int(entry["accuracy_level"]),
                         bool(entry["lm_head"]))
        linears = []
        for item in entry["linears"]:
            parts = tuple((str(path), int(rows)) for path, rows in item["parts"])
            linear = QuantizedLinear(str(item["packed"]), str(item["scales"]), int(item["K"]), int(item["N"]), parts)
            if sum(rows for _, rows in parts) != linear.n or linear.k < 1:
                raise ValueError(f"{linear.packed}: its parts' rows do not add up to N={linear.n}")
            linears.append(linear)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"the model's quantization metadata is damaged ({exc}); export it again") from None
    return q, linears


def read_initializer(model: Any, name: str, base_dir: Any) -> np.ndarray:
    """An initializer of ``model`` as numpy, its external data read from ``base_dir``."""
    from onnx import numpy_helper

    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init, str(base_dir) if base_dir else "")
    raise UserError(f"the graph has no initializer {name!r} that its quantization metadata names; export it again")


@dataclasses.dataclass
class WeightCheck:
    """The graph's quantized weights against the model's own: each within one quantization step
    (rounding to the nearest step; the largest magnitude of a block sits at the end of the range,
    where it may be up to one step off), each block's step its largest magnitude over 2^(bits-1)
    (ONNX Runtime's symmetric scale). Without it a wrong packing would be its own reference."""

    name: str = "quantized weights vs the model's"
    weights: int = 0
    max_steps: float = 0.0  # the largest |dequantized - original| in steps
    worst_scale: float = 1.0  # the |scale| / (block max / 2^(bits-1)) farthest from 1
    worst: str = ""

    #: float rounding of the scale and of the dequantized product
    SLACK = 1e-5

    def add(self, path: str, original: torch.Tensor, dequantized: np.ndarray, scales: np.ndarray, bits: int,
            block_size: int) -> None:
        """``original`` [rows, K] (the model's), ``dequantized`` [rows, K] and ``scales`` [rows, K/block] (the graph's)."""
        w = original.detach().float().numpy()
        rows, k = w.shape
        blocks = scales.shape[1]
        padded = np.zeros((rows, blocks * block_size), np.float32)
        padded[:, :k] = np.abs(w)
        expected = padded.reshape(rows, blocks, block_size).max(-1) / float(1 << (bits - 1))
        step = np.abs(scales.astype(np.float32))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(expected > 0, step / expected, np.where(step > 0, np.inf, 1.0))
            steps = np.abs(dequantized - w) / np.repeat(np.maximum(step, 1e-30), block_size, axis=1)[:, :k]
        far = float(ratio.flat[np.argmax(np.abs(ratio - 1.0))])
        if abs(far - 1.0) > abs(self.worst_scale - 1.0):
            self.worst_scale = far
        if steps.size and float(steps.max()) > self.max_steps:
            self.max_steps, self.worst = float(steps.max()), path
        self.weights += w.size

    @property
    def passed(self) -> bool:
        return self.max_steps <= 1.0 + self.SLACK and abs(self.worst_scale - 1.0) <= self.SLACK

    def __bool__(self) -> bool:
        return self.passed

    def summary(self) -> str:
        return (f"{self.name}: {'PASS' if self.passed else 'FAIL'} {self.weights:,} weights within "
                f"{self.max_steps:.3g} quantization steps (at most 1){f' (worst: {self.worst})' if self.worst else ''}, "
                f"every step the block's largest magnitude / 2^(bits-1) (farthest ratio {self.worst_scale:.6g})")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed}


@dataclasses.dataclass
class Reference:
    """What :func:`dequantized_reference` put into the model: the compute dtype and the weights' check."""

    compute: str
    weights: WeightCheck


@contextlib.contextmanager
def dequantized_reference(root: torch.nn.Module, model: Any, entry: Any, *, base_dir: Any = None,
                          under: str = "", check: WeightCheck | None = None) -> Iterator[Reference]:
    """``root`` (the exported module tree) computing what the quantized ``model`` (a ModelProto;
    its external data under ``base_dir``) computes: each quantized Linear's weight and each quantized
    experts parameter (QMoE's) replaced by the dequantized values read back from the graph (checked
    against the weight it replaces: :class:`WeightCheck`) and, at int8 compute, their inputs rounded
    as the kernels round them; only the weights under the module path ``under`` when given (one layer
    at a time; ``check`` then gathers the weights' check over the layers). Restored on exit."""
    q, linears = quantization_of(entry)
    experts = quantized_experts_of(entry)
    if under:
        linears = [lin for lin in linears if all(path.startswith(under + ".") for path, _ in lin.parts)]
        experts = [e for e in experts if e.parameter.startswith(under + ".")]
    modules = dict(root.named_modules())
    check = check if check is not None else WeightCheck()
    with contextlib.ExitStack() as stack:
        for lin in linears:
            scales = read_initializer(model, lin.scales, base_dir)
            weight = dequantize(read_initializer(model, lin.packed, base_dir), scales, bits=q.bits,
                                block_size=q.block_size, k=lin.k)
            start = 0
            for path, rows in lin.parts:
                module = modules.get(path)
                if not isinstance(module, torch.nn.Linear) or tuple(module.weight.shape) != (rows, lin.k):
                    raise UserError(f"the quantization metadata names {path!r} [{rows}, {lin.k}], which is not a "
                                    "Linear of that shape in the model; export it again")
                values = np.ascontiguousarray(weight[:, start:start + rows].T)
                check.add(path, module.weight, values, scales[start:start + rows], q.bits, q.block_size)
                stack.enter_context(_replaced(module, "weight", torch.from_numpy(values)))
                start += rows
                if q.compute == "int8":
                    stack.callback(module.register_forward_pre_hook(
                        lambda _m, args, b=q.block_size: (round_activations(args[0], b), *args[1:])).remove)
        for item in experts:
            _dequantized_experts(stack, modules, model, base_dir, q, item, check)
        yield Reference(q.compute, check)


@contextlib.contextmanager
def _replaced(module: torch.nn.Module, name: str, values: torch.Tensor) -> Iterator[None]:
    """``module.name`` a new Parameter of ``values`` (not an in-place copy: a head tied to the embedding
    stays untied) for the time of the block."""
    saved = getattr(module, name)
    setattr(module, name, torch.nn.Parameter(values.to(saved.dtype), requires_grad=False))
    try:
        yield
    finally:
        setattr(module, name, saved)


def _dequantized_experts(stack: contextlib.ExitStack, modules: dict[str, torch.nn.Module], model: Any, base_dir: Any,
                         q: Quantization, item: QuantizedExperts, check: WeightCheck) -> None:
    """One QMoE weight's dequantized values in place of the experts parameter it holds; at int8 compute,
    the experts' input and their activated intermediate rounded per block (QMoE's two GEMMs): the experts
    then run transformers' ``batched_mm`` implementation, which calls ``_apply_gate`` where the eager loop
    inlines it."""
    path, _, attr = item.parameter.rpartition(".")
    module = modules.get(path)
    original = getattr(module, attr, None)
    if not isinstance(original, torch.Tensor) or original.dim() != 3 or original.shape[0] != item.experts:
        raise UserError(f"the quantization metadata names {item.parameter!r}, which is not a fused experts parameter "
                        "of the model; export it again")
    packed, scales = read_initializer(model, item.packed, base_dir), read_initializer(model, item.scales, base_dir)
    blocks = item.k // q.block_size
    values = []
    for e in range(item.experts):
        rows = dequantize(packed[e].reshape(item.n, blocks, -1), scales[e], bits=q.bits, block_size=q.block_size,
                          k=item.k).T
        mine = expert_rows(original[e].detach().float(), transposed=item.transposed, halves=item.halves)
        check.add(f"{item.parameter}[{e}]", mine, np.ascontiguousarray(rows), scales[e], q.bits, q.block_size)
        values.append(expert_parameter(torch.from_numpy(np.ascontiguousarray(rows)), transposed=item.transposed,
                                       halves=item.halves))
    stack.enter_context(_replaced(module, attr, torch.stack(values)))
    if q.compute == "int8" and attr == "gate_up_proj":
        config, block = module.config, q.block_size
        saved = config._experts_implementation_internal
        config._experts_implementation_internal = "batched_mm"
        stack.callback(setattr, config, "_experts_implementation_internal", saved)
        gate = module._apply_gate
        module._apply_gate = lambda gate_up: round_activations(gate(gate_up), block)
        stack.callback(delattr, module, "_apply_gate")
        stack.callback(module.register_forward_pre_hook(
            lambda _m, args: (round_activations(args[0], block), *args[1:])).remove)
