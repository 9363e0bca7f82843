"""The ONNX Runtime decoder graph held to its source: norms audited, logits step by step, greedy tokens.

:func:`audit_norms`: as many RMSNorm reductions in the graph as norm nodes written, every one
accumulating in float32. :func:`decode_parity`: prefill and greedy decode steps of the graph in
ONNX Runtime CPU against transformers eager with its own cache, rows left-padded by different
amounts, the last position's logits compared per step with the tolerance table's bound.

A quantized graph is held to the model it computes: the PyTorch model with its Linear weights
replaced by the dequantized values read back from the graph (and, at int8 compute, their inputs
rounded as the kernel rounds them; ``quantize.dequantized_reference``), under its own row of the
tolerance table (``quantized_model`` or ``quantized_model_int8``); the tokens must be that
model's. At int8 compute the reference is fed the graph's tokens (its logits are compared at the
same inputs) and each token must be the reference's greedy choice wherever the reference's margin
between its two best tokens exceeds twice the tolerance; closer calls are counted as near ties
(int8 rounding may decide them either way). What quantization cost is reported beside it: the
unquantized model's logits along the graph's own tokens, and how often its greedy choice is the
graph's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import dtype_name, numpy_dtype
from rmsnorm_deploy.contract.inputs import token_ids
from rmsnorm_deploy.contract.tolerances import tolerance_at_scale
from rmsnorm_deploy.decoder.loop import KVDecoderRunner
from rmsnorm_deploy.decoder.ort_model import OrtDecoderError, causal_lm
from rmsnorm_deploy.decoder.quantize import dequantized_reference
from rmsnorm_deploy.decoder.transformers_step import transformers_steps
from rmsnorm_deploy.exporter.loaded_model import LoadedModel
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.metadata import ModelMetadata

#: The reference each kind of graph is compared with (the report names it).
REFERENCES = {
    None: "transformers",
    "float32": "transformers with the weights dequantized from the graph (MatMulNBits computes in float32)",
    "int8": "transformers with the weights dequantized from the graph and each quantized MatMul's input rounded "
            "to int8 per block (MatMulNBits computes in int8)",
}
#: The tolerance table's check for each reference.
CHECKS = {None: "model", "float32": "quantized_model", "int8": "quantized_model_int8"}


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
    tolerance_key: tuple[str, str, str] = ("model", "onnxruntime", "float32")
    cost: QuantizationCost | None = None
    near_ties: int = 0  # int8 compute: steps x rows whose reference margin is within twice the tolerance

    def to_dict(self) -> dict[str, Any]:
        data = {"status": self.status, "tokens_equal": self.tokens_equal, "near_ties": self.near_ties,
                "reference": self.reference, "tolerance": list(self.tolerance_key),
                "steps": [r.to_dict() for r in self.results]}
        if self.cost is not None:
            data["vs_unquantized"] = self.cost.to_dict()
        return data

    def table(self) -> str:
        lines = [f"reference: {self.reference}; tolerance {self.tolerance_key}"] if self.cost is not None else []
        lines += [r.summary() for r in self.results]
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
    graph), rows left-padded by different amounts; per step, the last position's logits are
    compared with the tolerance of ``(check, "onnxruntime", dtype)`` (:data:`CHECKS`)."""
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
    cost, compute, results = None, None, []
    if entry is None:
        expected = transformers_steps(lm, ids, mask, new_tokens=steps + 1)
    else:
        cost = quantization_cost(lm, ids, mask, got)
        with dequantized_reference(loaded.module, proto, entry, base_dir=folder) as reference:
            compute = reference.compute
            # int8 compute: fed the graph's tokens, so that near ties decided otherwise do not change the inputs
            feed = dict(tokens=got.tokens) if compute == "int8" else dict(new_tokens=steps + 1)
            expected = transformers_steps(lm, ids, mask, **feed)
        results = [reference.weights]
    key = (CHECKS[compute], "onnxruntime", dtype)
    scale = max(float(np.abs(e).max()) for e in expected.step_logits)
    tolerance = tolerance_at_scale(*key, scale)
    results += [compare(g, e, tolerance, name=f"logits step {i}" if i else "logits prefill", dtype=dtype)
                for i, (g, e) in enumerate(zip(got.step_logits, expected.step_logits))]
    if compute != "int8":
        return DecodeParity(results, bool(np.array_equal(expected.tokens, got.tokens)), REFERENCES[compute], key, cost)
    equal, ties = decisive_tokens_equal(np.stack(expected.step_logits, axis=1), got.tokens, 2 * tolerance.atol)
    return DecodeParity(results, equal, REFERENCES[compute], key, cost, ties)


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
