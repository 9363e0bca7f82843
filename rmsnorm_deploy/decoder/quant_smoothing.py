"""``--quantize int8-smooth``: each projection's input smoothed per feature before the 8-bit kernel rounds it.

At ``accuracy_level`` 4, MatMulNBits rounds its input to int8 in blocks of ``--block-size`` features,
each block's step set by its largest value. A model's projection inputs have a few features tens of
times larger than the rest (a norm output's outlier channels), so the other features of their blocks
keep a few levels: on real SmolLM2-135M that rounding costs more than the 8-bit weights themselves
(KL from the float model 0.0042 at level 4 against 0.0016 at level 1, whose compute is about 9x slower).

SmoothQuant's remedy, on MatMulNBits' blocks: the input is multiplied by a factor ``f_k`` per feature
(one ``Mul`` before the projections that read it: Q/K/V share one, gate and up another) and the
weight's input row k divided by it, so the product is the same and the outliers move into the
weights, whose 8-bit blocks have steps to spare. ``f = 1 / s``, ``s_k = max|x_k|^a / max|W_k|^(1-a)``
(``quant_sensitivity.smoothing_factors``), the strength ``a`` chosen per input among
:data:`STRENGTHS`, or no smoothing at all, by the relative squared output error of the quantized
projections on :data:`ROWS` of the calibration set's input rows (the kernel's arithmetic:
``quantize.round_activations`` of the smoothed input times the dequantized smoothed weight). With
``--quantize-lm-head`` the head's input is smoothed alike, its strength chosen by the KL of its token
distributions from the float head's (its error reaches the logits directly). Measured on SmolLM2-135M
and Gemma 3 270M (``benchmarks/results/quant_quality.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from rmsnorm_deploy.decoder.quant_recipes import Width
from rmsnorm_deploy.decoder.quant_sensitivity import (CALIBRATION_SOURCE, PROXY_WEIGHTS, _forward_windows, _proxy_rows,
                                                      _refuse_non_finite, _unit_linears, smoothing_factors, unit_of)
from rmsnorm_deploy.decoder.quantize import WeightQuantizer, dequantize, round_activations

#: The migration strengths compared per input (and no smoothing): SmoothQuant's range.
STRENGTHS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
#: How many of the calibration set's input rows each input's strength is chosen on (evenly spaced in
#: each window, the same positions for every input).
ROWS = 256


@dataclasses.dataclass
class _Input:
    """One input the projections of a unit share: their paths, the input's largest magnitude per feature
    over the whole calibration set, and its sampled rows."""

    unit: str
    layer: int
    paths: list[str] = dataclasses.field(default_factory=list)
    absmax: torch.Tensor | None = None
    rows: list[torch.Tensor] = dataclasses.field(default_factory=list)


def _inputs(lm: torch.nn.Module, windows: Sequence[Sequence[int]], head: bool) -> dict[tuple[str, int], _Input]:
    """Each unit's input over ``windows`` (and the LM head's, keyed ``("head", 0)``, when ``head``): its
    largest magnitude per feature and :data:`ROWS` rows."""
    per_window = max(1, -(-ROWS // max(len(windows), 1)))
    inputs: dict[tuple[str, int], _Input] = {}
    hooks = []
    linears = _unit_linears(lm)
    if head:
        linears.append((next(p for p, m in lm.named_modules() if m is lm.get_output_embeddings()),
                        lm.get_output_embeddings()))
    for path, module in linears:
        key = unit_of(path) or ("head", 0)
        item = inputs.setdefault(key, _Input(*key))
        item.paths.append(path)
        if len(item.paths) > 1:  # Q/K/V, gate/up: one input, gathered once
            continue

        def gather(_module: torch.nn.Module, args: tuple[Any, ...], item: _Input = item) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            top = x.abs().amax(0)
            item.absmax = top if item.absmax is None else torch.maximum(item.absmax, top)
            item.rows.append(x[torch.linspace(0, len(x) - 1, min(per_window, len(x))).long()].clone())
        hooks.append(module.register_forward_pre_hook(gather))
    _forward_windows(lm, windows, hooks)
    _refuse_non_finite({item.paths[0]: item.absmax for item in inputs.values() if item.absmax is not None})
    return inputs


def _error(x: torch.Tensor, weight_kn: np.ndarray, factors: np.ndarray | None, quantizer: WeightQuantizer,
           exact: torch.Tensor, rounded: bool) -> float:
    """The relative squared output error of the 8-bit kernel on rows ``x`` with these factors (None: none);
    ``rounded``: the kernel rounds its input to int8 (accuracy level 4)."""
    scaled = weight_kn if factors is None else weight_kn / factors[:, None]
    got = quantizer(np.ascontiguousarray(scaled, np.float32), Width(8))
    deq = torch.from_numpy(dequantize(got.packed, got.scales, None, bits=8, block_size=quantizer.block_size,
                                      k=weight_kn.shape[0]))
    xs = x if factors is None else x * torch.from_numpy(factors)
    y = (round_activations(xs, quantizer.block_size) if rounded else xs) @ deq
    return float(((y - exact) ** 2).sum() / max(float((exact ** 2).sum()), 1e-30))


def _head_kl(x: torch.Tensor, weight_kn: np.ndarray, factors: np.ndarray | None, quantizer: WeightQuantizer,
             reference: list[torch.Tensor], rounded: bool) -> float:
    """The mean KL divergence of the 8-bit head's token distributions from the float head's on rows ``x``
    (the head's error reaches the logits directly, so it is measured there, as ``head_smoothing`` measures it)."""
    scaled = weight_kn if factors is None else weight_kn / factors[:, None]
    got = quantizer(np.ascontiguousarray(scaled, np.float32), Width(8))
    deq = torch.from_numpy(dequantize(got.packed, got.scales, None, bits=8, block_size=quantizer.block_size,
                                      k=weight_kn.shape[0]))
    total = 0.0
    for chunk, ref in zip(x.split(64), reference):
        xs = chunk if factors is None else chunk * torch.from_numpy(factors)
        logp = torch.log_softmax(((round_activations(xs, quantizer.block_size) if rounded else xs) @ deq).double(), -1)
        total += float((ref.exp() * (ref - logp)).sum())
    return total / len(x)


def smoothed(quantization: Any, lm: torch.nn.Module, windows: Sequence[Sequence[int]], *,
             source: str = CALIBRATION_SOURCE) -> Any:
    """``quantization`` (``int8-smooth``'s) with each projection input's smoothing chosen on ``windows``
    (module docstring) and what was measured recorded: the factors by Linear path (the Linears fed one
    input share one array) in ``smoothing``, the strengths and errors in ``measurement``."""
    quantizer = WeightQuantizer(quantization.block_size)
    rounded = quantization.compute == "int8"
    modules = dict(lm.named_modules())
    table: dict[str, np.ndarray] = {}
    units = []
    for item in _inputs(lm, windows, quantization.head).values():
        weight = torch.cat([modules[p].weight.detach().float() for p in item.paths])
        assert item.absmax is not None
        x = torch.cat(item.rows)
        factors_of = {a: smoothing_factors(item.absmax.numpy(), weight.abs().amax(0).numpy(), a) for a in STRENGTHS}
        candidates: dict[str, np.ndarray | None] = {"none": None, **{f"{a:g}": factors_of[a] for a in STRENGTHS}}
        if item.unit == "head":  # every row: the KL is over the whole vocabulary
            weight_kn = weight.numpy().T
            reference = [torch.log_softmax((chunk @ weight.T).double(), -1) for chunk in x.split(64)]
            errors = {a: _head_kl(x, weight_kn, f, quantizer, reference, rounded) for a, f in candidates.items()}
        else:
            sample = _proxy_rows(int(weight.shape[0]), int(weight.shape[1]))
            weight_kn = (weight if sample is None else weight[torch.from_numpy(sample)]).numpy().T
            exact = x @ torch.from_numpy(np.ascontiguousarray(weight_kn))
            errors = {a: _error(x, weight_kn, f, quantizer, exact, rounded) for a, f in candidates.items()}
        best = min(errors, key=lambda a: errors[a])
        if best != "none":
            factors = factors_of[float(best)]
            table.update({p: factors for p in item.paths})
        units.append({"unit": item.unit, "layer": item.layer, "strength": best, "rows": len(x),
                      ("kl" if item.unit == "head" else "relative_error"): {a: float(f"{e:.4g}")
                                                                            for a, e in errors.items()}})
    record = {"calibration": source, "tokens": sum(len(w) for w in windows),
              "proxy": ("relative squared output error of the 8-bit projections on the calibration set's input rows, "
                        + (f"the input rounded to int8 per block of {quantization.block_size} as the kernel rounds it "
                           if rounded else "") + f"(at most {ROWS} rows an input; of at most {PROXY_WEIGHTS} weights "
                        "of a unit: evenly spaced output rows)"),
              **({"head_proxy": "mean KL divergence of the 8-bit head's token distributions from the float head's "
                                "on the same rows of its input"} if quantization.head else {}),
              "strengths": ["none", *(f"{a:g}" for a in STRENGTHS)],
              "smoothed": sum(u["strength"] != "none" for u in units), "units": units}
    return dataclasses.replace(quantization, measurement=record, smoothing=table)
