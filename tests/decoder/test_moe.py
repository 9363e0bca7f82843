"""Mixtures of experts beyond the family table: int8-compute QMoE against its rounded reference,
the kernel's limits refused in one line, and experts stored apart that do not add up."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models")
pytest.importorskip("onnxruntime", reason="the graphs run in ONNX Runtime")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from rmsnorm_deploy.decoder.ort_graph import build_decoder  # noqa: E402
from rmsnorm_deploy.decoder.ort_model import OrtDecoderError  # noqa: E402
from rmsnorm_deploy.decoder.ort_parity import decode_parity  # noqa: E402
from rmsnorm_deploy.decoder.quantize import Quantization  # noqa: E402
from rmsnorm_deploy.decoder.weights import CheckpointError, SafetensorsTensors  # noqa: E402
from rmsnorm_deploy.exporter import hf  # noqa: E402
from tests.decoder.families import ROWS  # noqa: E402


def _loaded(name: str):
    return hf.from_config(next(r for r in ROWS if r.name == name).config, "float32", seed=0)


def test_int8_compute_qmoe_matches_the_reference_rounding_its_expert_inputs():
    """QMoE at accuracy_level 4 rounds each expert's input and activated intermediate to int8 per block;
    the reference does the same (``quantize._dequantized_experts``): within float rounding, not int8's."""
    loaded = _loaded("qwen3_moe")
    dec = build_decoder(loaded, quantization=Quantization("int4", 32, 4), max_length=64)
    assert any(n.op_type == "QMoE" for n in dec.model.graph.node)
    parity = decode_parity(loaded, dec.model, batch=2, prompt=9, steps=2)
    assert not parity.failed, parity.table()
    assert max(r.max_abs for r in parity.results[1:]) < 1e-5, parity.table()


@pytest.mark.parametrize("quantization, message", [
    (Quantization("int8", 32, 0), "QMoE computes int8 experts with int8 activations on CPU whatever the accuracy "
                                  "level; export this mixture-of-experts model at int8 with --accuracy-level 4"),
    (Quantization("int4", 64, 4), "to be multiples of the block size 64; choose a smaller --block-size"),
])
def test_what_qmoe_cannot_compute_exactly_is_refused_in_one_line(quantization, message):
    with pytest.raises(OrtDecoderError, match=message) as info:
        build_decoder(_loaded("qwen3_moe"), quantization=quantization)
    assert "\n" not in str(info.value)


def test_experts_stored_apart_that_do_not_add_up_are_one_line(tmp_path):
    tensors = {f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.zeros(8, 4)
               for e in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")}
    del tensors["model.layers.0.mlp.experts.1.up_proj.weight"]
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.experts does not hold gate_proj, up_proj and "
                                              "down_proj for experts 0..1; is the checkpoint complete"):
        SafetensorsTensors(tmp_path, experts=("mlp", "gate_proj", "up_proj", "down_proj"))
