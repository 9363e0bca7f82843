"""``--quantize int8-smooth``: each projection's input times a measured smoothing factor (one Mul per input)
before MatMulNBits, its weight's input rows divided by it; the reference reads the factors back from the
graph and computes the kernel's arithmetic, so parity and greedy tokens hold against it exactly as for
``int8``; the measurement chooses the smoothing an outlier feature needs and none where it does not."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from onnx import numpy_helper  # noqa: E402

from rmsnorm_deploy.decoder import quant_smoothing  # noqa: E402
from rmsnorm_deploy.decoder.ort_graph import build_decoder  # noqa: E402
from rmsnorm_deploy.decoder.ort_parity import audit_norms, decode_parity  # noqa: E402
from rmsnorm_deploy.decoder.ort_step import KVDecoderRunner  # noqa: E402
from rmsnorm_deploy.decoder.quantize import Quantization, dequantized_reference, quantization_of  # noqa: E402
from rmsnorm_deploy.decoder.transformers_step import transformers_generate  # noqa: E402
from rmsnorm_deploy.errors import UserError  # noqa: E402
from rmsnorm_deploy.exporter import hf  # noqa: E402
from rmsnorm_deploy.graph.function import is_rmsnorm_node  # noqa: E402
from rmsnorm_deploy.graph.metadata import ModelMetadata  # noqa: E402
from tests.kv_models import random_left_padded  # noqa: E402

#: The feature of layer 0's attention input made an outlier, and how much larger than the rest.
OUTLIER, OUTLIER_GAIN = 5, 60.0


@contextlib.contextmanager
def _outlier(lm):
    """Layer 0's input norm gain times OUTLIER_GAIN at one feature: its Q/K/V input gets an outlier
    feature, as real models' norm outputs have."""
    gain = lm.model.layers[0].input_layernorm.weight
    saved = gain.detach().clone()
    with torch.no_grad():
        gain[OUTLIER] *= OUTLIER_GAIN
    try:
        yield lm
    finally:
        with torch.no_grad():
            gain.copy_(saved)


def _windows(loaded, count=3, length=16):
    return np.random.default_rng(11).integers(0, loaded.vocab_size, (count, length)).tolist()


def _measured(loaded, level=4, head=False, dtype=None):
    return quant_smoothing.smoothed(Quantization("int8-smooth", 32, level, head), loaded.module.model,
                                    _windows(loaded))


@pytest.fixture(scope="module")
def llama():
    return hf.from_config(hf.TINY_CONFIGS["llama"], "float32", seed=0)


def test_the_measurement_smooths_an_outlier_input_and_records_its_choice(llama):
    """Layer 0's Q/K/V input with a feature 60x the others: smoothed, at the strength of least error,
    which is well below no smoothing's; every unit's choice and errors are in the measurement, and the
    Linears fed one input share one array of factors, which divides the outlier feature the most."""
    with _outlier(llama.module.model):
        q = _measured(llama)
    units = {(u["unit"], u["layer"]): u for u in q.measurement["units"]}
    assert len(units) == 8 and q.measurement["tokens"] == 48
    qkv = units[("qkv", 0)]
    errors = qkv["relative_error"]
    assert set(errors) == {"none", *(f"{a:g}" for a in quant_smoothing.STRENGTHS)}
    assert qkv["strength"] != "none" and errors[qkv["strength"]] == min(errors.values())
    assert errors[qkv["strength"]] < 0.5 * errors["none"]
    paths = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert q.smoothing[paths[0]] is q.smoothing[paths[1]] is q.smoothing[paths[2]]
    factors = q.smoothing[paths[0]]
    assert int(np.argmin(factors)) == OUTLIER and factors[OUTLIER] < 0.2 * np.median(factors)
    chosen = {key for key, u in units.items() if u["strength"] != "none"}
    assert q.measurement["smoothed"] == len(chosen)
    assert {p for p in q.smoothing} == {p for p, m in llama.module.model.named_modules()
                                        if isinstance(m, torch.nn.Linear) and
                                        quant_smoothing.unit_of(p) in chosen}


@pytest.mark.parametrize("level, head", [(4, False), (4, True), (1, False)])
def test_int8_smooth_multiplies_each_smoothed_input_once_and_holds_parity(llama, level, head):
    """One Mul per smoothed input (Q/K/V one, gate and up one) feeding its MatMulNBits, every norm still
    our float32 node; the metadata names each weight's factors, which the reference reads back: step
    logits within the table's row, transformers' greedy tokens on the reference equal the graph's, and
    the dequantized weights, times their factors, are the model's to 8-bit rounding (2 % relative)."""
    with _outlier(llama.module.model):
        q = _measured(llama, level, head)
        dec = build_decoder(llama, quantization=q, max_length=64)
        graph = dec.model.graph
        entry = ModelMetadata.read(dec.model).quantization
        smoothed = [lin for lin in entry["linears"] if lin["smoothing"]]
        assert smoothed and all(lin["method"] == "rtn" and lin["bits"] == 8 for lin in entry["linears"])
        head_lin = [lin for lin in entry["linears"] if lin["parts"][0][0].endswith("lm_head")]
        assert len(head_lin) == head
        muls = {n.output[0]: n for n in graph.node if n.op_type == "Mul" and n.input[1] in
                {lin["smoothing"] for lin in smoothed}}
        nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
        fed = [n for n in nbits if n.input[0] in muls]
        assert len(muls) == len({lin["smoothing"] for lin in smoothed}) and len(fed) == len(smoothed)
        assert sum(is_rmsnorm_node(n) for n in graph.node) == audit_norms(dec.model, dec.norm_nodes)
        parity = decode_parity(llama, dec.model, batch=2, prompt=6, steps=2)
        assert not parity.failed, parity.table()
        assert "smoothed MatMulNBits' input times the factors" in parity.reference
        ids, mask = random_left_padded(2, 7, llama.vocab_size, seed=5)
        got = KVDecoderRunner(dec.model).greedy(ids, mask, new_tokens=12).tokens
        with dequantized_reference(llama.module, dec.model, entry) as ref:
            assert ref.weights.passed, ref.weights.summary()
            want = transformers_generate(llama.module.model, ids, mask, max_new_tokens=12, pad_token_id=0,
                                         stop_at_eos=False)
            modules = dict(llama.module.named_modules())
        np.testing.assert_array_equal(got, want)
        for lin in smoothed:
            for path, _ in lin["parts"]:
                w = modules[path].weight.detach()  # the outlier's rows, 1/f larger, set their blocks' steps
                assert float((ref.dequantized[path] - w).norm() / w.norm()) < 0.02


def test_a_tied_smoothed_head_is_stored_once_and_its_lookup_undoes_the_smoothing():
    """Gemma3's head is its embedding: smoothed and quantized, the one packed weight holds the rows divided
    by the head input's factors; the lookup (GatherBlockQuantized) multiplies them back (a Mul by the same
    factors), exactly as the reference's embedding computes them: greedy tokens equal."""
    loaded = hf.from_config(hf.TINY_CONFIGS["gemma3"], "float32", seed=0)
    lm = loaded.module.model
    q = _measured(loaded, head=True)
    head = next(u for u in q.measurement["units"] if u["unit"] == "head")
    assert set(head["kl"]) == {"none", *(f"{a:g}" for a in quant_smoothing.STRENGTHS)}
    if head["strength"] == "none":  # the tiny model's head input may need none: force one to test the lookup
        factors = np.linspace(0.5, 2.0, lm.config.hidden_size).astype(np.float32)
        q.smoothing["lm_head"] = factors
    dec = build_decoder(loaded, quantization=q, max_length=64)
    graph = dec.model.graph
    (lookup,) = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    (back,) = [n for n in graph.node if n.op_type == "Mul" and n.input[0] == lookup.output[0]]
    entry = ModelMetadata.read(dec.model).quantization
    (tied,) = [lin for lin in entry["linears"] if lin["embedding"]]
    assert back.input[1] == tied["smoothing"]
    (head_mm,) = [n for n in graph.node if n.op_type == "MatMulNBits" and n.input[2] == tied["scales"]]
    (into,) = [n for n in graph.node if n.output[0] == head_mm.input[0]]
    assert into.op_type == "Mul" and into.input[1] == tied["smoothing"]
    parity = decode_parity(loaded, dec.model, batch=2, prompt=6, steps=2)
    assert not parity.failed, parity.table()
    ids, mask = random_left_padded(2, 7, loaded.vocab_size, seed=4)
    got = KVDecoderRunner(dec.model).greedy(ids, mask, new_tokens=12).tokens
    with dequantized_reference(loaded.module, dec.model, entry):
        want = transformers_generate(lm, ids, mask, max_new_tokens=12, pad_token_id=0, stop_at_eos=False)
    np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def smooth_decoder(llama):
    with _outlier(llama.module.model):
        q = _measured(llama)
    return q, build_decoder(llama, quantization=q, max_length=32)


@pytest.mark.parametrize("damage, message", [
    (lambda k: np.ones(k + 1, np.float32), r"is float32 \[{k1}\], not \[{k}\] floats; export it again"),
    (lambda k: np.full(k, np.inf, np.float32), "holds non-positive or non-finite factors; export it again"),
    (lambda k: -np.ones(k, np.float32), "holds non-positive or non-finite factors"),
])
def test_damaged_smoothing_in_the_graph_is_refused_in_one_line(llama, smooth_decoder, damage, message):
    """Factors of the wrong shape, or Inf or negative ones (with which the graph and its reference would
    agree on Inf or on a wrong sign), are refused before any comparison."""
    _, dec = smooth_decoder
    entry = ModelMetadata.read(dec.model).quantization
    lin = next(lin for lin in entry["linears"] if lin["smoothing"])
    model = onnx.ModelProto()
    model.CopyFrom(dec.model)
    (init,) = [i for i in model.graph.initializer if i.name == lin["smoothing"]]
    init.CopyFrom(numpy_helper.from_array(damage(lin["K"]), lin["smoothing"]))
    with pytest.raises(UserError, match=message.format(k=lin["K"], k1=lin["K"] + 1)):
        with dequantized_reference(llama.module, model, entry):
            pass


def test_smoothing_beside_block_offsets_is_damaged_metadata(smooth_decoder):
    """The writer never smooths a width with block offsets (its block sums would be of the unsmoothed
    input): metadata saying so is damaged, refused in one line."""
    _, dec = smooth_decoder
    entry = json.loads(json.dumps(ModelMetadata.read(dec.model).quantization))
    lin = next(lin for lin in entry["linears"] if lin["smoothing"])
    lin.update(method="fit", symmetric=False, offsets="x")
    with pytest.raises(UserError, match="smoothing '.*' for a int8 block offsets fit width"):
        quantization_of(entry)


def test_a_smoothed_weight_is_checked_where_it_was_quantized(llama, smooth_decoder):
    """The weight check compares the graph's 8-bit values with the model's rows divided by the factors:
    it passes; with factors that are not the ones the weight was divided by, it fails."""
    _, dec = smooth_decoder
    entry = ModelMetadata.read(dec.model).quantization
    lin = next(lin for lin in entry["linears"] if lin["smoothing"])
    with dequantized_reference(llama.module, dec.model, entry) as ref:
        assert ref.weights.passed, ref.weights.summary()
    model = onnx.ModelProto()
    model.CopyFrom(dec.model)
    (init,) = [i for i in model.graph.initializer if i.name == lin["smoothing"]]
    init.CopyFrom(numpy_helper.from_array(np.ones(lin["K"], np.float32), lin["smoothing"]))
    with dequantized_reference(llama.module, model, entry) as ref:
        assert not ref.weights.passed and ref.weights.worst in [path for path, _ in lin["parts"]]


def test_the_sensitivity_measurement_refuses_a_smoothed_recipe(llama):
    from rmsnorm_deploy.decoder import quant_sensitivity as sens

    with pytest.raises(ValueError, match="int8-smooth is measured by quant_smoothing.smoothed"):
        sens.measured(Quantization("int8-smooth"), llama.module.model, _windows(llama))

