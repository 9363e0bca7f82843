"""The streamed export: a sharded bfloat16 checkpoint read tensor by tensor gives the same files, byte
for byte, as the model loaded whole; its norms are confirmed on their real weights; a checkpoint that
does not match its config is a one-line error; a model too large to load is checked layer by layer,
and the traced export refuses it before loading, naming the streaming target."""

from __future__ import annotations

import json
import struct

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from rmsnorm_deploy.cli import main  # noqa: E402
from rmsnorm_deploy.decoder.layer_parity import layer_parity  # noqa: E402
from rmsnorm_deploy.decoder.ort_export import write_ort_decoder  # noqa: E402
from rmsnorm_deploy.decoder.quantize import Quantization  # noqa: E402
from rmsnorm_deploy.decoder.streaming import open_folder  # noqa: E402
from rmsnorm_deploy.decoder.weights import CheckpointError, SafetensorsTensors  # noqa: E402
from rmsnorm_deploy.exporter import hf  # noqa: E402
from rmsnorm_deploy.exporter.detect import detect_norms  # noqa: E402
from rmsnorm_deploy.graph.metadata import ModelMetadata  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny models saved as sharded bfloat16 safetensors (several shards and an index), by family."""
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}

    def get(kind: str):
        if kind not in made:
            folder = root / kind
            model = hf.from_config(hf.TINY_CONFIGS[kind], "bfloat16", seed=0).module.model
            model.save_pretrained(folder, max_shard_size="40KB")
            made[kind] = folder
        return made[kind]

    return get


@pytest.mark.parametrize("kind, dtype, quantization", [
    ("llama", "float32", None), ("llama", "float32", Quantization("int4", 32, 4, True)),
    ("llama", "float16", Quantization("int8", 16, 1)), ("qwen2", "float32", Quantization("int4", 16, 1)),
    ("gemma3", "float32", Quantization("int8", 32, 4, True)), ("gemma3", "float32", Quantization("int4-mixed")),
])
def test_streamed_export_equals_the_in_memory_export_byte_for_byte(checkpoints, tmp_path, kind, dtype, quantization):
    folder = checkpoints(kind)
    assert len(list(folder.glob("*.safetensors"))) > 2 and (folder / "model.safetensors.index.json").is_file()
    whole = hf.load_folder(folder, dtype)
    write_ort_decoder(whole, tmp_path / "memory" / "model.onnx", force=False, quantization=quantization)
    streamed, tensors = open_folder(folder, dtype)
    assert all(p.is_meta for n, p in streamed.module.named_parameters() if n.endswith("proj.weight"))
    write_ort_decoder(streamed, tmp_path / "streamed" / "model.onnx", force=False, quantization=quantization,
                      tensors=tensors)
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "memory" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name


def test_norm_specs_are_confirmed_on_the_real_norm_weights(checkpoints):
    folder = checkpoints("qwen3")
    streamed, _ = open_folder(folder, "float32")
    whole = hf.load_folder(folder, "float32")
    got, want = detect_norms(streamed.module), detect_norms(whole.module)
    assert [(n.path, n.spec, n.how) for n in got.norms] == [(n.path, n.spec, n.how) for n in want.norms]
    assert len(got.norms) == 9
    for a, b in zip(got.norms, want.norms):
        assert not a.weight.is_meta and torch.equal(a.weight, b.weight)


def _retyped(folder, tmp_path, change):
    """A copy of ``folder`` whose one-file checkpoint is rewritten with ``change(tensors)``."""
    copy = tmp_path / "bad"
    copy.mkdir()
    (copy / "config.json").write_text((folder / "config.json").read_text())
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(safetensors_torch.load_file(str(file)))
    change(tensors)
    safetensors_torch.save_file(tensors, str(copy / "model.safetensors"))
    return copy


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "has no tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 32, dtype=torch.bfloat16)}),
     "tensor 'model.layers.0.self_attn.o_proj.weight' has shape \\[64, 32\\]; the config makes"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128, dtype=torch.int8)}),
     "is stored as I8; weights are read from BF16, F16, F32 checkpoints"),
    (lambda t: t.update({"model.norm.weight": torch.ones(65, dtype=torch.bfloat16)}),
     "tensor 'model.norm.weight' has shape \\[65\\]; the config makes model.norm.weight \\[64\\]"),
])
def test_a_checkpoint_that_does_not_match_its_config_is_one_line(checkpoints, tmp_path, change, message):
    bad = _retyped(checkpoints("llama"), tmp_path, change)
    with pytest.raises(CheckpointError, match=message) as info:
        streamed, tensors = open_folder(bad, "float32")
        write_ort_decoder(streamed, tmp_path / "out" / "model.onnx", force=False, tensors=tensors)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out" / "model.onnx").exists() and not list((tmp_path / "out").glob(".*"))


def test_an_index_naming_a_missing_shard_is_one_line(checkpoints, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in checkpoints("llama").iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hf.HFModelError, match="its weight_map names '../elsewhere.safetensors', not a file name inside "
                                              "the folder"):
        SafetensorsTensors(bad)


def _tamper(path, proto, name: str) -> None:
    """Flip the bits of the first 64 bytes of initializer ``name`` in the external-data file."""
    tensor = next(t for t in proto.graph.initializer if t.name == name)
    offset = int(next(e.value for e in tensor.external_data if e.key == "offset"))
    data = bytearray(path.read_bytes())
    data[offset:offset + 64] = bytes(b ^ 0xFF for b in data[offset:offset + 64])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("quantization", [None, Quantization("int4", 32, 4, True), Quantization("int4-mixed")])
def test_layer_by_layer_parity_passes_and_finds_a_damaged_layer(checkpoints, tmp_path, quantization):
    streamed, tensors = open_folder(checkpoints("llama"), "float32")
    out = tmp_path / "model.onnx"
    write_ort_decoder(streamed, out, force=False, quantization=quantization, tensors=tensors)
    parity = layer_parity(streamed, tensors, out, prompt=6)
    weights = ["quantized weights vs the model's"] if quantization else []
    assert [r.name for r in parity.results] == [*weights, "layer 0 output", "logits"]
    assert not parity.failed, parity.table()
    proto = onnx.load(str(out), load_external_data=False)
    suffix = f"_Q{quantization.width('down', 1, 2).bits}" if quantization else ""
    _tamper(tmp_path / "model.onnx.data", proto, f"model.model.layers.1.mlp.down_proj.weight{suffix}")
    damaged = layer_parity(streamed, tensors, out, prompt=6)
    # Unquantized: the damaged layer's output is off. Quantized: the reference holds the graph's own
    # (damaged) weights, so the outputs agree and the weights' check against the checkpoint fails.
    want = [False, True, True] if quantization else [True, False]
    assert [r.passed for r in damaged.results] == want and damaged.failed
    if quantization:
        assert "model.model.layers.1.mlp.down_proj" in damaged.results[0].summary()


def test_a_model_over_the_budget_is_streamed_and_checked_layer_by_layer(checkpoints, tmp_path, monkeypatch, capsys):
    """With a memory budget of 1 MiB: the traced export refuses before reading a weight, naming the
    streaming export; ``--target onnxruntime`` writes the graph and checks it layer by layer."""
    import rmsnorm_deploy.decoder.streaming as streaming
    import rmsnorm_deploy.resources as resources

    monkeypatch.setattr(resources, "memory_budget", lambda: 2**20)
    monkeypatch.setattr(streaming, "memory_budget", lambda: 2**20)
    folder = checkpoints("llama")
    assert main(["export", str(folder), "--kv-cache", "-o", str(tmp_path / "portable")]) == 2
    err = capsys.readouterr().err
    assert "3.5x the weights at the run's peak" in err and "export --kv-cache --target onnxruntime" in err
    assert not (tmp_path / "portable").exists()
    out = tmp_path / "ort"
    assert main(["export", str(folder), "--kv-cache", "--target", "onnxruntime", "--quantize", "int8", "-o",
                 str(out)]) == 0
    printed = capsys.readouterr().out
    assert "checked layer by layer: the whole PyTorch model beside ONNX Runtime's session needs about" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["parity"]["kind"] == "layer by layer" and report["parity"]["status"] == "pass"
    assert [s["name"] for s in report["parity"]["steps"]] == ["quantized weights vs the model's", "layer 0 output",
                                                              "logits"]
    assert report["quantization"].startswith("int8 weights (block 32, symmetric), accuracy_level 4 (int8 compute)")


def test_safetensors_header_is_read_without_the_weights(checkpoints):
    """The source knows every tensor's shape and dtype from the headers alone."""
    tensors = SafetensorsTensors(checkpoints("llama"))
    assert tensors.shapes["model.embed_tokens.weight"] == (256, 64)
    assert set(tensors.dtypes.values()) == {"BF16"}
    file = tensors.files["model.embed_tokens.weight"]
    (length,) = struct.unpack("<Q", file.read_bytes()[:8])
    header = json.loads(file.read_bytes()[8:8 + length])
    assert header["model.embed_tokens.weight"]["shape"] == [256, 64]
    np.testing.assert_array_equal(tensors.rows("model.embed_tokens.weight", 3, 5).float().numpy(),
                                  tensors.get("model.embed_tokens.weight")[3:5].float().numpy())
    np.testing.assert_array_equal(tensors.columns("model.embed_tokens.weight", 7, 9).float().numpy(),
                                  tensors.get("model.embed_tokens.weight")[:, 7:9].float().numpy())


@pytest.mark.parametrize("row", ["qwen3_moe", "mixtral-window", "gpt_oss"])
def test_experts_stream_whether_stored_apart_or_fused(tmp_path, row):
    """Qwen3-MoE and Mixtral checkpoints store each expert apart (transformers 5 saves them so), gpt-oss
    fused: the streamed int4 export equals the in-memory one byte for byte and passes layer by layer."""
    from tests.decoder.families import ROWS

    config = next(r for r in ROWS if r.name == row).config
    folder = tmp_path / "checkpoint"
    hf.from_config(config, "bfloat16", seed=0).module.model.save_pretrained(folder, max_shard_size="40KB")
    stored = set(SafetensorsTensors(folder).files)
    assert any(".experts.0." in n for n in stored) == (row != "gpt_oss"), sorted(stored)[:8]
    quantization = Quantization("int4", 16, 4)
    whole = hf.load_folder(folder, "float32")
    write_ort_decoder(whole, tmp_path / "memory" / "model.onnx", force=False, quantization=quantization)
    streamed, tensors = open_folder(folder, "float32")
    assert all(p.is_meta for n, p in streamed.module.named_parameters() if "experts" in n)
    out = tmp_path / "streamed" / "model.onnx"
    write_ort_decoder(streamed, out, force=False, quantization=quantization, tensors=tensors)
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "memory" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name
    parity = layer_parity(streamed, tensors, out, prompt=6)
    assert not parity.failed, parity.table()


def test_layer_by_layer_parity_of_a_per_channel_head(checkpoints, tmp_path):
    """int4-gptq's head (8 bits per channel on int8 rows, ``quantize.channel_head``) checked layer by layer:
    its logits computed from the checkpoint's rows block by block pass; its rows moved by one fail the
    weights' check."""
    from rmsnorm_deploy.decoder import quant_sensitivity as sens

    folder = checkpoints("llama")
    whole = hf.load_folder(folder, "float32")
    windows = np.random.default_rng(3).integers(0, whole.vocab_size, (2, 12)).tolist()
    quantization = sens.measured(Quantization("int4-gptq", 32, 4), whole.module.model, windows)
    out = tmp_path / "model.onnx"
    write_ort_decoder(whole, out, force=False, quantization=quantization)
    streamed, tensors = open_folder(folder, "float32")
    parity = layer_parity(streamed, tensors, out, prompt=6)
    assert not parity.failed and "per-channel MatMulInteger" in parity.reference, parity.table()
    proto = onnx.load(str(out), load_external_data=False)
    (head,) = [lin for lin in ModelMetadata.read(proto).quantization["linears"] if lin["method"] == "channel"]
    _tamper(tmp_path / "model.onnx.data", proto, head["packed"])
    damaged = layer_parity(streamed, tensors, out, prompt=6)
    assert damaged.failed and not damaged.results[0].passed


def test_layer_by_layer_parity_of_smoothed_inputs(checkpoints, tmp_path):
    """int8-smooth with the head quantized, checked layer by layer: each layer's projections and the head
    read their smoothing back from the graph and pass; the head's factors doubled fail the weights' check
    (its weight is checked divided by them)."""
    from rmsnorm_deploy.decoder import quant_smoothing

    folder = checkpoints("llama")
    whole = hf.load_folder(folder, "float32")
    windows = np.random.default_rng(3).integers(0, whole.vocab_size, (2, 12)).tolist()
    quantization = quant_smoothing.smoothed(Quantization("int8-smooth", 32, 4, lm_head=True), whole.module.model,
                                            windows)
    head_path = next(p for p, m in whole.module.model.named_modules() if m is whole.module.model.lm_head)
    rng = np.random.default_rng(4)  # the head smoothed whatever the tiny model measured
    quantization.smoothing[head_path] = rng.uniform(0.5, 2.0, whole.module.model.config.hidden_size).astype(np.float32)
    out = tmp_path / "model.onnx"
    write_ort_decoder(whole, out, force=False, quantization=quantization)
    streamed, tensors = open_folder(folder, "float32")
    parity = layer_parity(streamed, tensors, out, prompt=6)
    assert not parity.failed, parity.table()
    proto = onnx.load(str(out), load_external_data=False)
    (head,) = [lin for lin in ModelMetadata.read(proto).quantization["linears"] if lin["parts"][0][0].endswith("lm_head")]
    (init,) = [t for t in proto.graph.initializer if t.name == head["smoothing"]]  # small: stored in the graph
    init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * 2, init.name))
    onnx.save(proto, str(out))
    damaged = layer_parity(streamed, tensors, out, prompt=6)
    assert damaged.failed and not damaged.results[0].passed
