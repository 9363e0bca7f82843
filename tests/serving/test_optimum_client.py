"""optimum-onnx's ``ORTModelForCausalLM`` loads our ``--kv-cache`` folders (both targets, a preset) and generates
``generate``'s greedy tokens, rows left-padded (``benchmarks/optimum_client.py check``).

optimum-onnx needs transformers < 4.58, so it lives in its own environment, never beside this
package: the test runs when ``RMSNORM_DEPLOY_OPTIMUM_PYTHON`` names that environment's Python
(docs/kv-cache.md: how to make it) and skips with that reason elsewhere (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

PYTHON = os.environ.get("RMSNORM_DEPLOY_OPTIMUM_PYTHON")
CLIENT = Path(__file__).resolve().parents[2] / "benchmarks" / "optimum_client.py"
PROMPTS = [[5, 17, 99, 3, 44, 8], [11, 12], [7, 8, 9, 10]]

pytestmark = pytest.mark.skipif(
    not PYTHON, reason="needs a Python with optimum-onnx (transformers < 4.58, its own environment): set "
                       "RMSNORM_DEPLOY_OPTIMUM_PYTHON to it (docs/kv-cache.md)")


def _ort_target_folder(tmp_path: Path) -> Path:
    from rmsnorm_deploy.cli import main
    from rmsnorm_deploy.exporter import hf

    source = tmp_path / "hf"
    hf.from_config(hf.TINY_CONFIGS["llama"], "float32", seed=0).module.model.save_pretrained(source)
    out = tmp_path / "ort"
    assert main(["export", str(source), "--kv-cache", "--target", "onnxruntime", "-o", str(out)]) == 0
    return out


def _preset_folder(tmp_path: Path) -> Path:
    from rmsnorm_deploy.cli import main

    out = tmp_path / "preset"
    assert main(["export", "tiny", "--kv-cache", "-o", str(out), "--seq", "8"]) == 0
    return out


@pytest.mark.parametrize("target", ["portable", "onnxruntime", "preset"])
def test_optimum_generates_our_greedy_tokens(tmp_path, target):
    from tests.kv_models import exported_kv

    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate

    if target == "portable":
        folder = exported_kv("llama")[0]
    else:
        folder = _ort_target_folder(tmp_path) if target == "onnxruntime" else _preset_folder(tmp_path)
    with KVCacheModel(folder) as kv:
        ours = generate(kv, PROMPTS, max_new_tokens=16)
    expected = tmp_path / "ours.json"
    expected.write_text(json.dumps(ours.to_dict()))
    proc = subprocess.run([PYTHON, str(CLIENT), "check", str(folder), str(expected)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:] or proc.stdout[-2000:]
    answer = json.loads(proc.stdout)
    assert answer["same_tokens"] is True and answer["optimum_tokens"] == ours.tokens
    assert answer["class"] == "ORTModelForCausalLM" and answer["use_cache"] is True


@pytest.mark.parametrize(("model", "message"), [
    (None, "no model.onnx; give the folder `rmsnorm-deploy export --kv-cache` wrote"),
    (b"not an onnx file", "ORTModelForCausalLM cannot load"),
])
def test_a_folder_optimum_cannot_load_is_a_one_line_error(tmp_path, model, message):
    (tmp_path / "ours.json").write_text(json.dumps({"prompts": [[1, 2]], "tokens": [[3]]}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if model is not None:
        (tmp_path / "model.onnx").write_bytes(model)
    proc = subprocess.run([PYTHON, str(CLIENT), "check", str(tmp_path), str(tmp_path / "ours.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
