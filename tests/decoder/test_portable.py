"""`export --kv-cache`: the graph follows the convention, every norm is our node, parity and the files beside it."""

from __future__ import annotations

import json

import pytest
import torch

from rmsnorm_deploy.errors import OutputExistsError, UserError
from rmsnorm_deploy.decoder.convention import KVCacheLayout, check_io, graph_io, layout_of
from rmsnorm_deploy.decoder.portable import layout_for
from rmsnorm_deploy.exporter.loaded_model import LoadedModel, TokenLogits
from rmsnorm_deploy.decoder.export import plan_decoder_export
from rmsnorm_deploy.exporter.plan import ExportOptions, plan_export
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_file import load_onnx


def test_a_model_without_a_cache_is_refused_before_export():
    loaded = LoadedModel("plain", TokenLogits(torch.nn.Linear(4, 4)), "float32", {"kind": "test"}, 4, 8)
    with pytest.raises(UserError, match="--kv-cache needs a causal LM with a key/value cache"):
        layout_for(loaded, "float32")


def test_the_files_beside_the_model_are_never_clobbered_without_force(tmp_path):
    (tmp_path / "genai_config.json").write_text("{}")
    with pytest.raises(OutputExistsError, match="genai_config.json"):
        plan_decoder_export(ExportOptions(), model_path=tmp_path / "model.onnx")
    plan_decoder_export(ExportOptions(force=True), model_path=tmp_path / "model.onnx")
    plan_export(ExportOptions(), model_path=tmp_path / "model.onnx")  # only KV exports write it


def test_the_preset_cache_path_equals_the_full_forward():
    from rmsnorm_deploy.exporter import presets
    from rmsnorm_deploy.decoder.convention import left_padded, position_ids_for

    loaded = presets.build_preset(presets.load_preset("tiny"), "float32")
    inner, lay = layout_for(loaded, "float32")
    ids = torch.randint(0, lay.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = inner(ids)
        empty = [torch.zeros(2, lay.kv_heads, 0, lay.head_dim) for _ in lay.past_names()]
        mask = torch.ones(2, 9, dtype=torch.int64)
        first, presents = inner.forward_cached(ids[:, :6], mask[:, :6], torch.from_numpy(
            position_ids_for(mask[:, :6].numpy(), 6)), empty)
        second, presents = inner.forward_cached(ids[:, 6:], mask, torch.from_numpy(position_ids_for(mask.numpy(), 3)),
                                                presents)
        # a left-padded row computes what the unpadded row computes
        padded_ids, padded_mask = left_padded([ids[1, :6].tolist()], 0)
        padded_ids = torch.cat([torch.zeros(1, 2, dtype=torch.int64), torch.from_numpy(padded_ids)], dim=1)
        padded_mask = torch.cat([torch.zeros(1, 2, dtype=torch.int64), torch.from_numpy(padded_mask)], dim=1)
        padded, _ = inner.forward_cached(padded_ids, padded_mask, torch.from_numpy(
            position_ids_for(padded_mask.numpy(), 8)), [t[:1] for t in empty])
    torch.testing.assert_close(first, full[:, :6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, full[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[:, 2:], full[1:, :6], atol=1e-5, rtol=1e-5)
    assert [tuple(p.shape) for p in presents[:2]] == [(2, lay.kv_heads, 9, lay.head_dim)] * 2


pytest.importorskip("transformers", reason="the KV-cache export tests use tiny transformers models")
pytest.importorskip("onnxruntime", reason="export-time parity runs ONNX Runtime")


@pytest.mark.slow  # one shared torch.onnx export per family (tests/kv_models.py)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "olmo2"])
def test_kv_export_follows_the_convention_with_exact_norms(family):
    from tests.kv_models import exported_kv, hf_model

    from rmsnorm_deploy.exporter.pipeline import norm_node_count

    folder, result = exported_kv(family)
    model = load_onnx(folder / "model.onnx", load_external=False)
    meta = ModelMetadata.read(model)
    layout = layout_of(meta)
    assert layout == KVCacheLayout.from_hf_config(hf_model(family).config, "float32")
    check_io(layout, *graph_io(model))
    assert norm_node_count(model) == len(result.detection.norms)
    assert meta.inputs["past_key_values.0.key"]["kind"] == "kv_cache"
    assert meta.dims["past"][0] == 0 and meta.dims["sequence"][2] == layout.max_length
    assert result.parity.status == "pass", result.parity.reason
    compared = {c.result.name for c in result.parity.comparisons if c.checked}
    assert {"logits", "present.0.key", f"present.{layout.num_layers - 1}.value"} <= compared
    shapes = result.parity.inputs["past_key_values.0.key"]
    assert shapes[0][2] == 0 and shapes[1][2] > 0  # a prefill (empty past) and a decode step were compared
    report = json.loads((folder / "report.json").read_text())
    assert report["kv_cache"]["head_dim"] == layout.head_dim
    genai = json.loads((folder / "genai_config.json").read_text())
    assert genai["search"]["past_present_share_buffer"] is False
    assert genai["model"]["decoder"]["filename"] == "model.onnx"
    assert json.loads((folder / "config.json").read_text())["model_type"] == hf_model(family).config.model_type


@pytest.mark.slow  # a torch.onnx export of the tiny preset through the CLI
def test_export_kv_cache_of_a_preset_through_the_cli(tmp_path, capsys):
    from rmsnorm_deploy.cli import main
    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate

    out = tmp_path / "tiny-kv"
    assert main(["export", "tiny", "--kv-cache", "-o", str(out), "--seq", "8"]) == 0
    printed = capsys.readouterr().out
    assert "parity: PASS" in printed and "KV cache: 2 layers" in printed and "genai_config.json" in printed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "genai_config.json", "model.onnx", "report.json"]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    with KVCacheModel(out) as kv:
        tokens = generate(kv, [[1, 2, 3], [4]], max_new_tokens=4, eos_token_id=None).tokens
    assert len(tokens) == 2 and all(len(t) == 4 for t in tokens)


def _cache_attention_graph(is_causal: int = 0):
    from onnx import TensorProto as TP
    from onnx import helper

    f = TP.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, ["b", 4, "s", 8]),
              helper.make_tensor_value_info("k", f, ["b", 2, "s", 8]),
              helper.make_tensor_value_info("v", f, ["b", 2, "s", 8]),
              helper.make_tensor_value_info("mask", TP.BOOL, ["b", 1, "s", "t"]),
              helper.make_tensor_value_info("past_key_values.0.key", f, ["b", 2, "p", 8]),
              helper.make_tensor_value_info("past_key_values.0.value", f, ["b", 2, "p", 8])]
    outputs = [helper.make_tensor_value_info("y", f, ["b", 4, "s", 8]),
               helper.make_tensor_value_info("present.0.key", f, ["b", 2, "t", 8]),
               helper.make_tensor_value_info("present.0.value", f, ["b", 2, "t", 8])]
    nodes = [helper.make_node("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=2),
             helper.make_node("Concat", ["past_key_values.0.value", "v"], ["present.0.value"], axis=2),
             helper.make_node("Attention", ["q", "present.0.key", "present.0.value", "mask"], ["y"],
                              is_causal=is_causal)]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


@pytest.mark.parametrize("past", [0, 3])
def test_attention_takes_the_cache_as_past_and_present(past):
    import numpy as np
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    from rmsnorm_deploy.exporter.fusions import attention_with_cache

    before = _cache_attention_graph()
    model = ir.serde.deserialize_model(before)
    assert attention_with_cache(model) == 1
    after = ir.serde.serialize_model(model)
    onnx.checker.check_model(after, full_check=True)
    assert [n.op_type for n in after.graph.node] == ["Attention"]
    assert list(after.graph.node[0].input[4:]) == ["past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in after.graph.output] == ["y", "present.0.key", "present.0.value"]
    rng = np.random.default_rng(past)
    s = 2
    feed = {"q": rng.standard_normal((2, 4, s, 8)), "k": rng.standard_normal((2, 2, s, 8)),
            "v": rng.standard_normal((2, 2, s, 8)), "past_key_values.0.key": rng.standard_normal((2, 2, past, 8)),
            "past_key_values.0.value": rng.standard_normal((2, 2, past, 8))}
    feed = {k: v.astype(np.float32) for k, v in feed.items()}
    mask = np.ones((2, 1, s, past + s), dtype=bool)
    mask[0, :, :, 0] = past == 0  # a padded first key where there is a past
    feed["mask"] = mask
    want = ort.InferenceSession(before.SerializeToString()).run(None, feed)
    got = ort.InferenceSession(after.SerializeToString()).run(None, feed)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_causal_attention_keeps_its_concatenation():
    import onnx_ir as ir

    from rmsnorm_deploy.exporter.fusions import attention_with_cache

    model = ir.serde.deserialize_model(_cache_attention_graph(is_causal=1))
    assert attention_with_cache(model) == 0
    assert [n.op_type for n in model.graph] == ["Concat", "Concat", "Attention"]


@pytest.mark.slow  # one torch.onnx export of the tiny Llama with --fuse-attention
def test_fused_kv_export_generates_the_tokens_of_the_plain_graph():
    import onnx
    from tests.kv_models import exported_kv

    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate

    fused, result = exported_kv("llama", fuse_attention=True)
    plain, _ = exported_kv("llama")
    assert result.parity.status == "pass", result.parity.reason
    layers = result.report["kv_cache"]["num_layers"]
    assert result.fusions.with_cache == result.fusions.attention == layers == result.report["fusions"]["with_cache"]
    graph = onnx.load(str(fused / "model.onnx"), load_external_data=False).graph
    attention = [n for n in graph.node if n.op_type == "Attention"]
    assert all(len(n.output) == 3 and n.input[4].startswith("past_key_values.") for n in attention)
    prompts = [[5, 17, 99, 3], [11, 12]]
    with KVCacheModel(fused) as a, KVCacheModel(plain) as b:
        assert generate(a, prompts, max_new_tokens=16).tokens == generate(b, prompts, max_new_tokens=16).tokens


@pytest.mark.slow  # shares the exported tiny Llama (tests/kv_models.py)
def test_validate_runs_a_kv_cache_graph_against_its_rebuilt_source():
    from tests.kv_models import exported_kv

    from rmsnorm_deploy.validate.run import validate_model

    folder, _ = exported_kv("llama")
    report = validate_model(folder / "model.onnx")
    outputs = {r.output for r in report.rows if r.status == "pass"}
    assert report.passed and {"logits", "present.0.key", "present.1.value"} <= outputs
