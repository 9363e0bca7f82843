"""`rmsnorm-deploy generate`: output, timings, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import shutil

import pytest

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.cli import main
from rmsnorm_deploy.graph.onnx_file import save_onnx

pytest.importorskip("onnxruntime", reason="generate runs ONNX Runtime")


def _one_line_error(capsys, code: int, *fragments: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_a_model_without_a_kv_cache_is_refused(capsys, tmp_path):
    save_onnx(rmsnorm_model(RMSNormSpec.llama(), dtype="float32", shape=(2, 8)), tmp_path / "model.onnx")
    code = main(["generate", str(tmp_path), "--input-ids", "1,2,3"])
    _one_line_error(capsys, code, "not a KV-cache model", "--kv-cache")


@pytest.mark.parametrize("argv, fragments", [
    (["--input-ids", "1,2,x"], ["not a comma-separated list of integers"]),
    (["--input-ids", ","], ["--input-ids is empty"]),
    (["--input-ids", "1", "--providers", "npu"], ["unknown provider 'npu'"]),
    (["--input-ids", "1", "--seed", "-1", "--sample"], ["--seed must be an integer >= 0"]),
    (["--input-ids", "1", "--temperature", "0", "--sample"], ["--temperature must be a finite number > 0"]),
    (["--input-ids", "1", "--top-k", "-2", "--sample"], ["--top-k must be an integer >= 0"]),
    (["--input-ids", "1", "--top-p", "0", "--sample"], ["--top-p must be a number > 0 and <= 1"]),
    (["--input-ids", "1", "--speculative-k", "3"], ["--speculative-k needs --speculative"]),
    (["--input-ids", "1", "--speculative", "ngram", "--speculative-k", "0"], ["--speculative-k must be an integer >= 1"]),
])
def test_bad_options_are_one_line_errors_before_the_model_is_read(capsys, tmp_path, argv, fragments):
    (tmp_path / "model.onnx").write_bytes(b"not read")
    _one_line_error(capsys, main(["generate", str(tmp_path), *argv]), *fragments)


def test_a_folder_without_a_model_is_refused(capsys, tmp_path):
    _one_line_error(capsys, main(["generate", str(tmp_path), "--input-ids", "1"]), "no model.onnx in this folder")


@pytest.mark.slow  # shares the exported tiny Llama (tests/kv_models.py: one torch.onnx export per process)
def test_generate_prints_tokens_and_timings_and_refuses_what_does_not_fit(capsys, tmp_path):
    from tests.kv_models import exported_kv

    from rmsnorm_deploy.decoder.generate import KVCacheModel, generate

    folder, _ = exported_kv("llama")
    with KVCacheModel(folder) as kv:
        expected = generate(kv, [[5, 17, 99]], max_new_tokens=6).tokens[0]
    assert main(["generate", str(folder), "--input-ids", "5,17,99", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == [expected] and out["providers"] == ["CPUExecutionProvider"]
    assert out["prefill_ms"] > 0 and out["decode_steps"] == len(expected) - 1
    assert main(["generate", str(folder), "--input-ids", "5,17,99", "--max-new-tokens", "6"]) == 0
    text = capsys.readouterr().out
    assert "tokens: " + ",".join(map(str, expected)) in text and "ms/token" in text and "tokens/s" in text

    too_long = ",".join(["1"] * 129)  # the tiny config has 128 positions
    _one_line_error(capsys, main(["generate", str(folder), "--input-ids", too_long]),
                    "129 tokens, longer than the model's maximum of 128")
    _one_line_error(capsys, main(["generate", str(folder), "--input-ids", "1,2", "--max-new-tokens", "127"]),
                    "lower --max-new-tokens to at most 126")
    _one_line_error(capsys, main(["generate", str(folder), "--input-ids", "1,256"]),
                    "token id 256 is outside the model's vocabulary [0, 256)")
    _one_line_error(capsys, main(["generate", str(folder), "--prompt", "hello"]), "has no tokenizer.json")

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    (copy / "genai_config.json").write_text("[1, 2]")
    _one_line_error(capsys, main(["generate", str(copy), "--input-ids", "1"]), "has no 'model' object")
