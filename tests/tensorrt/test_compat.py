"""The static TensorRT compatibility check, on models of every lowering (no TensorRT needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.tensorrt._models import two_norm_model
from onnx import TensorProto, helper

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.cli import main
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.lowerings import LOWERINGS
from rmsnorm_deploy.graph.onnx_file import save_onnx
from rmsnorm_deploy.tensorrt.compat import (
    DEFAULT_VERSIONS,
    check_model,
    parse_version,
    parser_facts,
)

REPO = Path(__file__).resolve().parents[2]


def spec_for(lowering: str) -> RMSNormSpec:
    # The ort lowering cannot round before scaling (refused), so it gets torch's order.
    return RMSNormSpec.torch_rmsnorm() if lowering == "ort" else RMSNormSpec.llama()


def blocking(report) -> list:
    return [f for f in report.findings if f.blocking]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_every_lowering_against_every_default_version(lowering, dtype):
    model = rmsnorm_model(spec_for(lowering), dtype=dtype, shape=(4, 8), lowering=lowering)
    reports = {r.version: r for r in check_model(model)}
    assert list(reports) == list(DEFAULT_VERSIONS)
    if lowering in ("function", "inline", "plugin"):
        assert all(r.imports for r in reports.values()), [r.findings for r in reports.values()]
    if lowering == "plugin":
        for r in reports.values():
            (note,) = r.findings
            assert not note.blocking and "the RMSNorm plugin runs it when its library is loaded" in note.problem
    if lowering == "native":
        assert reports["10.15"].imports and reports["11.0"].imports
        problems = {f.op: f for f in blocking(reports["10.9"])}
        assert set(problems) == {"RMSNormalization", "opset 23"}
        assert problems["RMSNormalization"].problem.startswith("RMSNormalization is imported from TensorRT 10.15 on")
        assert "--lowering function" in problems["RMSNormalization"].fix
        assert problems["opset 23"].fix == "re-export with --opset 22 or lower"
    if lowering == "ort":
        for r in reports.values():
            (finding,) = blocking(r)
            assert finding.op == "SimplifiedLayerNormalization" and finding.node == "rmsnorm"
            assert "no TensorRT version imports it" in finding.problem
            assert finding.fix.startswith("the ort lowering is for ONNX Runtime only; re-export with --lowering function")


def test_several_overloads_of_one_function_are_flagged():
    model = two_norm_model(RMSNormSpec.llama(), RMSNormSpec.gemma(), dtype="float16", hidden=8)
    assert len(model.functions) == 2
    for report in check_model(model):
        (finding,) = blocking(report)
        assert finding.op == "RMSNorm"
        assert "2 local functions are named 'RMSNorm'" in finding.problem
        assert "keys functions by name only" in finding.problem
        assert "rmsnorm-deploy build" in finding.fix and "--lowering inline" in finding.fix
    one_overload = two_norm_model(RMSNormSpec.llama(1e-5), RMSNormSpec.llama(1e-6), dtype="float16", hidden=8)
    assert len(one_overload.functions) == 1
    assert all(r.imports for r in check_model(one_overload))


def test_float64_accumulation_is_flagged():
    model = rmsnorm_model(RMSNormSpec(accumulation="float64"), dtype="float32", shape=(4, 8))
    for report in check_model(model, ["11.0"]):
        (finding,) = blocking(report)
        assert finding.op == "float64" and "TensorRT casts DOUBLE down to FLOAT" in finding.problem


def _model_with(node, opset=18, elem=TensorProto.FLOAT16):
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, [2, 8])],
                              [helper.make_tensor_value_info("y", elem, [2, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])


def test_com_microsoft_ops_are_flagged_with_their_origin():
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "x"], ["y"], name="skipnorm",
                            domain="com.microsoft")
    (finding,) = blocking(check_model(_model_with(node), ["10.15"])[0])
    assert finding.op == "com.microsoft::SkipSimplifiedLayerNormalization" and finding.node == "skipnorm"
    assert "no importer for 'com.microsoft' ops" in finding.problem
    assert "ONNX Runtime's graph optimizer" in finding.fix
    gelu = helper.make_node("Gelu", ["x"], ["y"], name="gelu", domain="com.microsoft")
    (finding,) = blocking(check_model(_model_with(gelu), ["10.15"])[0])
    assert "ignores the domain and would import it as the standard ONNX Gelu" in finding.problem


def test_ops_added_in_later_versions_and_unsupported_ops():
    attention = helper.make_node("Attention", ["x", "x", "x"], ["y"], name="attn")
    assert not check_model(_model_with(attention, opset=23), ["10.9"])[0].imports
    (finding,) = [f for f in check_model(_model_with(attention, opset=23), ["10.11"])[0].findings]
    assert finding.problem.startswith("imported from TensorRT 10.14 on")
    assert finding.fix == "use TensorRT 10.14 or newer, or re-export without --fuse-attention at opset 22 or lower"
    assert check_model(_model_with(attention, opset=23), ["10.14"])[0].imports
    rotary = helper.make_node("RotaryEmbedding", ["x", "x", "x"], ["y"], name="rope")
    (finding,) = check_model(_model_with(rotary, opset=23), ["10.14"])[0].findings
    assert finding.problem.startswith("imported from TensorRT 10.15 on") and "--fuse-attention" in finding.fix
    opset_finding, _ = check_model(_model_with(rotary, opset=23), ["10.9"])[0].findings
    assert opset_finding.fix == "re-export with --opset 22 or lower (and without --fuse-attention, which needs opset 23)"
    unique = helper.make_node("Unique", ["x"], ["y"], name="u")
    (finding,) = check_model(_model_with(unique), ["11.0"])[0].findings
    assert finding.problem == "operators.md marks it unsupported in every TensorRT version"
    custom = helper.make_node("MyOp", ["x"], ["y"], name="m")
    (finding,) = check_model(_model_with(custom), ["11.0"])[0].findings
    assert finding.problem == "not in TensorRT 11.0's operators.md" and "plugin" in finding.fix


def test_version_parsing_and_facts():
    assert parse_version("10.9") == (10, 9) and parse_version("10.9.0.34") == (10, 9) and parse_version("11.2") == (11, 2)
    assert parser_facts("10.15").max_opset == 24 and parser_facts("11.1").max_opset == 25
    assert "RMSNormalization" in parser_facts("10.15").ops and "RMSNormalization" not in parser_facts("10.14").ops
    assert "Swish" in parser_facts("11.0").ops and "Swish" not in parser_facts("10.16").ops
    with pytest.raises(UserError, match=r"TensorRT 10.8 is older than 10.9, the oldest this project supports"):
        parse_version("10.8")
    with pytest.raises(UserError, match=r"no compatibility table for TensorRT 12.0 yet"):
        parse_version("12.0")
    with pytest.raises(UserError, match=r"TensorRT version 'ten' is not MAJOR.MINOR"):
        parse_version("ten")


def test_cli_exit_codes_and_output(tmp_path, capsys):
    good = tmp_path / "function.onnx"
    bad = tmp_path / "ort.onnx"
    save_onnx(rmsnorm_model(RMSNormSpec.llama(), dtype="float16", shape=(4, 8)), good)
    save_onnx(rmsnorm_model(RMSNormSpec.torch_rmsnorm(), dtype="float16", shape=(4, 8), lowering="ort"), bad)
    assert main(["check-trt", str(good)]) == 0
    out = capsys.readouterr().out
    assert "TensorRT 10.9: imports" in out and "TensorRT 11.0: imports" in out
    assert main(["check-trt", str(bad), "--trt-version", "10.15"]) == 1
    out = capsys.readouterr().out
    assert "TensorRT 10.15: would NOT import" in out and "SimplifiedLayerNormalization" in out
    assert main(["check-trt", str(bad), "--json", "--trt-version", "11.0"]) == 1
    (data,) = json.loads(capsys.readouterr().out)
    assert data["tensorrt"] == "11.0" and data["imports"] is False
    assert data["findings"][0]["op"] == "SimplifiedLayerNormalization"
    assert main(["check-trt", str(good), "--trt-version", "9.0"]) == 2
    assert "error: TensorRT 9.0 is older than 10.9" in capsys.readouterr().err
    assert main(["check-trt", str(tmp_path / "missing.onnx")]) == 2
    assert "missing.onnx: no such file" in capsys.readouterr().err


def test_cli_never_imports_tensorrt(tmp_path):
    path = tmp_path / "native.onnx"
    save_onnx(rmsnorm_model(RMSNormSpec.llama(), dtype="bfloat16", shape=(4, 8), lowering="native"), path)
    script = (
        "import sys; from rmsnorm_deploy.cli import main; "
        f"code = main(['check-trt', {str(path)!r}, '--trt-version', '10.9', '--trt-version', '11.0']); "
        "print('tensorrt imported:', 'tensorrt' in sys.modules); sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "TensorRT 10.9: would NOT import" in done.stdout and "TensorRT 11.0: imports" in done.stdout
    assert "tensorrt imported: False" in done.stdout
