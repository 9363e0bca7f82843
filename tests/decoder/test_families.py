"""Every family ``--target onnxruntime`` writes, one row of ``tests/decoder/families.py`` each,
held to transformers in float32: the logits of prefill and 4 decode steps, greedy tokens past the
sliding window, every norm our exact node in float32, int4 against its dequantized model, and the
written folder under ``generate``, the serving engine and onnxruntime-genai."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="transformers builds the reference models")
pytest.importorskip("onnxruntime", reason="the graphs run in ONNX Runtime")

from rmsnorm_deploy.decoder.convention import KVCacheLayout, left_padded  # noqa: E402
from rmsnorm_deploy.decoder.families import FAMILIES, REFUSED, refusal  # noqa: E402
from rmsnorm_deploy.decoder.generate import KVCacheModel, generate  # noqa: E402
from rmsnorm_deploy.decoder.genai_config import write_serving_files  # noqa: E402
from rmsnorm_deploy.decoder.loop import decode_loop  # noqa: E402
from rmsnorm_deploy.decoder.ort_step import KVDecoderRunner  # noqa: E402
from rmsnorm_deploy.decoder.ort_export import write_ort_decoder  # noqa: E402
from rmsnorm_deploy.decoder.ort_graph import build_decoder  # noqa: E402
from rmsnorm_deploy.decoder.ort_model import OrtDecoderError  # noqa: E402
from rmsnorm_deploy.decoder.ort_builder import OrtDecoderBuilder  # noqa: E402
from rmsnorm_deploy.decoder.ort_parity import audit_norms, decode_parity  # noqa: E402
from rmsnorm_deploy.decoder.ort_rotary import rotary_tables  # noqa: E402
from rmsnorm_deploy.decoder.ort_writer import GraphWriter  # noqa: E402
from rmsnorm_deploy.decoder.quantize import Quantization, dequantized_reference  # noqa: E402
from rmsnorm_deploy.decoder.transformers_step import transformers_generate  # noqa: E402
from rmsnorm_deploy.exporter import hf  # noqa: E402
from rmsnorm_deploy.contract.compare import compare  # noqa: E402
from rmsnorm_deploy.contract.tolerances import tolerance_for  # noqa: E402
from rmsnorm_deploy.graph.function import is_rmsnorm_node  # noqa: E402
from rmsnorm_deploy.graph.metadata import ModelMetadata  # noqa: E402
from rmsnorm_deploy.serving.engine.slots import slots_refusal  # noqa: E402
from tests.decoder.families import ROWS, FamilyRow, tiny_config  # noqa: E402
from tests.kv_models import random_left_padded  # noqa: E402

NEW_TOKENS = 32
#: Prompt tokens beyond the window in the past-window tests (decode then runs 32 more past it).
PAST_WINDOW = 5
IDS = [row.name for row in ROWS]


def _one_per_family() -> list[FamilyRow]:
    """One row per model type for the checks that hold the family, not each config of it, to a path
    (int4, the written folder): its last row that onnxruntime-genai runs, else its last row (the
    table lists a family's plain config first and its harder ones after)."""
    chosen: dict[str, FamilyRow] = {}
    for row in ROWS:
        kept = chosen.get(row.model_type)
        if kept is None or row.genai or not kept.genai:
            chosen[row.model_type] = row
    return list(chosen.values())


FAMILY_ROWS = _one_per_family()
FAMILY_IDS = [row.name for row in FAMILY_ROWS]
#: New tokens of the written folder's checks (generate, the engine, genai): the decode past the
#: window is held to 32 tokens by the graph's own greedy test.
FOLDER_TOKENS = 16


def _prompt_length(row: FamilyRow) -> int:
    return (row.window or 4) + PAST_WINDOW


_MODELS: dict[str, object] = {}


def _loaded(row: FamilyRow):
    if row.name not in _MODELS:
        _MODELS[row.name] = hf.from_config(row.config, "float32", seed=0)
    return _MODELS[row.name]


def _generate(lm, ids: np.ndarray, mask: np.ndarray, new_tokens: int) -> np.ndarray:
    return transformers_generate(lm, ids, mask, max_new_tokens=new_tokens, pad_token_id=0, stop_at_eos=False)


def test_every_family_has_a_row():
    assert set(FAMILIES) == {row.model_type for row in ROWS}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_model_types_are_refused_with_their_reason(model_type):
    """A refused kin that transformers builds from a tiny config is refused by ``build_decoder`` with
    its reason; one it cannot build (remote code, a composite config) at least by ``refusal``."""
    assert REFUSED[model_type] in refusal(model_type)
    try:
        loaded = hf.from_config(tiny_config(model_type, head_dim=16), "float32", seed=0)
    except hf.HFModelError:
        return
    with pytest.raises(OrtDecoderError) as caught:
        build_decoder(loaded)
    assert str(caught.value) == refusal(model_type)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_step_logits_exact_past_the_window(row):
    """Prefill and 4 decode steps, 3 rows left-padded by 0, 2 and 4 tokens, the prompt longer than
    the window: every step within the float64-grounded bound and below 1e-4 of transformers."""
    loaded = _loaded(row)
    dec = build_decoder(loaded)
    parity = decode_parity(loaded, dec.model, batch=3, prompt=_prompt_length(row), steps=4)
    assert len(parity.results) == 5
    for result in parity.results:
        assert result.passed, result.summary()
        assert result.max_abs <= 1e-4, result.summary()
    assert parity.tokens_equal and not parity.failed, parity.table()


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_greedy_tokens_past_the_window_equal_transformers(row):
    loaded = _loaded(row)
    dec = build_decoder(loaded, share_buffer=row.window is not None, max_length=64)
    ids, mask = random_left_padded(3, _prompt_length(row), loaded.vocab_size, seed=3)
    got = KVDecoderRunner(dec.model).greedy(ids, mask, new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(got.tokens, _generate(loaded.module.model, ids, mask, NEW_TOKENS))


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_every_norm_is_our_node_audited_in_float32(row):
    loaded = _loaded(row)
    dec = build_decoder(loaded)
    nodes = [n for n in dec.model.graph.node if is_rmsnorm_node(n)]
    assert len(nodes) == dec.norm_nodes == row.norms == len(dec.detection.norms)
    assert audit_norms(dec.model, dec.norm_nodes) == row.norms
    windows = [a.i for n in dec.model.graph.node if n.op_type == "GroupQueryAttention"
               for a in n.attribute if a.name == "local_window_size"]
    assert len(windows) == row.config["num_hidden_layers"]
    assert (row.window is not None) == (row.window in windows)


@pytest.mark.parametrize("row", FAMILY_ROWS, ids=FAMILY_IDS)
def test_int4_matches_its_dequantized_model(row):
    """int4 (block 32, float32 compute): step logits within the quantized row of the tolerance
    table and greedy tokens equal to transformers on the dequantized weights."""
    loaded = _loaded(row)
    dec = build_decoder(loaded, quantization=Quantization("int4", 32, 0, False), max_length=64)
    parity = decode_parity(loaded, dec.model, batch=2, prompt=_prompt_length(row), steps=1)
    assert not parity.failed, parity.table()
    ids, mask = random_left_padded(2, _prompt_length(row), loaded.vocab_size, seed=5)
    got = KVDecoderRunner(dec.model).greedy(ids, mask, new_tokens=16).tokens
    with dequantized_reference(loaded.module, dec.model, ModelMetadata.read(dec.model).quantization):
        want = _generate(loaded.module.model, ids, mask, 16)
    np.testing.assert_array_equal(got, want)


def _folder(row: FamilyRow, tmp_path):
    """The written folder: the graph with its weights beside it, genai_config.json and config.json."""
    loaded = _loaded(row)
    path = tmp_path / row.name / "model.onnx"
    dec = write_ort_decoder(loaded, path, force=False, max_length=64)
    layout = KVCacheLayout.from_dict(ModelMetadata.read(dec.model).kv_cache)
    write_serving_files(path, layout, loaded.source, force=False)
    return loaded, path.parent


@pytest.mark.parametrize("row", FAMILY_ROWS, ids=FAMILY_IDS)
def test_folder_generates_serves_and_runs_in_genai(row, tmp_path):
    """``generate`` gives transformers' tokens for a batch of prompts past the window; the serving
    engine and onnxruntime-genai (where it knows the model type) those of each prompt alone (under
    LongRoPE transformers' batch switches every row's table when its longest row crosses)."""
    from rmsnorm_deploy.serving.engine.engine import Engine, EngineOptions

    loaded, folder = _folder(row, tmp_path)
    prompts = [[int(t) for t in np.random.default_rng(7).integers(3, 250, size=_prompt_length(row))], [5, 17, 99]]
    ids, mask = left_padded(prompts, 0)
    alone = [_generate(loaded.module.model, *left_padded([p], 0), FOLDER_TOKENS)[0].tolist() for p in prompts]
    # Rows of a batch decode alone, except under LongRoPE, where the batch's longest row picks every row's table.
    coupled = "rope_scaling" in row.config
    want = _generate(loaded.module.model, ids, mask, FOLDER_TOKENS).tolist() if coupled else alone
    with KVCacheModel(folder) as kv:
        assert generate(kv, prompts, max_new_tokens=FOLDER_TOKENS, eos_token_id=None).tokens == want
        engine = Engine(kv, EngineOptions(max_batch=2, prefill_chunk=4)).start(warm=False)
        try:
            streams = [engine.submit(p, max_new_tokens=FOLDER_TOKENS, eos_token_id=None) for p in prompts]
            assert [s.result(timeout=120) for s in streams] == alone
        finally:
            engine.drain(5)
    if row.genai:
        pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
        from rmsnorm_deploy.decoder.genai_client import genai_greedy

        theirs = genai_greedy(folder, prompts[0], FOLDER_TOKENS)
        assert theirs == alone[0][:len(theirs)] and theirs, (theirs, alone[0])


LONGROPE_ROWS = [row for row in ROWS if "rope_scaling" in row.config]


def _their_rotary(lm, kind: str | None, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [positions, rotary_dim] from the model's own ``rotary_emb`` over positions 0..positions - 1
    (LongRoPE picks its table from that length, as in a forward)."""
    x = torch.zeros(1, positions, 1, dtype=torch.float32)
    ids = torch.arange(positions)[None]
    with torch.no_grad():
        cos, sin = lm.model.rotary_emb(x, ids) if kind is None else lm.model.rotary_emb(x, ids, kind)
    return cos[0].numpy(), sin[0].numpy()


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_rotary_tables_folded_at_load_are_the_models_own(row, tmp_path):
    """The graph stores each rotary table's ``inv_freq`` and computes cos/sin from it; ONNX Runtime
    folds them at load. Every table, run as GroupQueryAttention reads it (LongRoPE: the run's rows of
    the table its length picks, both sides of the switch), is the model's ``rotary_emb`` over every
    position to the float32 rounding of two cos/sin implementations; and a step does not compute them."""
    import onnx
    import onnxruntime as ort

    builder = OrtDecoderBuilder(_loaded(row))
    kinds = [kind for kind in dict.fromkeys(builder.rotary_kinds) if kind != ""]
    if not kinds:
        pytest.skip(f"{row.name} has no rotary layer")
    w = GraphWriter("float32")
    caches, switch = rotary_tables(w, builder.lm, builder.dims, builder.rotary_kinds, "lengths", "total")
    outputs = [name for kind in kinds for name in caches[kind]]
    graph = onnx.helper.make_graph(
        w.nodes, "rotary", [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.INT64, [None]) for n in
                            ("lengths", "total")],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in outputs], w.inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    folded = onnx.load(options.optimized_model_filepath)
    assert not [n.op_type for n in folded.graph.node if n.op_type in ("Range", "Cos", "Sin")], "not folded at load"
    maximum = builder.dims.max_positions
    lengths = [maximum] if switch is None else [switch, maximum]  # the short table's last row, the long one's
    tolerance = tolerance_for("rotary_table", "onnxruntime", "float32")
    compared = 0
    for length in lengths:
        ours = dict(zip(outputs, session.run(outputs, {"lengths": np.array([length], np.int64),
                                                         "total": np.array([length], np.int64)})))
        for kind in kinds:
            for name, theirs in zip(caches[kind], _their_rotary(builder.lm, kind, length)):
                half = ours[name].shape[1]
                result = compare(ours[name], theirs[:, :half], tolerance, name=f"{name} at {length} positions")
                assert result.passed, result.summary()
                compared += result.shape[0] * result.shape[1]
    assert compared > 0
    assert not [i.name for i in model.graph.initializer if i.dims and i.dims[0] >= maximum], "a table is stored"


@pytest.mark.parametrize("row", LONGROPE_ROWS, ids=[row.name for row in LONGROPE_ROWS])
def test_longrope_switch_and_recompute_are_in_the_metadata(row, tmp_path):
    """The graph slices its run's rows from the table the switch picks (short and long stacked); the
    loop recomputes there (transformers' generate); the engine's streams take turns (one table per
    run would couple them)."""
    dec = build_decoder(_loaded(row))
    kv = ModelMetadata.read(dec.model).kv_cache
    switch = row.config["original_max_position_embeddings"]
    assert kv["rotary_switch"] == kv["recompute_past"] == switch
    stacked = [n.op_type for n in dec.model.graph.node if n.output[0].startswith("rotary/cache_short_long")]
    assert stacked.count("Concat") == 1 and stacked.count("Cos") == stacked.count("Sin") == 1, stacked
    _, folder = _folder(row, tmp_path)
    with KVCacheModel(folder) as model:
        assert "LongRoPE" in slots_refusal(model)


@pytest.mark.parametrize("row", LONGROPE_ROWS, ids=[row.name for row in LONGROPE_ROWS])
def test_longrope_graph_runs_in_genai(row, tmp_path):
    """onnxruntime-genai 0.18 runs the LongRoPE graph (short table, then the long one past the switch)
    as our loop does without the recompute: genai recomputes Phi-3's cache only at a fixed 4097 tokens."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    from rmsnorm_deploy.decoder.genai_client import genai_greedy

    _, folder = _folder(row, tmp_path)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 250, size=_prompt_length(row))]
    step = KVDecoderRunner(str(folder / "model.onnx")).step
    assert len(prompt) <= step.recompute_past < len(prompt) + NEW_TOKENS  # the run crosses the switch
    step.recompute_past = None  # as genai runs it below 4097 tokens
    ours = decode_loop(step, np.asarray([prompt]), max_new_tokens=NEW_TOKENS).tokens[0].tolist()
    theirs = genai_greedy(folder, prompt, NEW_TOKENS)
    assert len(theirs) == NEW_TOKENS and theirs == ours, (theirs, ours)
