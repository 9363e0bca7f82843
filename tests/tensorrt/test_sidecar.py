"""The engine sidecar: written, read back, and a foreign or stale engine refused (no TensorRT needed)."""

from __future__ import annotations

import json

import pytest

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.tensorrt.runner import TensorRTRunner
from rmsnorm_deploy.tensorrt.profiles import resolve_profiles
from rmsnorm_deploy.tensorrt.runtime import PluginError
from rmsnorm_deploy.tensorrt.sidecar import (
    Device,
    EngineMismatchError,
    Sidecar,
    check_compatible,
    check_engine_hash,
    read_sidecar,
    sha256_bytes,
    sidecar_path,
    write_sidecar,
)

H100 = Device("10.8.0.43", "NVIDIA H100 80GB HBM3", "9.0")
PLAN = b"not a real plan: the sidecar logic only hashes bytes"


def make_engine(tmp_path, *, plugin=None, device=H100, plan=PLAN):
    engine = tmp_path / "model.engine"
    engine.write_bytes(plan)
    profiles = resolve_profiles(rmsnorm_model(RMSNormSpec.llama(), dtype="float16", shape=(199, 760)), ["d0:1,64,256"])
    sidecar = Sidecar(sha256_bytes(plan), device, profiles.to_dict(), plugin, {"path": "model.onnx", "sha256": "ab"},
                      lowering="function", dtype="float16", norms=[{"norm": "rmsnorm", "reduction": "float32"}],
                      built_by="rmsnorm-deploy test")
    write_sidecar(sidecar, sidecar_path(engine))
    return engine, sidecar


def test_sidecar_round_trip(tmp_path):
    engine, written = make_engine(tmp_path, plugin={"name": "RMSNorm", "namespace": "rmsnorm_deploy", "version": "1"})
    assert sidecar_path(engine).name == "model.engine.json"
    data = json.loads(sidecar_path(engine).read_text())
    assert data["format"] == 1 and data["tensorrt"] == "10.8.0.43" and data["compute_capability"] == "9.0"
    assert data["strongly_typed"] is True and data["plugin"]["namespace"] == "rmsnorm_deploy"
    assert data["profiles"]["dims"]["d0"] == {"min": 1, "opt": 64, "max": 256, "source": "--profile"}
    read = read_sidecar(engine)
    assert read == written
    check_engine_hash(read, engine)
    check_compatible(read, H100, engine_path=engine)


@pytest.mark.parametrize("other, message", [
    (Device("11.0.0.1", H100.gpu, "9.0"), r"was built for TensorRT 10.8.0.43 \(this is 11.0.0.1\)"),
    (Device(H100.tensorrt, "NVIDIA A100-SXM4-80GB", "8.0"),
     r"compute capability 9.0 \(this GPU has 8.0\), GPU 'NVIDIA H100 80GB HBM3' \(this is 'NVIDIA A100-SXM4-80GB'\)"),
    (Device(H100.tensorrt, "NVIDIA H200", "9.0"), r"GPU 'NVIDIA H100 80GB HBM3' \(this is 'NVIDIA H200'\)"),
])
def test_an_engine_from_another_tensorrt_or_gpu_is_refused(tmp_path, other, message):
    engine, sidecar = make_engine(tmp_path)
    with pytest.raises(EngineMismatchError, match=message + r"; engines only run where they were built: rebuild it"):
        check_compatible(read_sidecar(engine), other, engine_path=engine)


def test_a_replaced_engine_is_refused(tmp_path):
    engine, sidecar = make_engine(tmp_path)
    engine.write_bytes(PLAN + b"!")
    with pytest.raises(EngineMismatchError, match=r"does not match its sidecar .* the engine was replaced or damaged"):
        check_engine_hash(read_sidecar(engine), engine)


def test_missing_damaged_and_foreign_sidecars(tmp_path):
    with pytest.raises(UserError, match=r"no such engine file; build one with `rmsnorm-deploy build"):
        read_sidecar(tmp_path / "none.engine")
    engine = tmp_path / "bare.engine"
    engine.write_bytes(PLAN)
    with pytest.raises(EngineMismatchError, match=r"has no sidecar bare.engine.json, so its TensorRT version and GPU "
                                                  r"are unknown"):
        read_sidecar(engine)
    sidecar_path(engine).write_text("{not json")
    with pytest.raises(EngineMismatchError, match=r"bare.engine.json: unreadable"):
        read_sidecar(engine)
    sidecar_path(engine).write_text(json.dumps({"format": 99}))
    with pytest.raises(EngineMismatchError, match=r"has format 99, this version reads format 1"):
        read_sidecar(engine)
    sidecar_path(engine).write_text(json.dumps({"format": 1, "tensorrt": "10.8"}))
    with pytest.raises(EngineMismatchError, match=r"is missing 'engine_sha256'"):
        read_sidecar(engine)


def test_the_runner_checks_the_sidecar_and_the_plugin_before_tensorrt(tmp_path):
    # These refusals come before TensorRT is imported, so they hold with or without it.
    with pytest.raises(EngineMismatchError, match=r"has no sidecar"):
        (tmp_path / "bare.engine").write_bytes(PLAN)
        TensorRTRunner(tmp_path / "bare.engine").activate()
    engine, _ = make_engine(tmp_path, plugin={"name": "RMSNorm"})
    runner = TensorRTRunner(engine)
    assert runner.backend == "tensorrt" and runner.name == "tensorrt"
    with pytest.raises(PluginError, match=r"holds the RMSNorm plugin; run it with the plugin"):
        runner.activate()
    assert not runner.is_active
    (tmp_path / "plain").mkdir()
    engine, _ = make_engine(tmp_path / "plain", plugin=None)
    runner = TensorRTRunner(engine, plugin=True)
    assert runner.name == "tensorrt[plugin]"
    with pytest.raises(PluginError, match=r"the plugin was requested but .* was built without it"):
        runner.activate()
