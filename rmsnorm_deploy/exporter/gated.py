"""Gated and gainless RMS norms of transformers' hybrid families: their known classes, and the
candidate specs probing can try on a gated norm it does not know.

A gated norm takes a second input ``z`` and multiplies by an activation of it before or after
the normalization (``RMSNormSpec.gate``/``gate_placement``); some normalize the last dim per
group (``group_size``). What each class computes (transformers 5.24, each confirmed bit for bit
by ``tests/exporter/test_gated.py`` in float32, float16 and bfloat16):

=====================================  =======================================================
``MambaRMSNormGated`` (Mamba2), Bamba,  ``x * silu(z)`` in float32, normalized per group of
Zamba2, Nemotron-H, GraniteMoeHybrid    ``group_size``, rounded, times ``w``
                                        (:meth:`RMSNormSpec.mamba2_gated`)
``FalconH1RMSNormGated``                per group of ``dim / n_groups``, ``w`` in float32, gate
                                        after (``norm_before_gate``) or before the norm, one rounding
``Qwen3NextRMSNormGated``, Qwen3.5,     the Llama norm rounded, times ``silu(z)`` in float32,
Qwen3.5-MoE, OLMo-Hybrid, Qwen4-Exp     rounded again (:meth:`RMSNormSpec.qwen3_next_gated`)
``KimiLinearRMSNormGated``,             ``w`` and ``sigmoid(z)`` (LaraMini: ``silu``) in float32,
Bailing-Hybrid, GLM-5-Next, LaraMini    one rounding (:meth:`RMSNormSpec.kimi_gated`)
``Gemma3nRMSNorm``, ``Gemma4RMSNorm``   the OLMo2 norm; ``with_scale=False`` (the value norm) has
and their copies                        no gain and no width attribute
=====================================  =======================================================

``AXK2GatedRMSNorm`` is not a gated norm in this sense: it is an ordinary RMSNorm whose output
feeds a small MLP that gates it; only its inner norm is one.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from rmsnorm_deploy.contract.spec import GATE_PLACEMENTS, GATES, ORDERS, RMSNormSpec
from rmsnorm_deploy.errors import UserError

#: Width at which a known gainless class without a width attribute is confirmed: its
#: computation does not depend on the width (no parameter has it).
PROBE_WIDTH = 64


def _group_size(module: Any, groups: int | None = None) -> int | None:
    """The module's group size, or ``None`` when one group spans the whole last dim."""
    width = int(module.weight.shape[-1])
    size = width // int(groups) if groups is not None else int(module.group_size)
    return None if size == width else size


def _activation(module: Any) -> str:
    act = str(getattr(module, "activation", "silu"))
    if act not in GATES[1:]:
        raise UserError(f"{type(module).__name__} gates with the activation {act!r}; the contract knows "
                        f"{', '.join(GATES[1:])}")
    return act


def _mamba2(module: Any, dtype: torch.dtype) -> RMSNormSpec:
    return RMSNormSpec.mamba2_gated(module.variance_epsilon, _group_size(module))


def _falcon_h1(module: Any, dtype: torch.dtype) -> RMSNormSpec:
    return RMSNormSpec(module.variance_epsilon, 1, "weight", "scale_then_cast", gate="silu",
                       gate_placement="after_norm" if module.norm_before_gate else "before_norm",
                       group_size=_group_size(module, module.n_groups))


def _qwen3_next(module: Any, dtype: torch.dtype) -> RMSNormSpec:
    return RMSNormSpec(module.variance_epsilon, 1, "weight", "cast_then_scale", gate=_activation(module),  # type: ignore[arg-type]
                       gate_placement="after_cast")


def _kimi(module: Any, dtype: torch.dtype) -> RMSNormSpec:
    return RMSNormSpec.kimi_gated(module.variance_epsilon, gate=_activation(module))  # type: ignore[arg-type]


def _gemma3n(module: Any, dtype: torch.dtype) -> RMSNormSpec:
    # x * pow(ms + eps, -0.5) in float32 (torch's pow(., -0.5) is its rsqrt), w in float32, one rounding.
    return RMSNormSpec(module.eps, 1, "weight" if module.with_scale else "none", "scale_then_cast")


_HF = "transformers.models"
#: exact class (module.qualname) -> spec of a module of that class; merged into detect.KNOWN_CLASSES.
GATED_CLASSES: dict[str, Callable[[Any, torch.dtype], RMSNormSpec]] = {
    f"{_HF}.mamba2.modeling_mamba2.MambaRMSNormGated": _mamba2,
    f"{_HF}.bamba.modeling_bamba.BambaRMSNormGated": _mamba2,
    f"{_HF}.zamba2.modeling_zamba2.Zamba2RMSNormGated": _mamba2,
    f"{_HF}.nemotron_h.modeling_nemotron_h.NemotronHRMSNormGated": _mamba2,
    f"{_HF}.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridRMSNormGated": _mamba2,
    f"{_HF}.falcon_h1.modeling_falcon_h1.FalconH1RMSNormGated": _falcon_h1,
    f"{_HF}.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated": _qwen3_next,
    f"{_HF}.qwen3_5.modeling_qwen3_5.Qwen3_5RMSNormGated": _qwen3_next,
    f"{_HF}.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeRMSNormGated": _qwen3_next,
    f"{_HF}.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridRMSNormGated": _qwen3_next,
    f"{_HF}.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextRMSNormGated": _qwen3_next,
    f"{_HF}.kimi_linear.modeling_kimi_linear.KimiLinearRMSNormGated": _kimi,
    f"{_HF}.bailing_hybrid.modeling_bailing_hybrid.BailingHybridRMSNormGated": _kimi,
    f"{_HF}.glm5_next.modeling_glm5_next.Glm5NextTextRMSNormGated": _kimi,
    f"{_HF}.lara_mini.modeling_lara_mini.LaraMiniRMSNormGated": _kimi,
}
GAINLESS_CAPABLE_CLASSES: dict[str, Callable[[Any, torch.dtype], RMSNormSpec]] = {
    f"{_HF}.gemma3n.modeling_gemma3n.Gemma3nRMSNorm": _gemma3n,
    f"{_HF}.gemma4.modeling_gemma4.Gemma4RMSNorm": _gemma3n,
    f"{_HF}.gemma4_unified.modeling_gemma4_unified.Gemma4UnifiedRMSNorm": _gemma3n,
    f"{_HF}.diffusion_gemma.modeling_diffusion_gemma.DiffusionGemmaRMSNorm": _gemma3n,
    f"{_HF}.embedding_gemma2.modeling_embedding_gemma2.EmbeddingGemma2RMSNorm": _gemma3n,
}


def gate_input(spec: RMSNormSpec, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """A seeded gate input for ``x`` (``None`` for an ungated spec): N(0, 3^2), so the activation
    is exercised from its small tail (``silu(-9)``) to its linear part."""
    if not spec.has_gate:
        return None
    z = torch.randn(x.shape, generator=generator, dtype=torch.float32) * 3.0
    return z.to(x.dtype)


def check_gate_call(spec: RMSNormSpec, gate: torch.Tensor | None, name: str) -> None:
    """Refuse a norm called without the gate its spec has, or with one it does not have: the gated
    classes accept ``gate=None`` and then compute another norm, which the export must not hide."""
    if spec.has_gate != (gate is not None):
        raise UserError(f"norm {name!r} ({spec.describe()}) was called "
                        + ("without its gate input" if spec.has_gate else "with a gate input its spec does not have"))


def call_norm(module: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor | None) -> Any:
    """Run a norm module on ``x`` and, for a gated one, its gate (second positional input)."""
    return module(x) if gate is None else module(x, gate)


def gated_candidates(epsilon: float, width: int, *, group_sizes: tuple[int | None, ...] = (None,),
                     gains: tuple[str, ...] = ("weight", "none")) -> list[RMSNormSpec]:
    """Every gated spec probing should try on a two-input norm of ``width`` with ``epsilon``:
    activation x placement x rounding order x gain x group size (sizes that do not divide
    ``width`` are left out). Specs that compute the same numbers (the order without a gain) appear once."""
    seen: dict[RMSNormSpec, None] = {}
    for gate, placement, order, gain, size in itertools.product(GATES[1:], GATE_PLACEMENTS, ORDERS, gains,
                                                                 group_sizes):
        if size is not None and (size < 1 or width % size):
            continue
        spec = RMSNormSpec(epsilon, 1, gain, order if gain != "none" else "scale_then_cast",  # type: ignore[arg-type]
                           gate=gate, gate_placement=placement,  # type: ignore[arg-type]
                           group_size=None if size == width else size)
        seen.setdefault(spec, None)
    return list(seen)
