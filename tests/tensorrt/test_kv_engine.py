"""A KV-cache engine: built with its prefill and decode profiles, its decode loop gives ONNX Runtime's tokens.

Needs tensorrt and a CUDA GPU (the Docker image, `pytest -m trt`); elsewhere it skips with the reason.
"""

from __future__ import annotations

from tests.tensorrt._gpu import needs_trt

pytestmark = needs_trt


def test_kv_engine_decode_loop_generates_onnxruntime_tokens(tmp_path):
    from tests.kv_models import exported_kv

    from rmsnorm_deploy.decoder.convention import layout_of
    from rmsnorm_deploy.graph.metadata import ModelMetadata
    from rmsnorm_deploy.graph.onnx_file import load_onnx
    from rmsnorm_deploy.tensorrt.runner import TensorRTRunner
    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate
    from rmsnorm_deploy.tensorrt.build import build_engine

    folder, _ = exported_kv("llama")
    report = build_engine(folder / "model.onnx", tmp_path / "model.engine", progress=False)
    assert [p["name"] for p in report_profiles(tmp_path)] == ["prefill", "decode"]
    layout = layout_of(ModelMetadata.read(load_onnx(folder / "model.onnx", load_external=False)))
    prompts = [[5, 17, 99, 3], [11, 12]]
    with KVCacheModel(folder) as kv:
        expected = generate(kv, prompts, max_new_tokens=16, eos_token_id=None).tokens
    with TensorRTRunner(report.engine_path) as runner:
        assert runner.generate(layout, prompts, max_new_tokens=16) == expected


def report_profiles(folder):
    import json

    return json.loads((folder / "model.engine.json").read_text())["profiles"]["profile_set"]
