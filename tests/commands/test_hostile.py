"""Hostile and careless input through the CLI: a wrong result never passes, untrusted metadata
stays in its folder and its memory budget, bad input is one line with exit 2 (never a
traceback), outputs are never clobbered, and a model is never published without its report."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.graph.onnx_file import save_onnx
from rmsnorm_deploy.graph.standalone import rmsnorm_model

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'rmsnorm-deploy[onnxruntime]'")
H = 7  # an odd hidden size


def _one_line_error(capsys, code, expected_code=2):
    err = capsys.readouterr().err
    assert code == expected_code, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _error_after_progress(capsys, code, expected_code=2):
    """The error line of a command that printed progress lines on stderr before failing."""
    err = capsys.readouterr().err
    assert code == expected_code, err
    lines = err.splitlines()
    assert "Traceback" not in err and lines and lines[-1].startswith("rmsnorm-deploy "), err
    assert sum(": error: " in line for line in lines) == 1, err
    return lines[-1]


def _model(nodes, inits, *, opset=18, x_dims=("rows", H), domains=()):
    g = helper.make_graph(nodes, "third_party", [helper.make_tensor_value_info("x", TP.FLOAT, list(x_dims))],
                          [helper.make_tensor_value_info("y", TP.FLOAT, list(x_dims))], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)] +
                              [helper.make_opsetid(d, 1) for d in domains])
    model.ir_version = 9
    return model


def _gain():
    return numpy_helper.from_array(np.linspace(0.5, 1.5, H).astype(np.float32), "w")


def fused_norm(eps):
    """A third party's RMSNorm as ONNX Runtime's fused op (no rmsnorm_deploy metadata)."""
    return _model([helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1, epsilon=eps,
                                    stash_type=1)], [_gain()])


def chain_norm(eps):
    """A third party's RMSNorm written op by op: Pow, ReduceMean, Add(eps), Sqrt, Div, Mul(w)."""
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(eps, np.float32), "eps"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"), _gain()]
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["den"]),
             helper.make_node("Div", ["x", "den"], ["n"]), helper.make_node("Mul", ["n", "w"], ["y"])]
    return _model(nodes, inits)


# -- 1. a wrong result never passes ----------------------------------------------------------
@pytest.mark.parametrize("eps", [math.nan, -1e-6, 0.0, math.inf], ids=["nan", "negative", "zero", "inf"])
@pytest.mark.parametrize("build", [fused_norm, chain_norm], ids=["fused", "chain"])
def test_a_broken_epsilon_fails_validate_and_audit(tmp_path, capsys, build, eps):
    path = save_onnx(build(eps), tmp_path / "m.onnx")
    assert main(["validate", str(path), "--dim", "rows=199", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False
    failed = [r for r in report["rows"] if r["status"] == "FAIL"]
    assert failed and "its epsilon is" in failed[0]["detail"], report
    assert "not a constant" not in json.dumps(report)
    assert main(["audit", str(path), "--optimization", "none", "--json"]) == 1
    audit = json.loads(capsys.readouterr().out)
    assert audit["broken"] == 1 and "its epsilon is" in audit["reductions"][0]["problem"]


@pytest.mark.parametrize("build", [fused_norm, chain_norm], ids=["fused", "chain"])
def test_a_sound_third_party_norm_is_self_consistent_but_not_verified(tmp_path, capsys, build):
    """A third party's norm agrees with the oracle of its own spec: nothing independent of the graph
    was compared (one backend, no source), so the verdict is "not verified" (exit 3), never a pass."""
    path = save_onnx(build(1e-6), tmp_path / "m.onnx")
    assert main(["validate", str(path), "--dim", "rows=199"]) == 3
    out = capsys.readouterr().out
    assert "1 passed, 0 failed" in out and "NOT VERIFIED" in out and "self-consistency" in out
    assert main(["audit", str(path), "--optimization", "none"]) == 0


def test_a_nan_weight_is_not_comparable_and_fails(tmp_path, capsys):
    path = save_onnx(rmsnorm_model(named_specs()["llama"], dtype="float32", shape=(199, H)), tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    weight = rng.uniform(0.5, 1.5, H).astype(np.float32)
    weight[3] = np.nan
    np.savez(tmp_path / "feed.npz", x=rng.normal(0, 2, (199, H)).astype(np.float32), weight=weight)
    for reference in ("torch", "float64"):
        assert main(["validate", str(path), "--feed", str(tmp_path / "feed.npz"), "--reference", reference]) == 1
        out = capsys.readouterr().out
        assert "not comparable: the reference is NaN" in out and "0 passed" in out, out


def test_zero_comparisons_is_not_a_pass(tmp_path, capsys):
    """A graph with no norm and one backend: nothing is compared, so nothing is verified (exit 3)."""
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [])
    path = save_onnx(model, tmp_path / "relu.onnx")
    assert main(["validate", str(path)]) == 3
    out = capsys.readouterr().out
    assert "0 passed, 0 failed" in out and "NOT VERIFIED: nothing was compared" in out
    assert main(["validate", str(path), "--providers", "cpu", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "not verified" and "nothing was compared" in report["failure"]


# -- 5. check-trt runs the ONNX checker first --------------------------------------------------
def _relu_graph(nodes, inits=(), outputs=("y",)):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["rows", H])],
                          [helper.make_tensor_value_info(o, TP.FLOAT, ["rows", H]) for o in outputs],
                          initializer=list(inits))
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _with_missing_external_data(tmp_path):
    w = numpy_helper.from_array(np.ones(H, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TP.EXTERNAL
    w.external_data.add(key="location", value="weights.bin")
    return _relu_graph([helper.make_node("Add", ["x", "w"], ["y"])], [w])


INVALID_GRAPHS = {
    "cyclic": lambda tmp: _relu_graph([helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
                                       helper.make_node("Identity", ["b"], ["y"])]),
    "undefined tensor": lambda tmp: _relu_graph([helper.make_node("Relu", ["nowhere"], ["y"])]),
    "bad attribute": lambda tmp: _relu_graph([helper.make_node("Softmax", ["x"], ["y"], axis="last")]),
    "missing external data": _with_missing_external_data,
}


@pytest.mark.parametrize("case", sorted(INVALID_GRAPHS))
def test_check_trt_refuses_an_invalid_graph(tmp_path, capsys, case):
    path = tmp_path / "bad.onnx"
    onnx.save_model(INVALID_GRAPHS[case](tmp_path), str(path))
    err = _one_line_error(capsys, main(["check-trt", str(path)]))
    assert "not a valid ONNX graph: onnx.checker says:" in err and "imports" not in capsys.readouterr().out


def test_check_trt_still_reports_onnx_runtime_ops_itself(tmp_path, capsys):
    path = save_onnx(fused_norm(1e-6), tmp_path / "ort.onnx")
    assert main(["check-trt", str(path)]) == 1
    assert "would NOT import" in capsys.readouterr().out


# -- 6. no clobbering, no shadowing, no dropped option, the user's umask -----------------------
_PARITY = ["sweep", "--spec", "llama", "--dtype", "float32", "--lowering", "function", "--optimization", "disable",
           "--shape", "1x7", "--inputs", "normal"]


def test_parity_json_is_not_overwritten_without_force(tmp_path, capsys):
    target = tmp_path / "rows.json"
    target.write_text("keep me")
    err = _one_line_error(capsys, main([*_PARITY, "--json", str(target)]))
    assert "exists; pass --force" in err and target.read_text() == "keep me"
    assert main([*_PARITY, "--json", str(target), "--force"]) == 0
    assert json.loads(target.read_text())[0]["spec"] == "llama"


def test_validate_output_is_not_overwritten_without_force(tmp_path, capsys):
    path = save_onnx(fused_norm(1e-6), tmp_path / "m.onnx")
    target = tmp_path / "out.json"
    target.write_text("keep me")
    err = _one_line_error(capsys, main(["validate", str(path), "--output", str(target)]))
    assert "exists; pass --force" in err and target.read_text() == "keep me"


def test_a_folder_named_like_a_preset_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    err = _one_line_error(capsys, main(["export", "tiny", "-o", str(tmp_path / "out")]))
    assert "'tiny' is both a folder here and a preset: write ./tiny for the folder" in err and "tiny.toml" in err
    assert not (tmp_path / "out").exists()
    # ./tiny is the folder, unambiguously (an empty folder is no model: its own one-line error)
    err = _error_after_progress(capsys, main(["export", "./tiny", "-o", str(tmp_path / "out")]))
    assert "no config.json" in err


def test_options_of_a_provider_that_does_not_run_are_refused(tmp_path, capsys):
    path = save_onnx(fused_norm(1e-6), tmp_path / "m.onnx")
    err = _one_line_error(capsys, main(["validate", str(path), "--provider-option", "cuda:device_id=1"]))
    assert "provider 'cuda' is not run by --providers cpu; add it to --providers or drop the option" in err


def test_outputs_follow_the_users_umask(tmp_path, capsys):
    import os
    import stat

    mask = os.umask(0o022)
    os.umask(mask)
    path = save_onnx(fused_norm(1e-6), tmp_path / "m.onnx")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    assert main(["validate", str(path), "--output", str(tmp_path / "out.json")]) == 3  # self-consistency only
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == 0o666 & ~mask


# -- 2. untrusted metadata ------------------------------------------------------------------------
def _with_metadata(tmp_path, name="m.onnx", **changes):
    """Our standalone model, whose metadata entries ``changes`` replace (JSON text)."""
    model = rmsnorm_model(named_specs()["llama"], dtype="float32", shape=(3, H))
    for prop in model.metadata_props:
        key = prop.key.removeprefix("rmsnorm_deploy.")
        if key in changes:
            prop.value = changes[key]
    return save_onnx(model, tmp_path / name)


_HUGE_PRESET = """
[model]
vocab_size = 128000
dim = 16384
n_layers = 120
n_heads = 128
n_kv_heads = 8
intermediate_size = 53248
[norm]
epsilon = 1e-5
"""


def test_metadata_cannot_open_a_folder_outside_the_model(tmp_path, capsys):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (tmp_path / "model").mkdir()
    path = _with_metadata(tmp_path / "model", source=json.dumps({"kind": "hf", "path": str(outside)}))
    err = _one_line_error(capsys, main(["validate", str(path), "--reference", "torch"]))
    assert f"names its source folder {outside}, outside the model's folder" in err and "--source PATH" in err
    # with the default reference it is a note, and outputs are not compared with a source: not verified
    assert main(["validate", str(path), "--json"]) == 3
    assert "outside the model's folder" in " ".join(json.loads(capsys.readouterr().out)["notes"])
    # the user may name the folder: it is then what is opened
    err = _one_line_error(capsys, main(["validate", str(path), "--reference", "torch", "--source", str(outside)]))
    assert f"{outside}: no config.json" in err


def test_a_preset_in_the_metadata_is_sized_before_it_is_built(tmp_path, capsys):
    source = json.dumps({"kind": "preset", "name": "huge", "toml": _HUGE_PRESET, "seed": 0})
    path = _with_metadata(tmp_path, source=source)
    err = _one_line_error(capsys, main(["validate", str(path), "--reference", "torch"]))
    assert "parameters in float32 needs about" in err and "GiB of memory but this machine has a budget of" in err


# -- 3. never a traceback -------------------------------------------------------------------------
def _attr_model(name, value):
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1, stash_type=1)
    node.attribute.append(helper.make_attribute(name, value))
    return _model([node], [_gain()])


def _ours_with_string_epsilon():
    model = rmsnorm_model(named_specs()["llama"], dtype="float32", shape=(3, H))
    for attr in model.graph.node[0].attribute:
        if attr.name == "epsilon":
            attr.type, attr.s = onnx.AttributeProto.STRING, b"1e-6"
            attr.ClearField("f")
    return model


def _reduce_with_tensor_axes():
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["ms"]),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["den"]),
             helper.make_node("Div", ["x", "den"], ["y"])]
    nodes[1].attribute.append(helper.make_attribute("axes", numpy_helper.from_array(np.array([-1], np.int64))))
    return _model(nodes, [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                          numpy_helper.from_array(np.array(1e-6, np.float32), "eps")])


def _bad_constant():
    const = helper.make_node("Constant", [], ["eps"])
    const.attribute.append(helper.make_attribute("value", "not a tensor"))
    nodes = [const, helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["den"]),
             helper.make_node("Div", ["x", "den"], ["y"])]
    return _model(nodes, [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                          numpy_helper.from_array(np.array([-1], np.int64), "axes")])


def _external(location):
    w = numpy_helper.from_array(np.ones(H, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TP.EXTERNAL
    w.external_data.add(key="location", value=location)
    w.external_data.add(key="length", value=str(4 * H))
    return _model([helper.make_node("Add", ["x", "w"], ["y"])], [w])


def _token_model():
    """input_ids -> Gather from a 16-row embedding -> RMSNorm: its ids must lie in [0, 16)."""
    emb = numpy_helper.from_array(np.random.default_rng(0).normal(0, 1, (16, H)).astype(np.float32), "emb")
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["e"]),
             helper.make_node("SimplifiedLayerNormalization", ["e", "w"], ["y"], axis=-1, epsilon=1e-6, stash_type=1)]
    g = helper.make_graph(nodes, "tokens", [helper.make_tensor_value_info("input_ids", TP.INT64, ["batch", "seq"])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, ["batch", "seq", H])], initializer=[emb, _gain()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _saved(model, name="m.onnx"):
    def make(tmp):
        path = tmp / name
        onnx.save_model(model() if callable(model) else model, str(path))
        return path
    return make


def _validate(model, *extra):
    return lambda tmp: ["validate", str(_saved(model)(tmp)), *extra]


def _audit(model):
    return lambda tmp: ["audit", str(_saved(model)(tmp)), "--optimization", "none"]


def _fifo_case(tmp):
    import os

    os.mkfifo(tmp / "weights.bin")
    return ["validate", str(_saved(lambda: _external("weights.bin"))(tmp))]


def _feed_case(tmp, ids):
    path = _saved(_token_model)(tmp)
    np.savez(tmp / "feed.npz", input_ids=np.array(ids, np.int64))
    return ["validate", str(path), "--feed", str(tmp / "feed.npz")]


def _hf_garbage(tmp):
    pytest.importorskip("transformers", reason="a Hugging Face folder needs transformers")
    folder = tmp / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}))
    (folder / "model.safetensors").write_bytes((1 << 62).to_bytes(8, "little") + b"{garbage")
    return ["export", str(folder), "-o", str(tmp / "out")]


def _through_a_file(tmp):
    (tmp / "file.txt").write_text("not a folder")
    return ["export", "tiny", "-o", str(tmp / "file.txt" / "out")]


def _read_only(tmp):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders; the path-through-a-file case covers this check as root")
    (tmp / "ro").mkdir(mode=0o555)
    return ["export", "tiny", "-o", str(tmp / "ro" / "out")]


HOSTILE = {
    "epsilon is a string": (_validate(lambda: _attr_model("epsilon", "1e-6")), "attribute 'epsilon' is STRING, not FLOAT"),
    "epsilon is a graph": (_audit(lambda: _attr_model("epsilon", helper.make_graph([], "g", [], []))),
                           "attribute 'epsilon' is GRAPH, not FLOAT"),
    "our epsilon is a string": (_validate(_ours_with_string_epsilon), "attribute 'epsilon' is STRING, not FLOAT"),
    "our epsilon is a string, audit": (_audit(_ours_with_string_epsilon), "attribute 'epsilon' is STRING, not FLOAT"),
    "our epsilon is a string, check-trt": (lambda tmp: ["check-trt", str(_saved(_ours_with_string_epsilon)(tmp))],
                                           "not a valid ONNX graph: onnx.checker says"),
    "axes as a tensor": (_audit(_reduce_with_tensor_axes), "attribute 'axes' is TENSOR, not INTS"),
    "axes as a tensor, validate": (_validate(_reduce_with_tensor_axes), "attribute 'axes' is TENSOR, not INTS"),
    "a bad Constant": (_validate(_bad_constant), "Constant node 'eps': attribute 'value' is STRING"),
    "a bad Constant, audit": (_audit(_bad_constant), "Constant node 'eps': attribute 'value' is STRING"),
    "metadata source is a list": (lambda tmp: ["validate", str(_with_metadata(tmp, source="[]"))],
                                  "metadata is damaged (source must be an object)"),
    "metadata inputs hold a string": (lambda tmp: ["validate", str(_with_metadata(tmp, inputs='{"x": "s"}'))],
                                      "inputs must be an object of input objects"),
    "metadata dims are not a range": (lambda tmp: ["validate", str(_with_metadata(tmp, dims='{"rows": [1, "a", 3]}'))],
                                      "dims.rows must be [min, opt, max]"),
    "metadata specs are a list": (lambda tmp: ["validate", str(_with_metadata(tmp, specs="[]"))],
                                  "specs must be an object of spec objects"),
    "declared dims of 2^40": (_validate(lambda: _model([helper.make_node("Relu", ["x"], ["y"])], [], x_dims=(2**40, H))),
                              "GiB of memory but this machine has a budget of"),
    "--dim d0=100000000": (_validate(lambda: _model([helper.make_node("Relu", ["x"], ["y"])], [], x_dims=("d0", 760)),
                                     "--dim", "d0=100000000"), "give smaller sizes of the dynamic dims with --dim"),
    "external data missing": (_validate(lambda: _external("weights.bin")), "external data file 'weights.bin' is missing"),
    "external data is a FIFO": (_fifo_case, "external data 'weights.bin' is not a regular file"),
    "NUL byte in the external data location": (_validate(lambda: _external("weights\x00.bin")), "holds a NUL byte"),
    "garbage safetensors header": (_hf_garbage, "model.safetensors: not a readable safetensors file"),
    "output through a file": (_through_a_file, "file.txt is a file, not a folder"),
    "read-only output folder": (_read_only, "is not writable"),
    "--batch 100000000": (lambda tmp: ["export", "tiny", "-o", str(tmp / "out"), "--batch", "100000000"],
                          "give a smaller --batch or --seq"),
    "negative token ids": (lambda tmp: _feed_case(tmp, [[-5, 3]]), "token ids from -5 to 3, outside the embedding table's [0, 16)"),
    "token ids past the table": (lambda tmp: _feed_case(tmp, [[3, 16]]), "outside the embedding table's [0, 16)"),
    "--seed -1": (_validate(lambda: fused_norm(1e-6), "--seed", "-1"), "--seed -1 is not an integer >= 0"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    make, message = HOSTILE[case]
    argv = make(tmp_path)
    capsys.readouterr()
    line = _error_after_progress(capsys, main(argv))
    assert message in line, line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), "bad input must write nothing"
