"""The KV-cache convention (decoder/convention.py) and the files beside a model (genai_config.py): fast, no export."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.decoder.genai_config import genai_config, special_tokens, write_serving_files
from rmsnorm_deploy.decoder.convention import (
    KVCacheError,
    KVCacheLayout,
    check_io,
    graph_io,
    layout_of,
    left_padded,
    position_ids_for,
)
from rmsnorm_deploy.graph.metadata import ModelMetadata


def _layout(**kw) -> KVCacheLayout:
    base = dict(num_layers=2, num_heads=4, kv_heads=2, head_dim=16, hidden_size=64, vocab_size=256, max_length=128,
                dtype="float32")
    return KVCacheLayout(**{**base, **kw})


def kv_graph(layout: KVCacheLayout, *, drop: str | None = None, past_dtype: int | None = None,
             fixed_past: bool = False) -> onnx.ModelProto:
    """A graph with exactly the convention's inputs and outputs (Identity nodes; not runnable as a model)."""
    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[layout.dtype]
    inputs, outputs, nodes = [], [], []
    for name, (dtype, shape) in layout.inputs().items():
        if name == drop:
            continue
        t = TensorProto.INT64 if dtype == "int64" else (past_dtype or elem)
        if fixed_past and name.startswith("past_key_values"):
            shape = [s if s != "past" else 5 for s in shape]
        inputs.append(helper.make_tensor_value_info(name, t, shape))
    for name, (dtype, shape) in layout.outputs().items():
        outputs.append(helper.make_tensor_value_info(name, elem, shape))
    graph = helper.make_graph(nodes, "kv", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_layout_names_and_shapes_follow_the_convention():
    lay = _layout()
    assert lay.input_names() == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                                 "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    assert lay.output_names() == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    assert lay.inputs()["attention_mask"] == ("int64", ["batch", "total"])
    assert lay.inputs()["past_key_values.1.value"] == ("float32", ["batch", 2, "past", 16])
    assert lay.outputs()["present.0.key"] == ("float32", ["batch", 2, "total", 16])
    assert lay.outputs()["logits"] == ("float32", ["batch", "sequence", 256])


def test_head_dim_comes_from_the_config_not_hidden_over_heads():
    transformers = pytest.importorskip("transformers", reason="transformers is needed to build a config")
    config = transformers.AutoConfig.for_model("qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=32, num_hidden_layers=3, vocab_size=100,
                                               max_position_embeddings=77)
    lay = KVCacheLayout.from_hf_config(config, "float16")
    assert (lay.head_dim, lay.num_layers, lay.kv_heads, lay.max_length, lay.dtype) == (32, 3, 2, 77, "float16")


def test_layout_round_trips_through_metadata():
    lay = _layout(dtype="float16")
    meta = ModelMetadata(specs={"n": RMSNormSpec.llama(1e-6)}, lowering="function", dtype="float16",
                         kv_cache=lay.to_dict())
    model = kv_graph(lay)
    meta.write(model)
    read = ModelMetadata.read(model)
    assert layout_of(read) == lay


def test_a_model_without_kv_metadata_is_refused_with_the_fix():
    meta = ModelMetadata(specs={"n": RMSNormSpec.llama(1e-6)}, lowering="function", dtype="float32")
    with pytest.raises(KVCacheError, match=r"is not a KV-cache model .*export MODEL --kv-cache"):
        layout_of(meta, what="m.onnx")
    with pytest.raises(KVCacheError, match="not a KV-cache model"):
        layout_of(None)


@pytest.mark.parametrize("damage, message", [
    (lambda d: [1, 2], "not an object"),
    (lambda d: {k: v for k, v in d.items() if k != "head_dim"}, "lacks head_dim"),
    (lambda d: {**d, "num_layers": -1}, r"num_layers must be an integer in \[1, 1024\]"),
    (lambda d: {**d, "num_layers": True}, "num_layers must be an integer"),
    (lambda d: {**d, "max_length": 2 ** 40}, "max_length must be an integer"),
    (lambda d: {**d, "head_dim": "16"}, "head_dim must be an integer"),
    (lambda d: {**d, "kv_heads": 3}, "do not share 3 key/value heads evenly"),
    (lambda d: {**d, "dtype": "int8"}, "dtype 'int8' is not one of"),
    (lambda d: {**d, "target": "gpu"}, "target 'gpu' is not one of"),
    (lambda d: {**d, "convention": "other/9"}, "convention 'other/9'"),
    (lambda d: {**d, "inputs": {**d["inputs"], "input_ids": "ids"}}, "names its inputs"),
    (lambda d: {**d, "unknown_field": 1, "past_present_share_buffer": "no"}, "past_present_share_buffer"),
])
def test_damaged_kv_metadata_is_a_one_line_error(damage, message):
    data = damage(_layout().to_dict())
    with pytest.raises(KVCacheError, match=message) as err:
        KVCacheLayout.from_dict(data)
    assert "\n" not in str(err.value)


def test_check_io_accepts_the_convention_and_names_each_mismatch():
    lay = _layout()
    check_io(lay, *graph_io(kv_graph(lay)))
    with pytest.raises(KVCacheError, match=r"inputs missing \['position_ids'\]"):
        check_io(lay, *graph_io(kv_graph(lay, drop="position_ids")))
    with pytest.raises(KVCacheError, match="'past_key_values.0.key' is float16, the KV-cache convention says float32"):
        check_io(lay, *graph_io(kv_graph(lay, past_dtype=TensorProto.FLOAT16)))
    with pytest.raises(KVCacheError, match="fixed length"):
        check_io(lay, *graph_io(kv_graph(lay, fixed_past=True)))
    with pytest.raises(KVCacheError, match=r"has shape \['batch', 2, 'past', 16\], the KV-cache convention says "
                                           r"\['batch', 4, 'past', 16\]"):
        check_io(_layout(kv_heads=4), *graph_io(kv_graph(lay)))


def test_left_padding_and_positions_match_transformers_generate():
    ids, mask = left_padded([[5, 6, 7], [8], [9, 10]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    # transformers: position_ids = attention_mask.cumsum(-1) - 1, masked_fill_(attention_mask == 0, 1)
    assert position_ids_for(mask, 3).tolist() == [[0, 1, 2], [1, 1, 0], [1, 0, 1]]
    decode_mask = np.concatenate([mask, np.ones((3, 1), dtype=np.int64)], axis=1)
    assert position_ids_for(decode_mask, 1).tolist() == [[3], [1], [2]]
    with pytest.raises(KVCacheError, match="at least one token"):
        left_padded([[1], []], 0)


def test_genai_config_names_every_tensor_and_shares_no_buffer():
    lay = _layout(head_dim=32, num_layers=3)
    cfg = genai_config(lay, model_type="olmo2", hf_config={"eos_token_id": [1, 7], "bos_token_id": 1})
    decoder = cfg["model"]["decoder"]
    assert cfg["search"]["past_present_share_buffer"] is False
    assert decoder["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                 "position_ids": "position_ids", "past_key_names": "past_key_values.%d.key",
                                 "past_value_names": "past_key_values.%d.value"}
    assert decoder["outputs"]["present_key_names"] == "present.%d.key"
    assert (decoder["head_size"], decoder["num_hidden_layers"], decoder["num_key_value_heads"]) == (32, 3, 2)
    assert cfg["model"]["type"] == "llama"  # genai does not know olmo2: a plain decoder
    assert genai_config(lay, model_type="qwen3")["model"]["type"] == "qwen3"
    assert cfg["model"]["eos_token_id"] == [1, 7] and cfg["model"]["pad_token_id"] == 1
    assert cfg["model"]["context_length"] == 128
    # no end-of-sequence token: an empty list (onnxruntime-genai refuses -1), pad 0
    bare = genai_config(lay, hf_config={"model_type": "qwen3"})["model"]
    assert bare["eos_token_id"] == [] and bare["pad_token_id"] == 0 and bare["bos_token_id"] == 0


@pytest.mark.parametrize("config, generation, expected", [
    ({"eos_token_id": 2, "pad_token_id": None}, None, {"bos_token_id": None, "eos_token_id": 2, "pad_token_id": None}),
    ({"text_config": {"eos_token_id": [3, 4]}}, None,
     {"bos_token_id": None, "eos_token_id": [3, 4], "pad_token_id": None}),
    ({"eos_token_id": 2, "bos_token_id": 1}, {"eos_token_id": [2, 5], "bos_token_id": None},
     {"bos_token_id": 1, "eos_token_id": [2, 5], "pad_token_id": None}),  # generation_config's ids where it has them
])
def test_special_tokens_of_a_config_and_its_generation_config(config, generation, expected):
    assert special_tokens(config, generation=generation) == expected


@pytest.mark.parametrize("config, message", [
    ({"eos_token_id": True}, "config.json: eos_token_id is true: a token id is an integer from 0 to 2^63-1"),
    ({"bos_token_id": -1}, "config.json: bos_token_id is -1: a token id"),
    ({"text_config": {"eos_token_id": [3, "x"]}}, 'config.json: eos_token_id is [3, "x"]: a token id'),
    ({"pad_token_id": 2**63}, "config.json: pad_token_id is 9223372036854775808: a token id"),
    ("not a dict", "config.json: holds a JSON string, not an object"),
])
def test_special_tokens_of_the_wrong_type_are_refused(config, message):
    """Never dropped silently: an id that is no id says so, in one line."""
    with pytest.raises(UserError) as exc:
        special_tokens(config)
    assert message in str(exc.value)


def test_serving_files_copy_the_hf_folder_and_never_clobber(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    (src / "tokenizer.json").write_text("{}")
    (src / "model.safetensors").write_text("weights stay where they are")
    out = tmp_path / "out"
    written = write_serving_files(out / "model.onnx", _layout(), {"kind": "hf", "path": str(src)}, hf_folder=src,
                                  force=False)
    assert sorted(written) == ["config.json", "genai_config.json", "tokenizer.json"]
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "genai_config.json").read_text())["model"]["eos_token_id"] == 2
    with pytest.raises(UserError, match="exists"):
        write_serving_files(out / "model.onnx", _layout(), {"kind": "hf", "path": str(src)}, hf_folder=src, force=False)
    config_only = write_serving_files(tmp_path / "cfg" / "model.onnx", _layout(),
                                      {"kind": "hf", "config": {"model_type": "qwen3"}}, force=False)
    assert config_only == ["config.json", "genai_config.json"]


@pytest.mark.parametrize("layout", [_layout(), _layout(num_layers=1, num_heads=7, kv_heads=1, head_dim=3, hidden_size=7,
                                                         vocab_size=199, max_length=760, dtype="bfloat16")])
def test_a_model_without_a_hf_config_gets_one_from_its_layout(tmp_path, layout):
    """A preset has no Hugging Face folder: optimum's ORTModelForCausalLM still needs a config.json
    with a model_type and the dims it sizes the cache with (it refused the folder without one)."""
    source = {"kind": "preset", "name": "tiny", "toml": "", "seed": 0}
    written = write_serving_files(tmp_path / "model.onnx", layout, source, force=False)
    assert sorted(written) == ["config.json", "genai_config.json"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["use_cache"] is True and config["torch_dtype"] == layout.dtype
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["hidden_size"], config["vocab_size"], config["max_position_embeddings"]) == (
        layout.num_layers, layout.num_heads, layout.kv_heads, layout.head_dim, layout.hidden_size, layout.vocab_size,
        layout.max_length)
    genai = json.loads((tmp_path / "genai_config.json").read_text())["model"]
    assert genai["type"] == "llama" and genai["eos_token_id"] == []  # a preset has no special tokens
