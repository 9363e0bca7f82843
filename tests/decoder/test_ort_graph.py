"""The ONNX Runtime decoder graph (``export --kv-cache --target onnxruntime``): parity with
transformers' own cache step by step, greedy tokens equal to ``generate``, every norm our exact
node audited in float32, the LM head taken from the model structure, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from rmsnorm_deploy.errors import InputError, UserError  # noqa: E402
from rmsnorm_deploy.exporter import hf  # noqa: E402
from rmsnorm_deploy.decoder.ort_graph import build_decoder  # noqa: E402
from rmsnorm_deploy.decoder.ort_model import OrtDecoderError, lm_head_of  # noqa: E402
from rmsnorm_deploy.decoder.ort_parity import audit_norms, decode_parity  # noqa: E402
from rmsnorm_deploy.decoder.export import DecoderOptions, check_decoder_options  # noqa: E402
from rmsnorm_deploy.exporter.plan import ExportOptions  # noqa: E402
from rmsnorm_deploy.graph.function import is_rmsnorm_node  # noqa: E402
from rmsnorm_deploy.graph.metadata import ModelMetadata  # noqa: E402
from rmsnorm_deploy.decoder.ort_step import DECODE_OPTIMIZATION, CacheLayout, KVDecoderRunner  # noqa: E402
from rmsnorm_deploy.runners.onnxruntime import optimization_level  # noqa: E402
from rmsnorm_deploy.decoder.transformers_step import transformers_generate  # noqa: E402
from tests.kv_models import random_left_padded  # noqa: E402

#: Norm modules of the 2-layer tiny Qwen3: 2 per layer, its q/k norms, the final norm. Each family's own
#: checks are the rows of tests/decoder/families.py (test_families.py).
QWEN3_NORMS = 9


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(kind: str, **overrides):
        key = (kind, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = hf.from_config({**hf.TINY_CONFIGS[kind], **overrides}, "float32", seed=0)
        return cache[key]

    return get


def _generate(lm, ids: np.ndarray, mask: np.ndarray, new_tokens: int) -> np.ndarray:
    """transformers' tokens for all ``new_tokens``, end of sequence ignored as our greedy loop does."""
    return transformers_generate(lm, ids, mask, max_new_tokens=new_tokens, pad_token_id=0, stop_at_eos=False)


#: Both buffer modes at batch 1 and 3; every family's tokens past its window: tests/decoder/test_families.py.
@pytest.mark.parametrize("kind, batch, share_buffer", [("llama", 1, False), ("llama", 3, True)])
def test_greedy_tokens_equal_generate(models, kind, batch, share_buffer):
    loaded = models(kind)
    dec = build_decoder(loaded, share_buffer=share_buffer, max_length=64)
    ids, mask = random_left_padded(batch, 9, loaded.vocab_size, seed=3)
    got = KVDecoderRunner(dec.model).greedy(ids, mask, new_tokens=32)
    want = _generate(loaded.module.model, ids, mask, 32)
    assert got.tokens.shape == (batch, 32)
    np.testing.assert_array_equal(got.tokens, want)


@pytest.mark.parametrize("lowering", ["function", "inline", "ort"])
def test_lowerings_keep_parity(models, lowering):
    loaded = models("qwen3")
    dec = build_decoder(loaded, lowering=lowering)
    assert audit_norms(dec.model, dec.norm_nodes) == QWEN3_NORMS
    parity = decode_parity(loaded, dec.model, batch=2, prompt=5, steps=2)
    assert not parity.failed, parity.table()


def test_native_lowering_refused_with_reason(models):
    with pytest.raises(OrtDecoderError, match="RMSNormalization exists from opset 23"):
        build_decoder(models("llama"), lowering="native")


def test_lm_head_from_structure_when_intermediate_size_equals_vocab(models):
    """A size match would find gate_proj and up_proj too (onnxruntime-genai's builder takes one of
    them: its logits are off by 0.34 on this config); the graph uses the module the forward uses."""
    loaded = models("llama", vocab_size=128, intermediate_size=128)
    lm = loaded.module.model
    size_matches = [p for p, m in lm.named_modules() if isinstance(m, torch.nn.Linear) and m.out_features == 128]
    assert len(size_matches) > 1 and size_matches[-1] == "lm_head"
    weight, path = lm_head_of(lm)
    assert path == "lm_head" and weight is lm.lm_head.weight
    dec = build_decoder(loaded)
    ids = np.random.default_rng(0).integers(3, 128, size=(2, 8), dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(8), (2, 1))}
    for i in range(2):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = np.zeros((2, 2, 0, 16), np.float32)
    sess = ort.InferenceSession(dec.model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], feed)[0]
    with torch.no_grad():
        want = lm(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert np.abs(got - want).max() <= 1e-4


def test_tied_embeddings_head(models):
    loaded = models("qwen3", tie_word_embeddings=True)
    lm = loaded.module.model
    weight, path = lm_head_of(lm)
    assert weight is lm.get_input_embeddings().weight and "tied to" in path
    assert not decode_parity(loaded, build_decoder(loaded).model, batch=1, prompt=4, steps=2).failed


def test_metadata_records_convention_target_and_buffer_mode(models):
    for share in (False, True):
        dec = build_decoder(models("llama"), share_buffer=share, max_length=48)
        meta = ModelMetadata.read(dec.model)
        assert meta is not None and meta.kv_cache is not None
        kv = meta.kv_cache
        assert kv["target"] == "onnxruntime" and kv["past_present_share_buffer"] is share
        assert (kv["num_layers"], kv["kv_heads"], kv["head_dim"], kv["max_length"]) == (2, 2, 16, 48)
        assert kv["convention"] == "past_key_values/1" and kv["lm_head"] == "lm_head"
        past = dec.model.graph.input[3].type.tensor_type.shape.dim[2]
        assert past.dim_param == ("max_length" if share else "past")
        layout = CacheLayout.from_metadata(kv)
        assert layout.share_buffer is share and layout.layers == 2


def test_refusals(models):
    nemotron = hf.from_config({**hf.TINY_CONFIGS["llama"], "model_type": "nemotron"}, "float32", seed=0)
    with pytest.raises(OrtDecoderError, match="does not write 'nemotron' models yet; it writes .*llama"):
        build_decoder(nemotron)
    with pytest.raises(OrtDecoderError, match="llama: activation 'relu' is not written by --target onnxruntime"):
        build_decoder(models("llama", hidden_act="relu"))
    with pytest.raises(OrtDecoderError, match="GroupQueryAttention has no bfloat16 CPU kernel"):
        build_decoder(hf.from_config(hf.TINY_CONFIGS["llama"], "bfloat16", seed=0))
    with pytest.raises(OrtDecoderError, match="outside the model's 1..128 positions"):
        build_decoder(models("llama"), max_length=4096)


@pytest.mark.parametrize("options, decoder, message", [
    (dict(fuse_attention=True), dict(target="onnxruntime"), "already uses ONNX Runtime's fused attention"),
    (dict(dtype="bfloat16"), dict(target="onnxruntime"), "use --target portable for bfloat16"),
    (dict(), dict(target="tensorrt"), "unknown --target 'tensorrt'"),
    (dict(opset=23), dict(target="onnxruntime"), "--opset is for the portable graph"),
    (dict(), dict(share_buffer=True), "--share-buffer is a mode of the --target onnxruntime graph"),
])
def test_plan_checks_target_options(options, decoder, message):
    with pytest.raises(UserError, match=message):
        check_decoder_options(ExportOptions(**options), DecoderOptions(**decoder))
    check_decoder_options(ExportOptions(), DecoderOptions(target="onnxruntime"))  # the valid combination passes


def test_runner_refuses_other_graphs_and_damaged_metadata(models, tmp_path):
    from rmsnorm_deploy.contract.spec import RMSNormSpec
    from rmsnorm_deploy.graph.standalone import rmsnorm_model

    plain = rmsnorm_model(RMSNormSpec.llama(), dtype="float32", shape=(2, 8))
    with pytest.raises(InputError, match="no rmsnorm_deploy KV-cache metadata"):
        KVDecoderRunner(plain)
    dec = build_decoder(models("llama"))
    for prop in dec.model.metadata_props:
        if prop.key == "rmsnorm_deploy.kv_cache":
            prop.value = json.dumps({"num_layers": 2})
    with pytest.raises(InputError, match="kv_cache metadata is incomplete"):
        KVDecoderRunner(dec.model)


def test_export_command(tmp_path, models):
    from rmsnorm_deploy.cli import main

    folder = tmp_path / "hf"
    models("llama").module.model.save_pretrained(folder)
    out = tmp_path / "out"
    assert main(["export", str(folder), "--kv-cache", "--target", "onnxruntime", "-o", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["parity"]["status"] == "pass" and len(report["parity"]["steps"]) == 5
    assert report["kv_cache"]["target"] == "onnxruntime"
    meta = ModelMetadata.read(onnx.load(str(out / "model.onnx")))
    assert meta.kv_cache["past_present_share_buffer"] is False
    # Beside it, what optimum's ORTModelForCausalLM and onnxruntime-genai read, as for the portable graph.
    from rmsnorm_deploy.decoder.genai_config import HF_FILES

    copied = {name for name in HF_FILES if (folder / name).is_file()}
    assert "config.json" in copied and set(report["serving_files"]) == copied | {"genai_config.json"}
    assert all((out / name).read_bytes() == (folder / name).read_bytes() for name in copied)
    config = json.loads((out / "config.json").read_text())
    source = models("llama").module.model.config
    for field in ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                  "vocab_size", "eos_token_id"):
        assert config[field] == getattr(source, field), field
    genai = json.loads((out / "genai_config.json").read_text())
    assert genai["model"]["decoder"]["num_key_value_heads"] == meta.kv_cache["kv_heads"]
    assert genai["model"]["decoder"]["head_size"] == meta.kv_cache["head_dim"]
    assert genai["search"]["past_present_share_buffer"] is False
    # ... and `rmsnorm-deploy generate` runs the folder as it is: transformers' greedy tokens.
    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate

    ids, mask = random_left_padded(2, 6, config["vocab_size"], seed=3)
    with KVCacheModel(out) as kv:
        got = generate(kv, [list(ids[0]), list(ids[1, 2:])], max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert got.tokens == _generate(models("llama").module.model, ids, mask, 8).tolist()
    # Nothing is replaced without --force.
    assert main(["export", str(folder), "--kv-cache", "--target", "onnxruntime", "-o", str(out)]) == 2
    # `validate` generates a feed GroupQueryAttention accepts (a mask of ones, positions from 0) and compares it
    # with its source: the metadata names the inputs' kinds as the portable graph does.
    from rmsnorm_deploy.validate.run import validate_model

    assert {meta.inputs[n]["kind"] for n in ("attention_mask", "position_ids")} == {"mask", "positions"}
    report = validate_model(out / "model.onnx", source=folder)
    assert report.passed and any(r.output == "logits" and r.status == "pass" for r in report.rows), report.table()


def test_float16_step_logits_within_tolerance_table():
    """float16: the same parity, bounded by the float16 model tolerance; tokens equal to torch's float16 run."""
    loaded = hf.from_config(hf.TINY_CONFIGS["llama"], "float16", seed=0)
    dec = build_decoder(loaded)
    assert audit_norms(dec.model, dec.norm_nodes) == len(dec.detection.norms) == 5
    parity = decode_parity(loaded, dec.model, batch=2, prompt=6, steps=3)
    assert len(parity.results) == 4 and all(r.dtype == "float16" for r in parity.results)
    assert not parity.failed, parity.table()


def test_gemma3_float16_embedding_scale_rounded_as_transformers():
    """Gemma3 in float16 at hidden 80: the embedding scale is sqrt(80) rounded to float16 (8.945, not
    8.944), as transformers multiplies; step logits within the float16 model tolerance, tokens equal.
    About 7 s: a float16 Gemma3 of its own (the module's models are float32 at hidden 64, where the
    scale 8 is exact)."""
    loaded = hf.from_config({**hf.TINY_CONFIGS["gemma3"], "hidden_size": 80}, "float16", seed=0)
    dec = build_decoder(loaded)
    scale = next(i for i in dec.model.graph.initializer if i.name.endswith("embed_tokens.embed_scale"))
    got = onnx.numpy_helper.to_array(scale)
    assert got.dtype == np.float16 and got.size == 1
    assert got.item() == float(np.float16(np.sqrt(80.0))) != float(np.float32(np.sqrt(80.0)))
    assert audit_norms(dec.model, dec.norm_nodes) == len(dec.detection.norms) == 13
    parity = decode_parity(loaded, dec.model, batch=2, prompt=6, steps=3)
    assert all(r.dtype == "float16" for r in parity.results)
    assert not parity.failed, parity.table()


@pytest.mark.parametrize("share_buffer", [False, True])
def test_long_uneven_left_padding_keeps_transformers_logits(models, share_buffer):
    """The prelude puts each row's valid tokens first with a TopK of the mask (ONNX keeps equal
    values in index order) and back with a second one: at prompt 100 with rows padded by 0, 37 and
    99 slots (one valid token), every step's logits stay transformers' and the tokens its own."""
    from rmsnorm_deploy.contract.compare import compare
    from rmsnorm_deploy.contract.tolerances import tolerance_for
    from rmsnorm_deploy.decoder.transformers_step import transformers_steps

    loaded = models("llama")
    dec = build_decoder(loaded, share_buffer=share_buffer, max_length=110)
    ids = np.random.default_rng(5).integers(3, loaded.vocab_size, size=(3, 100), dtype=np.int64)
    mask = np.ones_like(ids)
    for row, pad in enumerate((0, 37, 99)):
        mask[row, :pad], ids[row, :pad] = 0, 0
    got = KVDecoderRunner(dec.model).greedy(ids, mask, new_tokens=6, keep_logits=True)
    want = transformers_steps(loaded.module.model, ids, mask, new_tokens=6)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    tolerance = tolerance_for("model", "onnxruntime", "float32")
    assert len(got.step_logits) == len(want.step_logits) == 6
    for step, (g, w) in enumerate(zip(got.step_logits, want.step_logits)):
        result = compare(g, w, tolerance, name=f"logits step {step}", dtype="float32")
        assert result.passed, result.summary()


@pytest.mark.parametrize("kind, tied", [("llama", True), ("llama", False), ("gemma3", True)])
def test_decoding_sessions_level_and_the_tied_head_change_speed_not_a_single_logit(models, kind, tied):
    """``DECODE_OPTIMIZATION`` is chosen for speed alone: every logit bit-identical to level
    ``all``. A tied float head reads the one embedding table through a Transpose (folded when the
    session loads) and a MatMul: no second copy of the table, no Gemm."""
    loaded = models(kind, **({"tie_word_embeddings": tied} if kind == "llama" else {}))
    dec = build_decoder(loaded, share_buffer=True, max_length=64)
    nodes = dec.model.graph.node
    assert not [n for n in nodes if n.op_type == "Gemm"]
    transposed = [n for n in nodes if n.op_type == "Transpose" and n.name.startswith("lm_head")]
    assert len(transposed) == int(tied)
    if tied:
        assert transposed[0].input[0] == next(n for n in nodes if n.op_type == "Gather" and n.name.startswith("embed")).input[0]
    ids, mask = random_left_padded(2, 9, loaded.vocab_size, seed=5)
    logits = {}
    for level in ("all", DECODE_OPTIMIZATION):
        options = ort.SessionOptions()
        options.graph_optimization_level = optimization_level(level)
        run = KVDecoderRunner(dec.model, session_options=options).greedy(ids, mask, new_tokens=8, keep_logits=True)
        logits[level] = np.stack(run.step_logits)
    assert DECODE_OPTIMIZATION != "all" and np.array_equal(logits["all"], logits[DECODE_OPTIMIZATION])
    want = _generate(loaded.module.model, ids, mask, 8)
    assert np.array_equal(np.argmax(logits["all"], axis=-1).T, want)
