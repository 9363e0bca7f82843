"""gpt-oss: per-head attention sinks (GroupQueryAttention's ``head_sink``), sliding and full layers
alternating (``layer_types``), q/k/v/o biases, and a mixture of experts in every layer: a router
with a bias, top-k of the logits then a softmax over them, experts with biases and a SwiGLU whose
gate and up are clamped to ``swiglu_limit`` (``(up + 1) * gate * sigmoid(alpha * gate)``), their
weights stored transposed with gate and up interleaved."""

from __future__ import annotations

from typing import Any

from rmsnorm_deploy.decoder.families.base import MoEFamily


class GptOss(MoEFamily):
    def swiglu(self, config: Any) -> tuple[float, float, float | None]:
        # GptOssExperts._apply_gate: gate.clamp(max=limit), up.clamp(-limit, limit),
        # (up + 1) * gate * sigmoid(alpha * gate)
        return float(config.swiglu_alpha), 1.0, float(config.swiglu_limit)


FAMILY = GptOss("gpt_oss", sinks="sinks", router="router", experts_transposed=True, gate_up_interleaved=True,
                expert_bias=True)
