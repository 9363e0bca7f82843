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
def test_a_sound_third_party_norm_still_passes(tmp_path, capsys, build):
    path = save_onnx(build(1e-6), tmp_path / "m.onnx")
    assert main(["validate", str(path), "--dim", "rows=199"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
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
    """A graph with no norm and one backend: nothing is compared, so nothing is verified."""
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [])
    path = save_onnx(model, tmp_path / "relu.onnx")
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert "0 passed, 0 failed" in out and "FAIL: nothing was compared" in out
    assert main(["validate", str(path), "--providers", "cpu", "--json"]) == 1
    assert "nothing was compared" in json.loads(capsys.readouterr().out)["failure"]


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
_PARITY = ["parity", "--spec", "llama", "--dtype", "float32", "--lowering", "function", "--optimization", "disable",
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
    assert main(["validate", str(path), "--output", str(tmp_path / "out.json")]) == 0
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == 0o666 & ~mask
