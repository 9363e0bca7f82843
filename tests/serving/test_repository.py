"""``rmsnorm-deploy triton-repo``: configs parsed back into Triton's ``ModelConfig``, files in place,
nothing clobbered without ``--force``. The standalone server itself cannot run here (no Docker
engine, no NGC image): these tests check what it would be given."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from rmsnorm_deploy.cli import main
from tests.serving._models import external_data_model, fixed_shape_model, kv_cache_model

pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="parsing Triton configs needs tritonclient[grpc]")
from google.protobuf import text_format  # noqa: E402
from tritonclient.grpc import model_config_pb2  # noqa: E402


def _config(repo, name="model"):
    message = model_config_pb2.ModelConfig()
    text_format.Parse((repo / name / "config.pbtxt").read_text(), message)
    return message


def test_tiny_export_gets_an_onnxruntime_model_with_dynamic_batching(tiny_export, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["triton-repo", str(tiny_export), "-o", str(repo), "--instances", "2"]) == 0
    config = _config(repo)
    assert config.name == "model" and config.backend == "onnxruntime"
    assert config.max_batch_size == 8  # the export's batch range (metadata dims batch max)
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("input_ids", model_config_pb2.TYPE_INT64, [-1])]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("logits", model_config_pb2.TYPE_FP32, [-1, 512])]
    assert config.HasField("dynamic_batching") and not config.HasField("sequence_batching")
    assert [(g.count, g.kind) for g in config.instance_group] == [(2, model_config_pb2.ModelInstanceGroup.KIND_CPU)]
    assert config.default_model_filename == "model.onnx"
    assert (repo / "model" / "1" / "model.onnx").read_bytes() == (tiny_export / "model.onnx").read_bytes()
    assert "config.pbtxt" in capsys.readouterr().out


def test_existing_model_is_kept_without_force_and_replaced_with_it(tiny_export, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["triton-repo", str(tiny_export / "model.onnx"), "-o", str(repo), "--max-batch", "4"]) == 0
    other = repo / "other_model"
    other.mkdir()
    assert main(["triton-repo", str(tiny_export), "-o", str(repo), "--max-batch", "16"]) == 2
    err = capsys.readouterr().err
    assert "exists; pass --force" in err and err.count("\n") == 1
    assert _config(repo).max_batch_size == 4  # untouched
    assert main(["triton-repo", str(tiny_export), "-o", str(repo), "--max-batch", "16", "--force"]) == 0
    assert _config(repo).max_batch_size == 16
    assert other.is_dir()  # other models in the repository stay
    assert [p.name for p in repo.iterdir() if p.name.startswith(".")] == []  # no staging left


def test_external_data_travels_with_the_model(tmp_path):
    source = external_data_model(tmp_path / "src")
    repo = tmp_path / "repo"
    assert main(["triton-repo", str(source), "-o", str(repo), "--model-name", "mm"]) == 0
    copied = onnx.load(str(repo / "mm" / "1" / "model.onnx"))  # loads its data from the new folder
    w = onnx.numpy_helper.to_array(copied.graph.initializer[0])
    assert np.array_equal(w, np.arange(49, dtype=np.float32).reshape(7, 7))
    assert _config(repo, "mm").max_batch_size == 8  # no metadata: the default


def test_kv_cache_graph_gets_sequence_batching_with_the_cache_as_implicit_state(tmp_path):
    source = kv_cache_model(tmp_path / "kv.onnx", layers=2, kv_heads=2, head_dim=4)
    repo = tmp_path / "repo"
    assert main(["triton-repo", str(source), "-o", str(repo), "--instances", "3"]) == 0
    config = _config(repo)
    assert [i.name for i in config.input] == ["input_ids", "attention_mask", "position_ids"]
    assert [o.name for o in config.output] == ["logits"]
    assert config.max_batch_size == 1 and not config.HasField("dynamic_batching")
    batching = config.sequence_batching
    assert batching.HasField("direct") and batching.max_sequence_idle_microseconds > 0
    pairs = [(s.input_name, s.output_name) for s in batching.state]
    assert pairs == [(f"past_key_values.{i}.{k}", f"present.{i}.{k}") for i in range(2) for k in ("key", "value")]
    for state in batching.state:
        assert state.data_type == model_config_pb2.TYPE_FP32 and list(state.dims) == [2, -1, 4]
        (initial,) = state.initial_state
        assert list(initial.dims) == [2, 0, 4] and initial.zero_data and initial.data_type == state.data_type
    assert [(g.count, g.kind) for g in config.instance_group] == [(3, model_config_pb2.ModelInstanceGroup.KIND_CPU)]


def test_kv_cache_graph_whose_pairs_do_not_match_is_refused(tmp_path, capsys):
    source = kv_cache_model(tmp_path / "kv.onnx", layers=2, drop_present=1)
    assert main(["triton-repo", str(source), "-o", str(tmp_path / "repo")]) == 2
    err = capsys.readouterr().err
    assert "do not pair up" in err and "(1, 'key')" in err
    assert not (tmp_path / "repo" / "model").exists()


def test_graph_without_batch_dim_is_served_unbatched_and_refuses_max_batch(tmp_path, capsys):
    source = fixed_shape_model(tmp_path / "fixed.onnx")
    repo = tmp_path / "repo"
    assert main(["triton-repo", str(source), "-o", str(repo)]) == 0
    config = _config(repo)
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [4, 3]
    assert not config.HasField("dynamic_batching")
    assert main(["triton-repo", str(source), "-o", str(repo), "--force", "--max-batch", "4"]) == 2
    assert "needs a leading dynamic batch dim" in capsys.readouterr().err


def _engine(tmp_path, source, batch_max=8):
    from rmsnorm_deploy.tensorrt.sidecar import Device, Sidecar, sha256_file, sidecar_path, write_sidecar

    engine = tmp_path / "model.engine"
    engine.write_bytes(b"not a real engine: the repository only copies it")
    profiles = {"dims": {"batch": {"min": 1, "opt": 2, "max": batch_max, "source": "metadata"}}, "inputs": {}}
    write_sidecar(Sidecar(engine_sha256=sha256_file(engine), device=Device("10.15.1", "NVIDIA H100", "9.0"),
                          profiles=profiles, plugin=None, source_model={"path": str(source)}), sidecar_path(engine))
    return engine


def test_engine_gets_a_tensorrt_model_on_gpus_from_its_source_model(tiny_export, tmp_path, capsys):
    engine = _engine(tmp_path, tiny_export / "model.onnx", batch_max=4)
    repo = tmp_path / "repo"
    assert main(["triton-repo", str(engine), "-o", str(repo)]) == 0
    config = _config(repo)
    assert config.backend == "tensorrt" and config.default_model_filename == "model.plan"
    assert config.max_batch_size == 4  # the engine's profile, not the model's metadata
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert (repo / "model" / "1" / "model.plan").read_bytes() == engine.read_bytes()
    assert json.loads((repo / "model" / "1" / "model.plan.json").read_text())["tensorrt"] == "10.15.1"
    capsys.readouterr()
    assert main(["triton-repo", str(engine), "-o", str(repo), "--force", "--max-batch", "8"]) == 2
    assert "exceeds the engine's profile" in capsys.readouterr().err
    assert main(["triton-repo", str(engine), "-o", str(repo), "--force", "--kind", "cpu"]) == 2
    assert "GPU only" in capsys.readouterr().err


def test_engine_whose_bytes_changed_is_refused(tiny_export, tmp_path, capsys):
    engine = _engine(tmp_path, tiny_export / "model.onnx")
    engine.write_bytes(b"replaced")
    assert main(["triton-repo", str(engine), "-o", str(tmp_path / "repo")]) == 2
    assert "does not match its sidecar" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["{missing}", "-o", "{repo}"], "no such file or folder"),
    (["{notonnx}", "-o", "{repo}"], "not a readable ONNX model"),
    (["{kv}", "-o", "{repo}", "--model-name", "a/b"], "--model-name"),
    (["{kv}", "-o", "{repo}", "--model-name", "model\n"], "--model-name 'model\\n'"),
    (["{kv}", "-o", "{repo}", "--instances", "0"], "--instances 0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    paths = {"missing": tmp_path / "nope", "repo": tmp_path / "repo", "kv": kv_cache_model(tmp_path / "kv.onnx"),
             "notonnx": tmp_path / "bad.onnx"}
    paths["notonnx"].write_text("not onnx")
    assert main(["triton-repo"] + [a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "triton" / "serve_and_check.sh"


def test_serve_and_check_script_passes_shellcheck():
    local = SCRIPT.parents[2] / ".venv-lint" / "bin" / "shellcheck"
    shellcheck = str(local) if local.exists() else shutil.which("shellcheck")
    if not shellcheck:
        pytest.skip("shellcheck is not installed here: `make lint-docker` installs it (CI runs it before the tests)")
    proc = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_serve_and_check_script_refuses_a_folder_that_is_not_a_repository(tmp_path):
    # Docker is never reached: the script checks its input first (exit 2, one line)
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "config.pbtxt not found" in proc.stderr and proc.stderr.count("\n") == 1
    assert "Usage: serve_and_check.sh REPO" in subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True,
                                                               text=True, timeout=30).stdout
