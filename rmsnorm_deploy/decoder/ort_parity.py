"""The ONNX Runtime decoder graph held to its source: norms audited, logits step by step, greedy tokens.

:func:`audit_norms`: as many RMSNorm reductions in the graph as norm nodes written, every one
accumulating in float32. :func:`decode_parity`: prefill and greedy decode steps of the graph in
ONNX Runtime CPU against transformers eager with its own cache, rows left-padded by different
amounts, the last position's logits compared per step.

The verdict is grounded in float64, as the plain export's is (``exporter.parity``): transformers
runs the graph's own tokens twice, in the model's dtype and in float64 (``upcast.float64_view``:
every norm its spec's float64 oracle), and at each step the graph may be at most the
``model_vs_float64`` bound's multiple of the same-dtype run's own distance from float64 (its
largest over the run's steps: the source's error level). The
distance to transformers in the same dtype is context: on a trained deep model two float32
runtimes drift further apart than either is from float64. Each greedy token must be the float64
run's choice wherever its two best logits are further apart than twice that step's bound; closer
calls are counted as near ties.

A quantized graph is held to the model it computes: the PyTorch model with its Linear weights
replaced by the dequantized values read back from the graph (``quantize.dequantized_reference``),
float64-grounded the same way at float32 compute (``quantized_model_vs_float64``). At int8
compute the reference also rounds each quantized MatMul's input as the kernel rounds it, and its
bound is a share of the logits' scale (``quantized_model_int8``: int8 rounding boundaries, not
summation order, set it), or the float bound's multiple of the reference's own spread where that is
larger (``model_vs_float64``'s ratio): its float32 and float64 runs round activations to different
int8 steps too, on a deep model with large activations (real Gemma 3) by more than that share.
What quantization cost is reported beside it: the unquantized model's logits along the graph's own
tokens, and how often its greedy choice is the graph's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from rmsnorm_deploy.contract.compare import CompareResult, compare
from rmsnorm_deploy.contract.dtypes import dtype_name, numpy_dtype
from rmsnorm_deploy.contract.inputs import token_ids
from rmsnorm_deploy.contract.tolerances import Tolerance, accuracy_bound_for, tolerance_at_scale
from rmsnorm_deploy.decoder.ort_step import KVDecoderRunner
from rmsnorm_deploy.decoder.ort_model import OrtDecoderError, causal_lm
from rmsnorm_deploy.decoder.quantize import dequantized_reference, quantization_of
from rmsnorm_deploy.decoder.transformers_step import transformers_steps
from rmsnorm_deploy.exporter.detect import detect_norms
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.exporter.upcast import float64_view
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.metadata import ModelMetadata

#: The reference each kind of graph is compared with (the report names it).
REFERENCES = {
    None: "transformers",
    "float32": "transformers with the weights dequantized from the graph (MatMulNBits computes in float32)",
    "int8": "transformers with the weights dequantized from the graph and each quantized MatMul's input rounded "
            "to int8 per block (MatMulNBits computes in int8; a fitted width's block offsets multiply the input's "
            "block sums as they are)",
}
#: Added to the reference's name when a Linear is quantized per channel (``quantize.channel_head``).
PER_CHANNEL_REFERENCE = ("; a per-channel MatMulInteger's input times its smoothing, rounded to int8 per row, "
                         "its int8 sums exact")
#: Added when a MatMulNBits' input is smoothed (``int8-smooth``: ``quant_smoothing``).
SMOOTHED_REFERENCE = "; a smoothed MatMulNBits' input times the factors read back from the graph (its Mul) first"


def reference_name(compute: str | None, linears: Any) -> str:
    """What a quantized graph (its ``quantize.QuantizedLinear`` list) is compared with, for its report."""
    return (REFERENCES[compute] + (PER_CHANNEL_REFERENCE if any(lin.width.per_channel for lin in linears) else "")
            + (SMOOTHED_REFERENCE if any(lin.smoothing and not lin.width.per_channel for lin in linears) else ""))
#: The check of the tolerance table (an accuracy bound at float compute) for each whole-model reference.
CHECKS = {None: "model_vs_float64", "float32": "quantized_model_vs_float64", "int8": "quantized_model_int8"}
#: The same for one layer compared alone on the graph's own input (``layer_parity``): no depth to drift over.
LAYER_CHECKS = {None: "model", "float32": "quantized_model", "int8": "quantized_model_int8"}
#: The context comparisons' tolerance: they decide nothing.
CONTEXT = Tolerance(reason="context: the distance to the reference run in the model's own dtype decides nothing")


def audit_norms(model: onnx.ModelProto, norm_nodes: int) -> int:
    """As many RMSNorm reductions as norm nodes, every one accumulating in float32 or wider."""
    reductions = [r for r in audit_model(model) if r.kind in ("RMSNorm", "RMSNorm (skip)")]
    if len(reductions) != norm_nodes:
        raise OrtDecoderError(f"the graph holds {len(reductions)} RMSNorm reductions for {norm_nodes} norm nodes")
    low = [r for r in reductions if r.low_precision]
    if low:
        raise OrtDecoderError(f"{len(low)} RMSNorm reduction(s) accumulate in {low[0].accumulation} "
                              f"(first: {low[0].node}); they must stay in float32")
    return len(reductions)


@dataclasses.dataclass
class QuantizationCost:
    """How far a quantized graph is from the unquantized model, along the graph's own tokens: per
    step the largest logit difference, next to the largest logit; and the share of steps and rows
    where the unquantized model's greedy token is the graph's."""

    max_abs: list[float]
    logit_scale: float
    same_argmax: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (f"vs the unquantized model (what quantization costs, not checked): max |logit difference| "
                f"{max(self.max_abs):.3g} over {len(self.max_abs)} steps (largest |logit| {self.logit_scale:.3g}, "
                f"{max(self.max_abs) / max(self.logit_scale, 1e-30):.2%} of it); same greedy token in "
                f"{self.same_argmax:.0%} of steps")


@dataclasses.dataclass
class ParityVerdict:
    """What a decoder parity check decides: it fails when it compared nothing, when a comparison
    failed, or when a greedy token differs (``DecodeParity`` step by step, ``LayerParity`` layer by layer)."""

    results: list[Any]  # CompareResult (a quantized graph's WeightCheck first)
    tokens_equal: bool

    @property
    def failed(self) -> bool:
        return not self.results or not self.tokens_equal or not all(self.results)

    @property
    def status(self) -> str:
        return "fail" if self.failed else "pass"


@dataclasses.dataclass
class DecodeParity(ParityVerdict):
    """Per-step logits of the graph (``results``: prefill first) against transformers running with
    its own cache."""

    reference: str = REFERENCES[None]
    tolerance_key: tuple[str, str, str] = (CHECKS[None], "onnxruntime", "float32")
    cost: QuantizationCost | None = None
    near_ties: int = 0  # steps x rows whose reference margin is within twice the tolerance
    #: per step, the graph against the reference run in the model's own dtype: shown, not checked
    context: list[CompareResult] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = {"status": self.status, "tokens_equal": self.tokens_equal, "near_ties": self.near_ties,
                "reference": self.reference, "tolerance": list(self.tolerance_key),
                "steps": [r.to_dict() for r in self.results],
                "context_same_dtype": [r.to_dict() for r in self.context]}
        if self.cost is not None:
            data["vs_unquantized"] = self.cost.to_dict()
        return data

    def table(self) -> str:
        lines = [f"reference: {self.reference}; tolerance {self.tolerance_key}"]
        lines += [r.summary() for r in self.results]
        lines += [f"(context, vs the reference in its own dtype) {r.name}: max_abs={r.max_abs:.3g}" for r in self.context]
        ties = f" ({self.near_ties} near ties within the tolerance not counted)" if self.near_ties else ""
        lines.append(f"greedy tokens equal to the reference: {self.tokens_equal}{ties}")
        if self.cost is not None:
            lines.append(self.cost.summary())
        return "\n".join(lines)


def _proto_and_folder(model: Any) -> tuple[onnx.ModelProto, Path | None]:
    """The graph without its external data (read only where needed) and the folder that holds it."""
    if isinstance(model, onnx.ModelProto):
        return model, None
    path = Path(model)
    return onnx.load(str(path), load_external_data=False), path.parent


def decode_parity(loaded: LoadedModel, model: Any, *, batch: int = 2, prompt: int = 16, steps: int = 4,
                  seed: int = 0) -> DecodeParity:
    """Prefill and ``steps`` greedy decode steps of ``model`` (a ModelProto or path) in ONNX Runtime
    CPU against transformers eager with its cache (with the dequantized weights for a quantized
    graph), rows left-padded by different amounts; per step, the last position's logits are held
    to the bound of ``(check, "onnxruntime", dtype)`` (:data:`CHECKS`; see the module docstring)."""
    dtype = dtype_name(loaded.dtype)
    lm = causal_lm(loaded)
    ids = token_ids((batch, prompt), loaded.vocab_size, seed=seed).astype(np.int64)
    mask = np.ones_like(ids)
    for row in range(1, batch):
        mask[row, : min(prompt - 1, 2 * row)] = 0  # left padding, different per row
    proto, folder = _proto_and_folder(model)
    got = KVDecoderRunner(model, dtype=numpy_dtype(dtype)).greedy(ids, mask, new_tokens=steps + 1, keep_logits=True)
    meta = ModelMetadata.read(proto)
    entry = meta.quantization if meta is not None else None
    names = [f"logits step {i}" if i else "logits prefill" for i in range(len(got.step_logits))]
    cost, compute, results, linears = None, None, [], []
    with contextlib.ExitStack() as stack:
        if entry is not None:
            cost = quantization_cost(lm, ids, mask, got)
            reference = stack.enter_context(dequantized_reference(loaded.module, proto, entry, base_dir=folder))
            compute, linears = reference.compute, quantization_of(entry)[1]
            results.append(reference.weights)
        key = (CHECKS[compute], "onnxruntime", dtype)
        # the reference is fed the graph's own tokens, so every step compares the same inputs
        same = transformers_steps(lm, ids, mask, tokens=got.tokens)
        with float64_view(loaded.module, detect_norms(loaded.module, dtype=loaded.dtype).norms):
            wide = transformers_steps(lm, ids, mask, tokens=got.tokens)
        level = _spread(same, wide)
        if compute == "int8":
            scale = max(float(np.abs(e).max()) for e in same.step_logits)
            tolerance = max(tolerance_at_scale(*key, scale), accuracy_bound_for(*key).tolerance(level),
                            key=lambda t: t.atol)
            results += [compare(g, e, tolerance, name=n, dtype=dtype)
                        for n, g, e in zip(names, got.step_logits, same.step_logits)]
            equal, ties = decisive_tokens_equal(np.stack(same.step_logits, axis=1), got.tokens, 2 * tolerance.atol)
            return DecodeParity(results, equal, reference_name(compute, linears), key, cost, ties)
    allowed = accuracy_bound_for(*key).tolerance(level)
    margins = []
    for name, g, w in zip(names, got.step_logits, wide.step_logits):
        results.append(compare(g, w, allowed, name=name, dtype=dtype))
        margins.append(2 * allowed.atol)
    context = [compare(g, e, CONTEXT, name=n, dtype=dtype) for n, g, e in zip(names, got.step_logits, same.step_logits)]
    equal, ties = decisive_tokens_equal(np.stack(wide.step_logits, axis=1), got.tokens, max(margins))
    return DecodeParity(results, equal, reference_name(compute, linears), key, cost, ties, context)


def _spread(same: Any, wide: Any) -> float:
    """The source's own error level on this run: its largest distance from its float64 run over the
    steps. One step's distance is a sample of that level, not the level: on real Gemma 3 (int4, float32
    compute) torch landed 4.1e-5 from float64 at one step and 1.7e-4 at the others, a bound below what
    float32 promises at that step (the graph: 3.2e-4, as the unquantized graph there)."""
    return max(float(np.max(np.abs(e.astype(np.float64) - w), initial=0.0))
               for e, w in zip(same.step_logits, wide.step_logits))


def decisive_tokens_equal(logits: np.ndarray, tokens: np.ndarray, margin: float) -> tuple[bool, int]:
    """Whether ``tokens`` [batch, steps] are the argmax of the reference's ``logits`` [batch, steps,
    vocab] wherever its two best logits are more than ``margin`` apart; and how many are not."""
    top2 = np.sort(logits, axis=-1)[..., -2:]
    decisive = (top2[..., 1] - top2[..., 0]) > margin
    same = np.argmax(logits, axis=-1) == tokens
    return bool(np.all(same | ~decisive)), int(np.count_nonzero(~decisive))


def quantization_cost(lm: Any, ids: np.ndarray, mask: np.ndarray, got: Any) -> QuantizationCost:
    """The unquantized ``lm`` fed the graph's tokens: its logits next to the graph's at each step."""
    plain = transformers_steps(lm, ids, mask, tokens=got.tokens)
    diffs = [float(np.abs(g - p).max()) for g, p in zip(got.step_logits, plain.step_logits)]
    scale = max(float(np.abs(p).max()) for p in plain.step_logits)
    same = np.mean([np.argmax(p, axis=-1) == t for p, t in zip(plain.step_logits, got.tokens.T)])
    return QuantizationCost(diffs, scale, float(same))
