"""validate as a library: standalone models against their source and oracle, third-party graphs
against the oracle of each norm they contain, inputs from metadata or from the graph."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.errors import (
    InputError,
    LoweringError,
    MissingDependencyError,
    UserError,
)
from rmsnorm_deploy.graph.lowerings import LOWERINGS
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.onnx_file import save_onnx
from rmsnorm_deploy.graph.standalone import rmsnorm_model
from rmsnorm_deploy.validate.backends import parse_backends
from rmsnorm_deploy.validate.feeds import check_feed, generate_feed, load_feed, parse_dims
from rmsnorm_deploy.validate.rows import ValidationRun, output_rows
from rmsnorm_deploy.validate.run import validate_model
from tests.cases import DTYPES

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'rmsnorm-deploy[onnxruntime]'")


def assert_self_consistent(report) -> None:
    """One backend and no source: every norm agrees with the oracle of its own spec, which verifies
    nothing (exit 3, saying how to verify it), never a pass."""
    assert report.verdict == "not verified" and report.exit_code == 3 and not report.passed, report.table()
    norm_rows = [r for r in report.rows if r.output.startswith("norm ")]
    assert norm_rows and all(r.status == "pass" and not r.independent for r in norm_rows), report.table()
    assert all(r.against == "self-consistency (the graph's own spec)" for r in norm_rows), report.table()
    assert "second backend" in report.failure() and "NOT VERIFIED" in report.table()
    assert report.to_dict()["verdict"] == "not verified"

def _save(model, tmp_path, name="model.onnx"):
    return save_onnx(model, tmp_path / name)


def _standalone(tmp_path, spec_name="llama", dtype="float16", shape=(199, 760), lowering="function"):
    return _save(rmsnorm_model(named_specs()[spec_name], dtype=dtype, shape=shape, lowering=lowering), tmp_path)


@pytest.mark.parametrize("reference", ["torch", "float64"])
@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_name", ["llama", "gemma"])
def test_standalone_model_passes_against_source_and_oracle(tmp_path, spec_name, dtype, lowering, reference):
    try:
        path = _standalone(tmp_path, spec_name, dtype, (199, 760), lowering)
    except LoweringError as exc:
        pytest.skip(f"the lowering refuses this spec: {exc}")
    try:
        report = validate_model(path, reference=reference)
    except UserError as exc:
        assert "NOT_IMPLEMENTED" in str(exc), exc
        pytest.skip(f"ONNX Runtime CPU has no kernel for it: {exc}")
    assert report.passed, report.table()
    checks = [(r.output if r.output == "y" else "norm", r.check, r.status) for r in report.rows]
    if reference == "torch":
        # the output against the torch source, and the norm on its own against the float64 oracle
        assert checks == [("y", "norm_vs_torch", "pass"), ("norm", "norm", "pass")]
    else:
        assert checks == [("y", "norm", "pass")]
    assert all(r.result.tolerance.reason for r in report.rows)
    (norm,) = report.norms
    assert norm.precision == "float32" and norm.ran["onnxruntime[cpu]"] != "?"


@pytest.mark.parametrize("dtype", DTYPES)
def test_stress_inputs_pass_with_float32_accumulation(tmp_path, dtype):
    report = validate_model(_standalone(tmp_path, "torch", dtype, (7, 4096)), inputs="stress")
    assert report.passed, report.table()
    assert report.inputs["x"]["kind"] == "activations, stress"


def test_a_graph_that_departs_from_its_source_fails(tmp_path):
    """A tool that rewrote epsilon: the graph still computes its own spec, but not the source's."""
    model = rmsnorm_model(named_specs()["llama"], dtype="float32", shape=(199, 760))
    for attr in model.graph.node[0].attribute:
        if attr.name == "epsilon":
            attr.f = 0.5
    report = validate_model(_save(model, tmp_path))
    assert not report.passed
    by_output = {r.output: r for r in report.rows}
    assert by_output["y"].status == "FAIL" and by_output["y"].result.bad_count > 0
    assert by_output["norm rmsnorm"].status == "pass"  # the node does what its own attributes say
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] is False and data["rows"][0]["result"]["tolerance"]["reason"]


def test_source_that_cannot_be_rebuilt(tmp_path):
    model = rmsnorm_model(named_specs()["llama"], dtype="float16", shape=(5, 64))
    meta = ModelMetadata.read(model)
    meta.source = {"kind": "preset", "name": "no-such-preset"}
    meta.write(model)
    path = _save(model, tmp_path)
    report = validate_model(path)
    # one backend and no source: each norm against the oracle of its own spec verifies nothing
    assert report.verdict == "not verified" and report.exit_code == 3, report.table()
    assert "cannot rebuild the PyTorch source of kind 'preset'" in " ".join(report.notes)
    assert "add a second backend" in report.failure() and "--source" not in report.failure()
    assert [r.output for r in report.rows] == ["norm rmsnorm"]
    with pytest.raises(UserError, match="--reference torch: cannot rebuild the PyTorch source of kind 'preset'"):
        validate_model(path, reference="torch")


# -- third-party graphs -----------------------------------------------------------------
def _third_party(tmp_path, dtype=TP.FLOAT16):
    """x -> SimplifiedLayerNormalization -> MatMul -> SkipSimplifiedLayerNormalization(residual) -> LayerNormalization."""
    np_dtype = np.float16 if dtype == TP.FLOAT16 else np.float32
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(a.astype(np_dtype), n) for n, a in [
        ("w1", rng.uniform(0.5, 1.5, 64)), ("w2", rng.uniform(0.5, 1.5, 64)), ("w3", rng.uniform(0.5, 1.5, 64)),
        ("b3", rng.normal(0, 0.1, 64)), ("m", rng.normal(0, 0.125, (64, 64)))]]
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "w1"], ["n1"], axis=-1, epsilon=1e-6, stash_type=1),
        helper.make_node("MatMul", ["n1", "m"], ["h"]),
        helper.make_node("SkipSimplifiedLayerNormalization", ["h", "x", "w2"], ["n2", "", "", "res"],
                         epsilon=1e-6, domain="com.microsoft"),
        helper.make_node("LayerNormalization", ["res", "w3", "b3"], ["n3"], axis=-1, epsilon=1e-5),
        helper.make_node("Add", ["n2", "n3"], ["y"]),
    ]
    g = helper.make_graph(nodes, "third_party", [helper.make_tensor_value_info("x", dtype, ["batch", "seq", 64])],
                          [helper.make_tensor_value_info("y", dtype, ["batch", "seq", 64])], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return _save(model, tmp_path, "third_party.onnx")


@pytest.mark.parametrize("inputs", ["normal", "stress"])
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16], ids=["float32", "float16"])
def test_third_party_graph_checks_each_norm_against_its_oracle(tmp_path, dtype, inputs):
    report = validate_model(_third_party(tmp_path, dtype), inputs=inputs, dims={"batch": 2, "seq": 7})
    assert_self_consistent(report)
    rows = {r.output: r for r in report.rows}
    assert set(rows) == {"norm n1", "norm n2", "norm n3"} or set(rows) == {
        f"norm {n.name}" for n in report.norms}, report.table()
    assert [r.check for r in report.rows] == ["norm", "norm", "layer_norm"]
    assert report.source == "third-party graph (no rmsnorm_deploy metadata)"
    assert "outputs not compared: one backend and no PyTorch source" in " ".join(report.notes)
    assert report.inputs["x"]["shape"] == [2, 7, 64]
    ran = [n.ran["onnxruntime[cpu]"] for n in report.norms]
    assert ran[1].startswith("SkipSimplifiedLayerNormalization")


def test_backends_are_compared_with_the_first_one(tmp_path):
    """Two runs of the same graph (ONNX Runtime without and with its optimizations) compared as two backends."""
    from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner

    path = _third_party(tmp_path, TP.FLOAT16)
    model = onnx.load(str(path))
    feed, _, _ = generate_feed(model, None, dims={"batch": 2, "seq": 7})
    results = {}
    for level in ("disable", "all"):
        with OnnxRuntimeRunner(path, optimization=level) as runner:
            results[level] = runner.infer(feed)
    notes: list[str] = []
    rows = output_rows(ValidationRun(["cpu", "cpu"], ["disable", "all"], results, feed, ["y"], {"y": "float16"},
                                     notes))
    (row,) = rows
    assert (row.backend, row.against, row.check, row.status) == ("all", "disable", "backends", "pass"), row
    assert row.result.tolerance.reason


def test_onnx_exported_torch_norm_is_validated(tmp_path):
    """A decomposed chain (as torch.onnx writes it) is traced to its output and checked."""
    from tests.graph.test_audit import rms_chain

    report = validate_model(_save(rms_chain(TP.FLOAT16, cast_to=TP.FLOAT, divide=False), tmp_path), inputs="stress")
    assert_self_consistent(report)
    (norm,) = report.norms
    assert norm.op == "Pow>ReduceMean>Add>Sqrt>Reciprocal" and norm.precision == "float32"


# -- inputs -----------------------------------------------------------------------------
def test_generated_inputs_follow_the_metadata():
    model = rmsnorm_model(named_specs()["gemma"], dtype="bfloat16", shape=(2, 9, 48))
    meta = ModelMetadata.read(model)
    feed, described, notes = generate_feed(model, meta, kind="stress", seed=3)
    assert feed["x"].shape == (2, 9, 48) and feed["weight"].shape == (48,)
    assert described["weight"]["kind"] == "weight" and not notes
    assert abs(float(feed["weight"].astype(np.float32).mean())) < 0.5  # Gemma's weight is an offset around 0
    feed2, _, _ = generate_feed(model, meta, kind="stress", seed=3, dims={"d0": 1, "d1": 5})
    assert feed2["x"].shape == (1, 5, 48)


def test_token_inputs_stay_inside_the_embedding_table():
    emb = numpy_helper.from_array(np.zeros((37, 8), np.float32), "emb")
    g = helper.make_graph(
        [helper.make_node("Gather", ["emb", "input_ids"], ["h"]), helper.make_node("Identity", ["attention_mask"], ["m"])],
        "g", [helper.make_tensor_value_info("input_ids", TP.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TP.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("h", TP.FLOAT, None), helper.make_tensor_value_info("m", TP.INT64, None)],
        initializer=[emb])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    feed, described, notes = generate_feed(model, None, dims={"batch": 2, "seq": 50})
    assert feed["input_ids"].max() < 37 and feed["input_ids"].min() >= 0 and feed["input_ids"].shape == (2, 50)
    assert (feed["attention_mask"] == 1).all() and described["attention_mask"]["kind"] == "mask"


def test_unknown_dims_are_errors_and_unsized_dims_are_noted():
    model = rmsnorm_model(named_specs()["torch"], dtype="float32", shape=(2, 8))
    with pytest.raises(UserError, match="--dim seq: no such dynamic dim; the model's are d0"):
        generate_feed(model, None, dims={"seq": 2})
    _, described, notes = generate_feed(model, None)
    assert described["x"]["shape"] == [3, 8] and "given 3" in notes[0]
    for bad in ("batch", "batch=0", "=3", "batch=x"):
        with pytest.raises(UserError, match="is not NAME=SIZE"):
            parse_dims([bad])


def test_backend_names():
    assert parse_backends("cpu, cuda,trt-plugin") == ["cpu", "cuda", "trt-plugin"]
    with pytest.raises(UserError, match="unknown provider\\(s\\) \\['gpu'\\]"):
        parse_backends("cpu,gpu")


def test_tensorrt_backend_without_tensorrt_says_what_to_install(tmp_path):
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorrt is installed here")
    with pytest.raises(MissingDependencyError, match="validate --providers trt needs tensorrt.*Docker image"):
        validate_model(_standalone(tmp_path, shape=(2, 8)), providers=["cpu", "trt"])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: {"x": f["x"]}, "missing \\['weight'\\]"),
        (lambda f: {**f, "x": f["x"].astype(np.float32)}, "'x' is float32 but the model wants float16"),
        (lambda f: {**f, "x": f["x"][:, :4]}, "'x' has shape \\[3, 4\\] but the model wants \\['d0', 8\\]"),
        (lambda f: {**f, "weight": f["weight"][None]}, "'weight' has shape \\[1, 8\\]"),
    ],
    ids=["missing", "dtype", "shape", "rank"],
)
def test_feed_files_are_checked_against_the_graph(tmp_path, change, message):
    path = _standalone(tmp_path, shape=(3, 8))
    model = onnx.load(str(path))
    feed, _, _ = generate_feed(model, ModelMetadata.read(model))
    np.savez(tmp_path / "feed.npz", **change(feed))
    with pytest.raises(InputError, match=message):
        load_feed(tmp_path / "feed.npz", model)
    np.savez(tmp_path / "good.npz", **feed)
    report = validate_model(path, feed_path=tmp_path / "good.npz")
    assert report.passed and report.inputs["x"]["kind"] == "from good.npz"


def test_inconsistent_dynamic_dims_are_refused():
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "g",
                          [helper.make_tensor_value_info(n, TP.FLOAT, ["n", 4]) for n in "ab"],
                          [helper.make_tensor_value_info("c", TP.FLOAT, ["n", 4])])
    model = helper.make_model(g)
    with pytest.raises(InputError, match="dim 'n' is 2 in input 'a' but 3 in 'b'"):
        check_feed({"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.float32)}, model)


def test_not_a_feed_file(tmp_path):
    (tmp_path / "feed.npz").write_text("not numpy")
    model = rmsnorm_model(named_specs()["torch"], dtype="float32", shape=(2, 8))
    with pytest.raises(InputError, match="not a readable .npz file"):
        load_feed(tmp_path / "feed.npz", model)
    with pytest.raises(InputError, match="no such file"):
        load_feed(tmp_path / "missing.npz", model)
