"""``rmsnorm-deploy export`` on a real checkpoint: SmolLM2-135M-Instruct, 30 trained layers.

Each export the suite makes of it (``tests/real_weights.py``: plain, ONNX Runtime KV-cache graph
in float32, int8 and int4; made once per run, shared) must exit 0
with a report whose parity check passed on numbers it holds: every checked comparison with a
finite distance and nothing out of tolerance, greedy tokens equal to the reference's. A quantized
export's report names its recipe and what quantization cost against the unquantized model.
"""

from __future__ import annotations

import json
import math

import pytest
from tests.real_weights import EXPORTS

from rmsnorm_deploy.decoder.quantize import Quantization

pytest.importorskip("transformers", reason="transformers loads the checkpoint the exports are held to")
pytest.importorskip("onnxruntime", reason="the export-time parity check runs ONNX Runtime CPU")
pytestmark = pytest.mark.slow  # the exports of a 135M model, made once per run

QUANTIZED = {"kv-ort-int8": "int8", "kv-ort-int4": "int4"}
VOCABULARY = 49152


def _projection_weights(config: dict) -> int:
    """How many weights the projections of every layer hold: q, k, v, o, gate, up, down (what
    ``--quantize`` quantizes; the LM head stays float by default)."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    attention = hidden * head_dim * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    return config["num_hidden_layers"] * (attention + 3 * hidden * config["intermediate_size"])


def _checked_comparisons(parity: dict) -> list[dict]:
    """The comparisons a report's parity verdict rests on: the plain and portable graphs'
    ``comparisons`` marked checked, the ONNX Runtime graph's per-step logits (``steps``; a quantized
    graph's weight check, which has no distances, is left to its own test)."""
    if "comparisons" in parity:
        return [c for c in parity["comparisons"] if c["checked"]]
    return [s for s in parity["steps"] if "max_abs" in s]


@pytest.mark.parametrize("kind", list(EXPORTS))
def test_the_export_exits_0_and_its_report_says_parity_passed(real_weights, kind):
    export = real_weights.export(kind)
    assert export.exit_code == 0, f"export exited {export.exit_code}:\n{export.output[-3000:]}"
    parity = export.report["parity"]
    assert parity["status"] == "pass", parity.get("reason") or parity
    verdict = "parity: PASS" if "comparisons" in parity else "greedy tokens equal to the reference: True"
    assert verdict in export.output
    checked = _checked_comparisons(parity)
    assert any(c["name"].startswith("logits") and c["shape"][-1] == VOCABULARY for c in checked), \
        "the report holds no checked comparison of the vocabulary's logits: zero comparisons is not a pass"
    for c in checked:
        label = c.get("label", c["name"])
        assert c["passed"] and c["bad_count"] == 0, f"{label}: {c}"
        assert c["nan_mismatch"] == 0 and c["inf_mismatch"] == 0, f"{label}: {c}"
        assert isinstance(c["max_abs"], float) and math.isfinite(c["max_abs"]) and c["max_abs"] >= 0, f"{label}: {c}"
    if "tokens_equal" in parity:  # the KV-cache graphs decode too
        assert parity["tokens_equal"] is True


@pytest.mark.parametrize("kind", list(QUANTIZED))
def test_a_quantized_report_names_its_recipe_and_its_distance_to_the_unquantized_model(real_weights, kind):
    export = real_weights.export(kind)
    report = export.report
    recipe = Quantization(QUANTIZED[kind]).describe()  # the export's defaults
    assert report["quantization"] == recipe
    assert recipe in export.output
    parity = report["parity"]
    assert "dequantized from the graph" in parity["reference"]
    weights = parity["steps"][0]
    config = json.loads((export.folder / "config.json").read_text())
    assert weights["passed"] and weights["weights"] == _projection_weights(config), weights
    cost = parity["vs_unquantized"]
    steps = len(_checked_comparisons(parity))
    assert len(cost["max_abs"]) == steps >= 2
    assert all(isinstance(d, float) and 0 < d < cost["logit_scale"] for d in cost["max_abs"]), cost
    assert 0 <= cost["same_argmax"] <= 1
    assert "vs the unquantized model (what quantization costs, not checked)" in export.output


def test_int8_costs_less_than_int4_against_the_unquantized_model(real_weights):
    int8, int4 = (real_weights.export(kind).report["parity"]["vs_unquantized"] for kind in QUANTIZED)
    assert max(int8["max_abs"]) < max(int4["max_abs"])
    assert int8["same_argmax"] >= int4["same_argmax"]


def test_a_quantized_export_measures_its_cost_on_text(real_weights):
    """Beside its parity, each quantized export reports its perplexity and KL divergence against the
    unquantized model (transformers float32) on the shipped text: int8 costs less than int4."""
    int8, int4 = (real_weights.export(kind).report["vs_unquantized_on_text"] for kind in QUANTIZED)
    for cost in (int8, int4):
        assert cost["measured"] and cost["chunks"] == 4 and cost["scored_tokens"] == 4 * 127, cost
        assert "float32" in cost["reference"] and math.isfinite(cost["perplexity"]), cost
    assert int8["reference_perplexity"] == pytest.approx(int4["reference_perplexity"], rel=1e-6)
    assert 0 < int8["kl_mean"] < int4["kl_mean"] and int8["same_top"] > int4["same_top"]
    assert "vs the unquantized model on text" in real_weights.export("kv-ort-int4").output
