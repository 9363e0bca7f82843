"""`rmsnorm-deploy env`: every piece reported, missing ones said to be missing, providers probed
for real, a missing GPU an error only when asked; on a GPU (the Docker image) the CUDA
provider and our TensorRT plugin must load."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch

from rmsnorm_deploy import environment
from rmsnorm_deploy.cli import main

KEYS = ["rmsnorm-deploy", "python", "torch", "torch.cuda", "cuda.available", "driver", "cuda.driver_api",
        "cuda.runtime", "onnxruntime", "tensorrt", "tensorrt.plugin", "triton", "onnx", "onnxscript"]
HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")


@pytest.fixture(scope="module")
def env_json():
    """`rmsnorm-deploy env --json`, run once for the module (it imports and probes everything)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["env", "--json"])
    assert code == 0
    return json.loads(out.getvalue())


def test_env_reports_every_piece(env_json):
    assert [k for k in KEYS if k not in env_json] == []
    assert env_json["torch"] == torch.__version__
    assert ("gpu" in env_json) is HAS_GPU and ("cuda.error" in env_json) is not HAS_GPU
    for key in ("cuda.driver_api", "cuda.runtime"):
        assert re.match(r"\d+\.\d+( |$)|not found \(", env_json[key]), env_json[key]
    if importlib.util.find_spec("onnxruntime"):
        assert "CPUExecutionProvider" in env_json["onnxruntime.providers"]
        assert {"onnxruntime.cuda_ep", "onnxruntime.tensorrt_ep"} <= set(env_json)


def test_env_table_and_output_file(tmp_path, capsys):
    target = tmp_path / "env.json"
    assert main(["env", "--output", str(target)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["what", "value"] and "tensorrt.plugin" in table
    assert json.loads(target.read_text())["python"] in table
    assert main(["env", "--output", str(target)]) == 2  # no --force: the file is kept
    assert f"{target} exists; pass --force to replace it" in capsys.readouterr().err
    assert main(["env", "--output", str(target), "--force", "--json"]) == 0


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: the missing-GPU error cannot show here")
def test_require_gpu_without_a_gpu_is_a_one_line_error_after_the_table(capsys):
    assert main(["env", "--require-gpu"]) == 2
    captured = capsys.readouterr()
    assert "cuda.available" in captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("rmsnorm-deploy env: error: no CUDA GPU is visible (") and "docker run --gpus all" in err


def test_onnxruntime_probe_says_whether_a_session_runs_on_the_provider():
    ort = pytest.importorskip("onnxruntime", reason="the probe runs an ONNX Runtime session")
    assert environment.probe_onnxruntime_provider("CPUExecutionProvider") == "loads"
    missing = [p for p in environment.PROBED_PROVIDERS.values() if p not in ort.get_available_providers()]
    for provider in missing:
        assert environment.probe_onnxruntime_provider(provider) == (
            f"not in this build ({provider} is not among onnxruntime's providers)")


def test_plugin_status_without_tensorrt_is_absent():
    assert environment.plugin_status(False) == "absent (needs tensorrt, which is not importable here)"


def test_plugin_status_reports_what_load_plugin_does():
    status = environment.plugin_status(True)
    if importlib.util.find_spec("rmsnorm_deploy.tensorrt.plugin") is None:
        assert status == "absent (this build of rmsnorm-deploy has no rmsnorm_deploy.tensorrt.plugin)"
        return
    from rmsnorm_deploy.tensorrt.plugin_loader import load_plugin

    try:
        loaded = load_plugin()
    except Exception as exc:
        assert status == f"error: {environment.one_line(exc)}"
    else:
        assert status.startswith("loaded: ") and status != "loaded: " and loaded is not None


def test_env_works_with_no_optional_dependency(monkeypatch, capsys):
    # None in sys.modules makes an import fail as if the package were missing (and find_spec say so).
    for name in ("onnxruntime", "tensorrt", "triton", "rmsnorm_deploy.tensorrt.plugin"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tensorrt"] == "not installed" or info["tensorrt"].startswith("import failed: ")
    assert info["tensorrt.plugin"] == "absent (needs tensorrt, which is not importable here)"
    if info["onnxruntime"] != "not installed":  # the distribution is there, its module is not
        assert info["onnxruntime.providers"].startswith("import failed: import of onnxruntime halted")


@pytest.mark.cuda
@needs_gpu
def test_env_on_a_gpu_finds_it_and_the_driver_runs_torchs_cuda(env_json, capsys):
    assert main(["env", "--require-gpu"]) == 0
    capsys.readouterr()
    assert env_json["cuda.available"] is True and env_json["gpu"].startswith("0: ")
    driver_cuda = re.match(r"(\d+)\.(\d+)", env_json["cuda.driver_api"])
    assert driver_cuda, env_json["cuda.driver_api"]
    built = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
    assert (int(driver_cuda[1]), int(driver_cuda[2])) >= (built[0], 0), "the driver is older than torch's CUDA major"


@pytest.mark.cuda
@needs_gpu
def test_env_on_a_gpu_runs_onnxruntimes_cuda_provider(env_json):
    ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime-gpu")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"needs onnxruntime-gpu: {env_json['onnxruntime']} has no CUDAExecutionProvider")
    assert env_json["onnxruntime.cuda_ep"] == "loads"


@pytest.mark.trt
@needs_gpu
def test_env_on_a_gpu_loads_our_tensorrt_plugin(env_json):
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("needs tensorrt: it is not installed")
    if importlib.util.find_spec("rmsnorm_deploy.tensorrt.plugin") is None:
        pytest.skip("needs rmsnorm_deploy.tensorrt.plugin, which this build does not have")
    assert env_json["tensorrt"].startswith(("10.", "11.")), env_json["tensorrt"]
    assert env_json["tensorrt.plugin"].startswith("loaded: "), env_json["tensorrt.plugin"]
