"""``--quantize int4-auto``: which weights get 8 bits, chosen by measuring each one on text.

A recipe like llama.cpp's Q4_K_M widens a fixed set of tensors (``quant_recipes.use_more_bits``);
which tensors a given model needs widened is a property of its weights and activations. This
measures it, cheaply, as llama.cpp's importance matrix does:

1. run the model in PyTorch over its calibration set (:func:`calibration_set`): every whole window
   of :data:`CALIBRATION_CONTEXT` tokens of :data:`CALIBRATION_TEXT` (the Apache License 2.0, shipped
   verbatim: never the text quality is measured on; 8 windows with SmolLM2's tokenizer) and
   :data:`GENERATED_WINDOWS` windows the model samples itself (:func:`generated_windows`), and
   gather each Linear's mean squared input per input feature, ``E[x_k^2]``;
2. quantize each weight at the recipe's 4 bits and at 8, and take the expected squared output error
   under that diagonal input (``sum_k E[x_k^2] * sum_n (W - Q(W))_nk^2``) relative to the output's
   own (``sum_k E[x_k^2] * sum_n W_nk^2``), per unit a MatMulNBits holds (``UNITS``: Q/K/V, the
   output projection, gate and up, down; per layer);
3. upgrade to 8 bits the units with the most error removed per byte added, until the bytes added
   reach the budget: what Q4_K_M's layout adds (``int4-mixed``'s 8-bit projections), so
   ``int4-auto`` and ``int4-fit-mixed`` are the same size and differ only in which tensors are
   widened (measured on Gemma 3 270M: KL 0.061 against 0.088, ``benchmarks/results/quant_quality.md``).
   A unit 8 bits would not improve is never widened (a checkpoint already on a 4-bit grid).

The measurement, the proxy's values and the choice are recorded in the model's metadata.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from rmsnorm_deploy.decoder.quant_recipes import RECIPES, UNIT_OF_ROLE, Width, use_more_bits
from rmsnorm_deploy.decoder.quantize import WeightQuantizer, channel_head, dequantize, quantize_channel
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.optional import require

CALIBRATION_TEXT = Path(__file__).resolve().parent / "texts" / "Apache-2.0"
#: Windows of the calibration text, all of it: GPTQ's Hessian of a 1,536-wide input is rank-deficient
#: from 4 windows (1,024 tokens); the whole text (8 windows) measured int4-gptq's KL 0.072 against 0.089 on
#: SmolLM2-135M and 0.062 against 0.078 on Gemma 3 270M (``benchmarks/results/quant_quality.md``).
CALIBRATION_CONTEXT = 256
#: The Linear modules a unit holds, by their attribute name (fused or not, the same unit).
UNIT_OF_MODULE = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv", "o_proj": "o",
                  "gate_proj": "gate_up", "up_proj": "gate_up", "gate_up_proj": "gate_up", "down_proj": "down"}
__all__ = ["UNIT_OF_ROLE", "measured"]
#: The units Q4_K_M's layout widens in ``use_more_bits`` layers (``quant_recipes._mixed``): the default budget.
Q4_K_M_UNITS = ("qkv", "o", "down")


def bits_per_weight(width: Width, block_size: int, scale_bytes: int = 4) -> float:
    """Stored bits per weight: the values, one scale per block, and a zero point per block (uint8
    at 8 bits, a nibble at 4) or an offset (as wide as the scale)."""
    zero = 0.0 if width.symmetric else (8 * scale_bytes if width.offsets else width.bits)
    return width.bits + (8 * scale_bytes + zero) / block_size


@dataclasses.dataclass
class Unit:
    """One unit of one layer: its weights' count, and the proxy's relative output error at 4 and 8 bits."""

    unit: str
    layer: int
    params: int = 0
    error4: float = 0.0
    error8: float = 0.0
    energy: float = 0.0
    upgraded: bool = False

    @property
    def relative4(self) -> float:
        return self.error4 / self.energy if self.energy > 0 else 0.0

    @property
    def relative8(self) -> float:
        return self.error8 / self.energy if self.energy > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "layer": self.layer, "params": self.params, "relative_error_4": self.relative4,
                "relative_error_8": self.relative8, "bits": 8 if self.upgraded else 4}


def unit_of(path: str) -> tuple[str, int] | None:
    """``(unit, layer)`` of a Linear's module path, or None for one no unit holds (the head)."""
    unit = UNIT_OF_MODULE.get(path.rsplit(".", 1)[-1])
    layer = re.search(r"(?:^|\.)layers\.(\d+)\.", path)
    return (unit, int(layer.group(1))) if unit and layer else None


#: The most memory GPTQ's Hessians (float64 [K, K], one per input a unit's Linears share) may take at
#: once: :class:`LayerHessians` measures them a group of consecutive layers at a time, so a
#: LLaMA-3.2-1B-shaped model (16 down projections 8192 wide: 8.6 GB of them) takes three calibration
#: passes instead of being refused; only a single layer over it is.
HESSIAN_BYTES = 4 << 30


def _unit_linears(lm: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """Every Linear a unit holds (``unit_of``), by its path, in module order."""
    return [(p, m) for p, m in lm.named_modules() if isinstance(m, torch.nn.Linear) and unit_of(p) is not None]


class _Measured(Exception):
    """Raised by a hook once a window has driven every Linear a pass measures: the rest of the
    forward (later layers, the LM head) is not run."""


def _forward_windows(lm: torch.nn.Module, windows: Sequence[Sequence[int]], hooks: list[Any],
                     after_window: Any = None) -> None:
    """``lm`` over each window (a batch of one, no cache; cut short by :class:`_Measured`), the
    hooks removed after, even on error."""
    try:
        with torch.inference_mode():
            for window in windows:
                try:
                    lm(input_ids=torch.tensor([list(window)], dtype=torch.long), use_cache=False)
                except _Measured:
                    pass
                if after_window is not None:
                    after_window()
    finally:
        for h in hooks:
            h.remove()


def _refuse_non_finite(moments: dict[str, torch.Tensor]) -> None:
    broken = [path for path, m in moments.items() if not bool(torch.isfinite(m).all())]
    if broken:
        raise UserError(f"the calibration set drove {broken[0]}'s input to non-finite values "
                        f"({len(broken)} Linear(s)): "
                        "the model overflows or its weights are damaged; check it with `validate` before quantizing")


def input_moments(lm: torch.nn.Module, windows: Sequence[Sequence[int]], *,
                  head_inputs: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each unit Linear's mean squared input per input feature over ``windows`` (token id rows); the
    LM head's input rows appended to ``head_inputs`` when given."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(path: str) -> Any:
        def gather(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach().double().reshape(-1, args[0].shape[-1])
            sums[path] = sums.get(path, 0) + (x * x).sum(0)
            counts[path] = counts.get(path, 0) + x.shape[0]
        return gather

    hooks = [module.register_forward_pre_hook(hook(path)) for path, module in _unit_linears(lm)]
    if head_inputs is not None:
        hooks.append(lm.get_output_embeddings().register_forward_pre_hook(
            lambda _m, args: head_inputs.append(args[0].detach().float().reshape(-1, args[0].shape[-1]))))
    _forward_windows(lm, windows, hooks)
    moments = {path: sums[path] / counts[path] for path in sums}
    _refuse_non_finite(moments)
    return moments


class LayerHessians(Mapping[str, np.ndarray]):
    """GPTQ's Hessians, ``E[x x^T]`` [K, K] float64 of each unit Linear's input over ``windows``, by
    its path; measured when first asked for, for a group of consecutive layers at a time within
    ``limit`` bytes (:data:`HESSIAN_BYTES`), the previous group's dropped: the writer asks in layer
    order, so a model takes one calibration pass per group, each stopped once the group's last
    Linear has run. Linears fed the same tensor (Q, K and V; gate and up) share one Hessian,
    computed once. A layer whose Hessians alone exceed the limit is refused."""

    def __init__(self, lm: torch.nn.Module, windows: Sequence[Sequence[int]], limit: int | None = None):
        limit = HESSIAN_BYTES if limit is None else limit
        self._lm, self._windows = lm, [list(w) for w in windows]
        self._linears = _unit_linears(lm)
        self._paths = {path for path, _ in self._linears}
        layer_bytes: dict[int, int] = {}
        seen: set[tuple[str, int]] = set()
        for path, module in self._linears:
            key = unit_of(path)
            assert key is not None
            if key not in seen:  # a unit's Linears read one input (one fed another tensor gets its own sum)
                seen.add(key)
                layer_bytes[key[1]] = layer_bytes.get(key[1], 0) + 8 * int(module.in_features) ** 2
        worst = max(layer_bytes, key=lambda layer: layer_bytes[layer], default=None)
        if worst is not None and layer_bytes[worst] > limit:
            raise UserError(f"--quantize int4-gptq would hold {layer_bytes[worst] / 2**30:.1f} GiB of input "
                            f"Hessians for layer {worst} alone, over {limit / 2**30:.0f} GiB; choose --quantize "
                            "int4-auto-zp (the same grid, fitted under their diagonal)")
        self._group: dict[int, int] = {}
        group, held = 0, 0
        for layer in sorted(layer_bytes):
            if held and held + layer_bytes[layer] > limit:
                group, held = group + 1, 0
            self._group[layer], held = group, held + layer_bytes[layer]
        self.groups = group + 1 if layer_bytes else 0
        self.passes = 0
        self._held_group: int | None = None
        self._held: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._linears)

    def __iter__(self) -> Iterator[str]:
        return (path for path, _ in self._linears)

    def __getitem__(self, path: str) -> np.ndarray:
        key = unit_of(path) if path in self._paths else None
        if key is None:
            raise KeyError(path)
        group = self._group[key[1]]
        if group != self._held_group:
            self._held = {}  # dropped before the next group is measured
            self._held = self._measure(group)
            self._held_group = group
        return self._held[path]

    def _measure(self, group: int) -> dict[str, np.ndarray]:
        """One calibration pass: the Hessians of the group's layers; a Linear whose input is the
        same tensor as an earlier one's of its unit in this forward shares that one's sum."""
        linears = [(p, m) for p, m in self._linears if self._group[unit_of(p)[1]] == group]  # type: ignore[index]
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        owner: dict[str, str] = {}
        inputs: dict[tuple[str, int], list[tuple[torch.Tensor, str]]] = {}

        def hook(path: str) -> Any:
            key = unit_of(path)

            def gather(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
                seen = inputs.setdefault(key, [])  # type: ignore[arg-type]
                shared = next((first for tensor, first in seen if tensor is args[0]), None)
                if shared is not None:
                    owner[path] = shared
                    return
                seen.append((args[0], path))
                owner[path] = path
                x = args[0].detach().double().reshape(-1, args[0].shape[-1])
                if path in sums:
                    sums[path].add_(x.T @ x)  # in place: a [8192, 8192] sum is 512 MiB
                else:
                    sums[path] = x.T @ x
                counts[path] = counts.get(path, 0) + x.shape[0]
            return gather

        hooks = [module.register_forward_pre_hook(hook(path)) for path, module in linears]
        driven: set[str] = set()

        def stop_when_measured(path: str) -> Any:
            def after(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
                driven.add(path)
                if len(driven) == len(linears):  # nothing after this in the forward is measured
                    raise _Measured
            return after

        hooks += [module.register_forward_hook(stop_when_measured(path)) for path, module in linears]

        def next_window() -> None:
            inputs.clear()
            driven.clear()

        _forward_windows(self._lm, self._windows, hooks, after_window=next_window)
        self.passes += 1
        hessians = {path: sums[path].numpy() for path in sums}
        for path, hessian in hessians.items():
            hessian /= counts[path]  # in place: no second copy (finite: input_moments refused non-finite inputs)
        return {path: hessians[owner[path]] for path, _ in linears if path in owner}


#: The most weights of one Linear the proxy quantizes (module docstring, step 2): its sums run over
#: output rows, each quantized on its own, so evenly spaced rows estimate them (scaled to all the
#: rows). Every Linear of SmolLM2-135M and Gemma 3 270M is under it (measured whole); a 1B model's
#: 8192-row gate and up projections are measured on a quarter of their rows.
PROXY_WEIGHTS = 4 << 20


def _proxy_rows(rows: int, k: int) -> np.ndarray | None:
    """The output rows the proxy measures of a [rows, k] weight: None for all of them."""
    take = max(1, PROXY_WEIGHTS // max(k, 1))
    return None if take >= rows else np.unique(np.linspace(0, rows - 1, take).round().astype(np.int64))


def measure_units(lm: torch.nn.Module, moments: dict[str, torch.Tensor], quantizer: Any, four: Width,
                  eight: Width) -> list[Unit]:
    """The proxy's errors of every unit (module docstring, step 2), on at most
    :data:`PROXY_WEIGHTS` of each Linear's weights."""
    units: dict[tuple[str, int], Unit] = {}
    for path, module in lm.named_modules():
        key = unit_of(path)
        if key is None or path not in moments or not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight.detach()
        rows = _proxy_rows(int(weight.shape[0]), int(weight.shape[1]))
        share = 1.0 if rows is None else weight.shape[0] / len(rows)
        weight_kn = np.ascontiguousarray((weight if rows is None else weight[torch.from_numpy(rows)]).float().numpy().T)
        importance = moments[path].float().numpy()[:, None]
        unit = units.setdefault(key, Unit(*key))
        unit.params += int(weight.numel())
        unit.energy += share * float((importance * weight_kn.astype(np.float64) ** 2).sum())
        for width, attr in ((four, "error4"), (eight, "error8")):
            got = quantizer(weight_kn, width, moments[path].double().numpy())
            deq = dequantize(got.packed, got.scales, got.zero_points, bits=width.bits, block_size=quantizer.block_size,
                             k=weight_kn.shape[0], offsets=got.offsets)
            setattr(unit, attr, getattr(unit, attr) + share * float(
                (importance * (deq - weight_kn).astype(np.float64) ** 2).sum()))
    return sorted(units.values(), key=lambda u: (u.layer, u.unit))


def choose(units: list[Unit], four: Width, eight: Width, block_size: int, budget_bytes: float) -> None:
    """Mark upgraded the units with the most relative error removed per byte added, while they fit
    the budget (greedy, best ratio first; a unit too large for what is left is skipped; a unit 8
    bits would not improve, none: a checkpoint whose weights are already on a 4-bit grid gets none)."""
    extra = (bits_per_weight(eight, block_size) - bits_per_weight(four, block_size)) / 8
    left = budget_bytes
    for unit in sorted(units, key=lambda u: -(u.relative4 - u.relative8) / max(u.params * extra, 1.0)):
        if unit.relative4 > unit.relative8 and unit.params * extra <= left:
            unit.upgraded, left = True, left - unit.params * extra


def q4_k_m_budget(units: list[Unit], four: Width, eight: Width, block_size: int) -> float:
    """The bytes Q4_K_M's layout adds over all-4-bit: ``Q4_K_M_UNITS`` at 8 bits in ``use_more_bits`` layers."""
    layers = max((u.layer for u in units), default=-1) + 1
    extra = (bits_per_weight(eight, block_size) - bits_per_weight(four, block_size)) / 8
    return sum(u.params * extra for u in units if u.unit in Q4_K_M_UNITS and use_more_bits(u.layer, layers))


def calibration_windows(tokenizer_folder: Any, scheme: str = "int4-auto") -> list[list[int]]:
    """Every whole window of :data:`CALIBRATION_CONTEXT` tokens of the calibration text, tokenized by the
    model's tokenizer (``scheme``: the measured recipe asking, named where there is none)."""
    transformers = require("transformers", f"reading the calibration text (--quantize {scheme})")
    if tokenizer_folder is None or not any(Path(tokenizer_folder, f).is_file()
                                           for f in ("tokenizer.json", "tokenizer.model")):
        raise UserError(f"--quantize {scheme} measures the weights on the shipped calibration text and needs the "
                        f"model folder's tokenizer; this model has none (choose --quantize "
                        f"{RECIPES[scheme].unmeasured})")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder))
    ids = [int(t) for t in tokenizer(CALIBRATION_TEXT.read_text(encoding="utf-8"))["input_ids"]]
    windows = [ids[i:i + CALIBRATION_CONTEXT] for i in range(0, len(ids) - CALIBRATION_CONTEXT + 1,
                                                             CALIBRATION_CONTEXT)]
    if not windows:
        raise UserError(f"the calibration text is {len(ids)} tokens, shorter than one window of "
                        f"{CALIBRATION_CONTEXT}")
    return windows


#: Windows sampled from the model itself, beside the text: the calibration then also covers what the model
#: writes, not only legal English. Measured on SmolLM2-135M's int4-gptq: 8 windows took KL from 0.070 to
#: 0.057 on a Vim manual chapter (0.072 on the GPL either way; Gemma 3 270M's 0.062 -> 0.058 on the GPL);
#: 16 (with GPTQ's act order) from 0.053 to 0.050 on the Vim chapter and 0.063 to 0.062 on the GPL, for
#: about 30 s more export on 2 cores (``benchmarks/results/quant_quality*.md``).
GENERATED_WINDOWS, GENERATION_SEED, GENERATION_TOP_P = 16, 0, 0.95
CALIBRATION_SOURCE = "the shipped Apache License 2.0 (decoder/texts/Apache-2.0)"


def generated_windows(lm: torch.nn.Module, count: int = GENERATED_WINDOWS, *, seed: int = GENERATION_SEED,
                      context: int = CALIBRATION_CONTEXT) -> list[list[int]]:
    """``count`` windows of ``context`` tokens the model samples itself from its BOS token (nucleus
    sampling, top-p :data:`GENERATION_TOP_P`, seeded: the same model gives the same windows), decoded
    together in one batch with the model's cache."""
    config = lm.config
    start = next((t for t in (config.bos_token_id, config.eos_token_id, config.pad_token_id)
                  if isinstance(t, int)), 0)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((count, 1), start, dtype=torch.long)
    with torch.inference_mode():
        # the first step makes the family's own cache (a hybrid model's is not a DynamicCache); then it is
        # passed as ``cache=``, transformers 5's name
        out = lm(input_ids=ids, use_cache=True)
        for step in range(context - 1):
            if step:
                out = lm(input_ids=ids[:, -1:], cache=out.cache, use_cache=True)
            logits = out.logits[:, -1].double()
            if not bool(torch.isfinite(logits).all()):
                raise UserError("sampling calibration windows from the model gave non-finite logits: the model "
                                "overflows or its weights are damaged; check it with `validate` before quantizing")
            probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
            probs[probs.cumsum(-1) - probs > GENERATION_TOP_P] = 0.0
            ids = torch.cat([ids, order.gather(-1, torch.multinomial(probs, 1, generator=generator))], dim=1)
    return ids.tolist()


def calibration_set(lm: torch.nn.Module, tokenizer_folder: Any, scheme: str = "int4-auto"
                    ) -> tuple[list[list[int]], str]:
    """What a measured recipe calibrates on: the shipped text's windows and :data:`GENERATED_WINDOWS`
    the model samples (:func:`generated_windows`); and their description for the metadata."""
    text = calibration_windows(tokenizer_folder, scheme)
    sampled = generated_windows(lm)
    return text + sampled, (f"{CALIBRATION_SOURCE}, {len(text)} windows of {CALIBRATION_CONTEXT} tokens, and "
                            f"{len(sampled)} windows the model sampled from its BOS token (seed {GENERATION_SEED}, "
                            f"top-p {GENERATION_TOP_P})")


def measured(quantization: Any, lm: torch.nn.Module, windows: Sequence[Sequence[int]], *,
             source: str = CALIBRATION_SOURCE) -> Any:
    """``quantization`` (a measured recipe's) with its 8-bit units chosen on ``windows`` and the
    measurement recorded: what the export writes."""
    recipe = quantization.recipe
    if recipe.smoothed:
        raise ValueError(f"--quantize {quantization.scheme} is measured by quant_smoothing.smoothed")
    four, eight = recipe.width("o", 0, 1), recipe.upgrade
    quantizer = WeightQuantizer(quantization.block_size)
    gptq = four.method == "gptq"
    head_rows: list[torch.Tensor] | None = [] if recipe.width("head", 0, 1).per_channel else None
    moments = input_moments(lm, windows, head_inputs=head_rows)
    hessians = LayerHessians(lm, windows) if gptq else None  # refused here, measured as the writer asks
    # GPTQ's units are chosen by the fit it starts each block from (its error spreading, per weight, is slower)
    units = measure_units(lm, moments, quantizer, dataclasses.replace(four, method="fitzp") if gptq else four, eight)
    budget = q4_k_m_budget(units, four, eight, quantization.block_size)
    choose(units, four, eight, quantization.block_size, budget)
    record = {"calibration": source, "tokens": sum(len(w) for w in windows),
              "proxy": ("relative expected output error under the mean squared input per feature (of at most "
                        f"{PROXY_WEIGHTS} weights of a Linear: evenly spaced output rows, scaled to all of them)"),
              "budget": "the bytes Q4_K_M's layout adds (int4-mixed's 8-bit projections)",
              "budget_bytes": round(budget), "units": [u.to_dict() for u in units],
              "fit": ("GPTQ: each 4-bit block's rounding error spread over the features after it through the "
                      "inverse of the input's second moments, the most driven blocks and features first" if gptq else
                      "each 4-bit block's least squares weighted by the mean squared input per feature")}
    if hessians is not None:
        record["hessians"] = (f"measured {hessians.groups} group(s) of layers at a time, one calibration pass each "
                              f"(at most {HESSIAN_BYTES / 2**30:.0f} GiB held)")
    smoothing = None
    if head_rows:
        head = lm.get_output_embeddings()
        factors, record["head"] = head_smoothing(head, torch.cat(head_rows))
        smoothing = {next(p for p, m in lm.named_modules() if m is head): factors}
    upgrades = tuple((u.unit, u.layer) for u in units if u.upgraded)
    importance = hessians if hessians is not None else {path: m.double().numpy() for path, m in moments.items()}
    return dataclasses.replace(quantization, upgrades=upgrades, measurement=record, importance=importance,
                               smoothing=smoothing)


#: SmoothQuant's migration strengths a per-channel head's smoothing is chosen from (0: the weight's columns
#: alone set the factors): the head's
#: input has a few features tens of times larger than the rest (SmolLM2-135M's final norm: 53 against a
#: median 4), which would set every row's int8 step; dividing feature k by ``max|x_k|^a / max|W_k|^(1-a)``
#: and multiplying the weight's column by it moves them into the weight's per-row scales.
SMOOTHING_STRENGTHS = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6)
#: How many of the calibration set's head input rows the strengths are compared on (evenly spaced).
SMOOTHING_ROWS = 256


def smoothing_factors(x_absmax: np.ndarray, w_absmax: np.ndarray, strength: float) -> np.ndarray:
    """The factor [K] an input is multiplied by (a per-channel head's, or ``int8-smooth``'s projections':
    ``quant_smoothing``) and its weight's input rows divided by (``1 / s_k``, SmoothQuant's
    ``s_k = max|x_k|^a / max|W_k|^(1-a)``, scaled to a geometric mean of 1); 1 where a feature or its
    weight column is never non-zero."""
    x = np.asarray(x_absmax, np.float64)
    w = np.asarray(w_absmax, np.float64)
    live = (x > 0) & (w > 0)
    s = np.ones_like(x)
    s[live] = x[live] ** strength / w[live] ** (1.0 - strength)
    if live.any():
        s[live] /= np.exp(np.mean(np.log(s[live])))
    return (1.0 / s).astype(np.float32)


def head_smoothing(head: torch.nn.Linear, rows: torch.Tensor) -> tuple[np.ndarray, dict[str, Any]]:
    """The smoothing of a per-channel head (``quantize.channel_head``) with the least mean KL divergence
    of its token distributions from the float head's, over :data:`SMOOTHING_ROWS` of the calibration
    set's head inputs ``rows`` [T, K], among :data:`SMOOTHING_STRENGTHS`; and what was measured."""
    if not bool(torch.isfinite(rows).all()):
        raise UserError("the calibration set drove the LM head's input to non-finite values: the model overflows "
                        "or its weights are damaged; check it with `validate` before quantizing")
    weight = head.weight.detach().float()
    sample = rows[torch.linspace(0, len(rows) - 1, min(SMOOTHING_ROWS, len(rows))).long()]
    x_absmax, w_absmax = rows.abs().amax(0).numpy(), weight.abs().amax(0).numpy()
    reference = [torch.log_softmax(chunk @ weight.T, dim=-1) for chunk in sample.split(64)]
    kl: dict[float, float] = {}
    best: tuple[float, np.ndarray] | None = None
    for strength in SMOOTHING_STRENGTHS:
        factors = smoothing_factors(x_absmax, w_absmax, strength)
        q, scales = quantize_channel(weight.numpy(), factors)
        table, scale, smooth = torch.from_numpy(q), torch.from_numpy(scales), torch.from_numpy(factors)
        total = 0.0
        for chunk, ref in zip(sample.split(64), reference):
            got = torch.log_softmax(channel_head(chunk, table, scale, smooth, exact=False), dim=-1)
            total += float((ref.exp() * (ref - got)).sum())
        kl[strength] = total / len(sample)
        if best is None or kl[strength] < kl[best[0]]:
            best = (strength, factors)
    assert best is not None
    return best[1], {"smoothing_strength": best[0], "rows": len(sample),
                     "kl_by_strength": {f"{a:g}": round(v, 6) for a, v in kl.items()},
                     "proxy": "mean KL divergence of the per-channel head's token distributions from the float "
                              "head's on the calibration set's head inputs"}
