"""`rmsnorm-deploy validate` and `audit` from the command line: tables, JSON, exit codes, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.graph.onnx_file import save_onnx
from rmsnorm_deploy.graph.standalone import rmsnorm_model

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'rmsnorm-deploy[onnxruntime]'")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_path(tmp_path):
    return save_onnx(rmsnorm_model(named_specs()["llama"], dtype="float16", shape=(199, 760)), tmp_path / "m.onnx")


def _one_line_error(capsys, code, expected_code=2):
    err = capsys.readouterr().err
    assert code == expected_code, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_validate_prints_the_table_and_passes(model_path, capsys):
    assert main(["validate", str(model_path), "--inputs", "stress"]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime[cpu]  y" in out and "max_ulp=2" in out and "2 passed, 0 failed" in out


def test_validate_json_and_output_file(model_path, tmp_path, capsys):
    target = tmp_path / "report.json"
    assert main(["validate", str(model_path), "--reference", "float64", "--json", "--output", str(target)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(target.read_text())
    assert printed["passed"] is True and printed["rows"][0]["check"] == "norm"
    from rmsnorm_deploy.contract.tolerances import tolerance_for

    assert printed["rows"][0]["result"]["tolerance"]["max_ulp"] == tolerance_for("norm", "onnxruntime", "float16").max_ulp
    code = main(["validate", str(model_path), "--output", str(target)])
    assert "exists; pass --force" in _one_line_error(capsys, code)
    assert main(["validate", str(model_path), "--output", str(target), "--force"]) == 0


def test_validate_exits_1_on_a_parity_failure(tmp_path, capsys):
    model = rmsnorm_model(named_specs()["llama"], dtype="float32", shape=(8, 64))
    model.graph.node[0].attribute[[a.name for a in model.graph.node[0].attribute].index("epsilon")].f = 0.5
    path = save_onnx(model, tmp_path / "tampered.onnx")
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL onnxruntime[cpu] y:" in out and "would pass with" in out and "1 failed" in out


def test_validate_exits_3_when_nothing_independent_is_compared(tmp_path, capsys):
    """A graph without metadata on one backend: its norm agrees with its own spec, which verifies
    nothing; with --no-norms nothing is compared at all. Neither passes."""
    model = rmsnorm_model(named_specs()["llama"], dtype="float32", shape=(8, 64))
    del model.metadata_props[:]
    path = save_onnx(model, tmp_path / "third-party.onnx")
    assert main(["validate", str(path), "--json"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "not verified" and data["passed"] is False
    assert "second backend" in data["not_verified"] and "--source" not in data["not_verified"]
    assert [(r["status"], r["against"]) for r in data["rows"]] == [("pass", "self-consistency (the graph's own spec)")]
    assert main(["validate", str(path), "--no-norms"]) == 3
    out = capsys.readouterr().out
    assert "0 passed, 0 failed" in out and "NOT VERIFIED: nothing was compared" in out


@pytest.mark.parametrize("command", ["validate", "audit"])
def test_bad_model_files_are_one_line_errors(tmp_path, model_path, capsys, command):
    (tmp_path / "text.onnx").write_text("this is not a model")
    data = model_path.read_bytes()
    (tmp_path / "truncated.onnx").write_bytes(data[: len(data) // 2])
    outside = rmsnorm_model(named_specs()["llama"], dtype="float32", shape=(2, 8))
    tensor = onnx.helper.make_tensor("ext", onnx.TensorProto.FLOAT, [8], np.ones(8, np.float32).tobytes(), raw=True)
    onnx.external_data_helper.set_external_data(tensor, location="../secret.bin")
    tensor.ClearField("raw_data")
    outside.graph.initializer.append(tensor)
    (tmp_path / "sub").mkdir()
    onnx.save(outside, str(tmp_path / "sub" / "outside.onnx"))
    cases = {
        tmp_path / "missing.onnx": "no such file",
        tmp_path: "not a file",
        tmp_path / "text.onnx": "not a readable ONNX model",
        tmp_path / "truncated.onnx": "truncated",
        tmp_path / "sub" / "outside.onnx": "points outside the model's folder",
    }
    for path, message in cases.items():
        err = _one_line_error(capsys, main([command, str(path)]))
        assert message in err and err.startswith(f"rmsnorm-deploy {command}: error:"), err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--providers", "gpu"], "unknown provider(s) ['gpu']"),
        (["--dim", "seq=4"], "--dim seq: no such dynamic dim"),
        (["--dim", "d0"], "is not NAME=SIZE"),
        (["--provider-option", "cuda"], "is not PROVIDER:KEY=VALUE"),
    ],
)
def test_bad_validate_arguments(model_path, capsys, args, message):
    err = _one_line_error(capsys, main(["validate", str(model_path), *args]))
    assert message in err


def test_wrong_feed_is_a_one_line_error(model_path, tmp_path, capsys):
    np.savez(tmp_path / "feed.npz", x=np.zeros((3, 760), np.float32), weight=np.ones(760, np.float16))
    err = _one_line_error(capsys, main(["validate", str(model_path), "--feed", str(tmp_path / "feed.npz")]))
    assert "'x' is float32 but the model wants float16" in err
    np.savez(tmp_path / "feed.npz", x=np.zeros((3, 700), np.float16), weight=np.ones(760, np.float16))
    err = _one_line_error(capsys, main(["validate", str(model_path), "--feed", str(tmp_path / "feed.npz")]))
    assert "'x' has shape [3, 700] but the model wants ['d0', 760]" in err


def test_unavailable_backends_are_one_line_errors(model_path, capsys):
    import onnxruntime as ort

    from rmsnorm_deploy.runners.onnxruntime import missing_provider_libraries

    code = main(["validate", str(model_path), "--providers", "cpu,cuda"])
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        err = _one_line_error(capsys, code)
        assert "CUDAExecutionProvider is not in this onnxruntime build" in err and "onnxruntime-gpu" in err
    elif missing_provider_libraries("CUDAExecutionProvider"):  # onnxruntime-gpu without CUDA's libraries
        err = _one_line_error(capsys, code)
        assert "onnxruntime[cuda]: requested CUDAExecutionProvider but ONNX Runtime created a session on" in err
    else:
        assert code in (0, 1), capsys.readouterr().err
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        err = _one_line_error(capsys, main(["validate", str(model_path), "--providers", "trt-plugin"]))
        assert "validate --providers trt-plugin needs tensorrt" in err and "Docker image" in err


def test_audit_of_our_model_passes_and_prints_both_stages(model_path, capsys):
    assert main(["audit", str(model_path), "--optimization", "disable", "--optimization", "all"]) == 0
    out = capsys.readouterr().out
    assert "as written" in out and "after onnxruntime (disable)" in out and "after onnxruntime (all)" in out
    assert "0 accumulate in float16 or bfloat16" in out


def test_audit_exits_1_on_a_float16_reduction_and_writes_json(tmp_path, capsys):
    from onnx import TensorProto as TP

    from tests.graph.test_audit import rms_chain

    path = save_onnx(rms_chain(TP.FLOAT16), tmp_path / "fp16.onnx")
    target = tmp_path / "audit.json"
    assert main(["audit", str(path), "--json", "--output", str(target)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(target.read_text())
    written, ran = data["reductions"]
    assert written["low_precision"] and written["accumulation"] == "float16"
    assert ran["stage"] == "after onnxruntime (all)" and ran["accumulation"] == "float32"
    assert main(["audit", str(path), "--optimization", "none"]) == 1
    assert "1 accumulate in float16" in capsys.readouterr().out


def test_audit_bad_arguments(model_path, capsys):
    err = _one_line_error(capsys, main(["audit", str(model_path), "--optimization", "none", "--optimization", "all"]))
    assert "do not combine" in err
    err = _one_line_error(capsys, main(["audit", str(model_path), "--onnxruntime-version", "latest"]))
    assert "is not a version" in err


def test_help_needs_no_optional_dependency():
    """--help of both commands in a process where onnxruntime and tensorrt cannot be imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = ("import contextlib, io, sys\n"
            "sys.modules['onnxruntime'] = None; sys.modules['tensorrt'] = None\n"
            "from rmsnorm_deploy.cli import main\n"
            "for command in ('validate', 'audit'):\n"
            "    try:\n        main([command, '--help'])\n"
            "    except SystemExit as e:\n        assert e.code == 0, e.code\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: rmsnorm-deploy validate" in out.stdout and "usage: rmsnorm-deploy audit" in out.stdout
