"""The family table: one row per case ``--target onnxruntime`` writes, each a tiny random config
(2 layers, hidden 64, vocabulary 256; ``hf.from_config`` moves every norm gain off its initial
value) that exercises what its family module writes. ``tests/decoder/test_families.py`` holds
every row to transformers; adding a family is its module and a row here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rmsnorm_deploy.exporter.hf import TINY_CONFIGS

_BASE = TINY_CONFIGS["llama"]
#: Special tokens inside the tiny vocabulary, for configs whose defaults lie outside it.
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
#: The sliding window of the windowed rows: the past-window test prompts longer than it.
WINDOW = 8
#: LongRoPE's switch in the LongRoPE rows: the tests' prompts (9 tokens) start short and cross it while
#: decoding (the step test on its 4th step, with the shorter rows of the batch).
LONGROPE_SWITCH = 12


def _longrope(rotary_half: int) -> dict[str, Any]:
    """Phi-3.5-mini's rotary fields at a tiny scale: short and long factors far apart (a wrong table
    is far off), max_position_embeddings / original = 64 / 12 sets attention_scaling (1.30)."""
    return {"max_position_embeddings": 64, "original_max_position_embeddings": LONGROPE_SWITCH,
            "rope_scaling": {"rope_type": "longrope",
                             "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                             "long_factor": [1.0 + 3.0 * i for i in range(rotary_half)]}}


@dataclasses.dataclass(frozen=True)
class FamilyRow:
    """One tiny model of a family and what its graph must hold."""

    name: str  # the test id
    config: dict[str, Any]
    norms: int  # norm modules of the config, every one our exact node in the graph
    window: int | None = None  # its sliding window: the past-window test prompts past it
    genai: bool = False  # onnxruntime-genai 0.18 runs the folder (it knows the model type)

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])


def tiny_config(model_type: str, **fields: Any) -> dict[str, Any]:
    return {**_BASE, **_TOKENS, "model_type": model_type, **fields}


ROWS: list[FamilyRow] = [
    FamilyRow("llama", tiny_config("llama"), norms=5, genai=True),
    FamilyRow("mistral", tiny_config("mistral", sliding_window=None), norms=5, genai=True),
    FamilyRow("mistral-window", tiny_config("mistral", sliding_window=WINDOW), norms=5, window=WINDOW, genai=True),
    FamilyRow("qwen2", tiny_config("qwen2"), norms=5, genai=True),
    FamilyRow("qwen2-window", tiny_config("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
              norms=5, window=WINDOW, genai=True),
    FamilyRow("qwen3", tiny_config("qwen3", head_dim=16), norms=9, genai=True),
    FamilyRow("olmo2", tiny_config("olmo2"), norms=9),
    FamilyRow("gemma", tiny_config("gemma", head_dim=16), norms=5, genai=True),
    # Weights large enough (initializer_range 0.2) that both caps bend the scores and logits (without
    # the attention cap the logits move by 0.9, without the final one by 8): a cap left out fails.
    # query_pre_attn_scalar 24, not head_dim 16: the attention scale is the module's.
    FamilyRow("gemma2", tiny_config("gemma2", head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "full_attention"], initializer_range=0.2,
                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
              norms=9, window=WINDOW, genai=True),
    FamilyRow("gemma3", tiny_config("gemma3_text", head_dim=16, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "full_attention"]),
              norms=13, window=WINDOW, genai=True),
    # multipliers far from 1, so that any one left out moves the logits
    FamilyRow("granite", tiny_config("granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                                 attention_multiplier=0.0078125, logits_scaling=8.0), norms=5, genai=True),
    FamilyRow("smollm3", tiny_config("smollm3", no_rope_layer_interval=2), norms=5, genai=True),
    FamilyRow("smollm3-window", tiny_config("smollm3", no_rope_layers=[0, 1], use_sliding_window=True,
                                        sliding_window=WINDOW), norms=5, window=WINDOW, genai=True),
    FamilyRow("ernie4_5", tiny_config("ernie4_5", head_dim=16, use_bias=True), norms=5, genai=True),
    FamilyRow("hunyuan_v1_dense", tiny_config("hunyuan_v1_dense", head_dim=16), norms=9),
    FamilyRow("internlm3", tiny_config("internlm3", head_dim=16, qkv_bias=True, bias=True), norms=5),
    FamilyRow("seed_oss", tiny_config("seed_oss", head_dim=16, attention_bias=True, attention_out_bias=True), norms=5),
    FamilyRow("ministral-window", tiny_config("ministral", head_dim=16, sliding_window=WINDOW,
                                              layer_types=["sliding_attention", "full_attention"]),
              norms=5, window=WINDOW),
    FamilyRow("helium", tiny_config("helium", head_dim=16), norms=5),
    FamilyRow("exaone4-window", tiny_config("exaone4", head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2),
              norms=9, window=WINDOW),
    FamilyRow("olmo3-window", tiny_config("olmo3", sliding_window=WINDOW,
                                          layer_types=["sliding_attention", "full_attention"]),
              norms=9, window=WINDOW),
    # mixtures of experts: 4 experts, top 2; Qwen3-MoE with a dense layer among sparse ones
    FamilyRow("qwen3_moe", tiny_config("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]), norms=9),
    FamilyRow("qwen3_moe-unnormalized",
              tiny_config("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          norm_topk_prob=False, decoder_sparse_step=2), norms=9),
    FamilyRow("mixtral-window", tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2,
                                            intermediate_size=64, sliding_window=WINDOW), norms=5, window=WINDOW),
    # gpt-oss: a limit the tiny gate/up values reach, sinks far from zero, YaRN within the tiny context
    FamilyRow("gpt_oss", tiny_config("gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=32, sliding_window=WINDOW, swiglu_limit=0.5,
                                     initializer_range=0.1,
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0,
                                                      "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                      "beta_slow": 1.0}),
              norms=5, window=WINDOW),
    # Phi-3-mini-4k: a sliding window on every layer (transformers masks it: sliding_window < positions)
    FamilyRow("phi3", tiny_config("phi3", sliding_window=WINDOW), norms=5, window=WINDOW, genai=True),
    # onnxruntime-genai runs these graphs but recomputes its cache at a fixed 4097 tokens, not at the
    # tiny switch: test_longrope_graph_runs_in_genai holds it to our loop without the recompute
    FamilyRow("phi3-longrope", tiny_config("phi3", **_longrope(8)), norms=5),
    # Phi-4-mini: LongRoPE on 3/4 of each head (48 of 64 dims), 2 query heads over 1 KV head
    FamilyRow("phi3-partial-rotary", tiny_config("phi3", hidden_size=128, num_attention_heads=2,
                                                 num_key_value_heads=1, partial_rotary_factor=0.75, **_longrope(24)),
              norms=5),
]
