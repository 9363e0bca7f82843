"""GGUF files in: ``export FILE.gguf`` on every path, held to transformers' model of the same file.

Small synthetic GGUF files (``tests/gguf_files.py``: random Llama, Qwen2, Qwen3 and Gemma 3 models
written as llama.cpp writes them, projections in Q8_0, Q4_0 or F32, a BPE tokenizer and a chat
template in the metadata) go through the CLI as a user runs it; the greedy tokens of the exported
graph must equal transformers' greedy tokens on the model its GGUF loader reads from the same file.
One test runs the real SmolLM2-135M-Instruct GGUF (Q4_1). Bad files are refused in one line, exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import onnx
import pytest
import torch

pytest.importorskip("transformers", reason="GGUF files are read by transformers' GGUF loader")
pytest.importorskip("gguf", reason="writing the test's GGUF files needs gguf: pip install 'rmsnorm-deploy[gguf]'")
pytest.importorskip("accelerate",
                    reason="transformers' GGUF loader needs accelerate: pip install 'rmsnorm-deploy[gguf]'")
pytest.importorskip("onnxruntime", reason="the exported graphs run in ONNX Runtime CPU")

from rmsnorm_deploy.errors import UserError  # noqa: E402
from rmsnorm_deploy.exporter import gguf as gguf_in  # noqa: E402
from rmsnorm_deploy.exporter.plan import model_name  # noqa: E402
from rmsnorm_deploy.graph.metadata import ModelMetadata  # noqa: E402
from tests.gguf_files import SPECIALS, VOCAB, random_model, write_gguf  # noqa: E402
from tests.real_weights import run_cli  # noqa: E402

PROMPT = [116, 104, 101, 32, 99, 97, 116]  # "the cat", byte tokens
NEW_TOKENS = 8
#: architecture -> how its projections are stored
QUANTIZED = {"llama": "Q8_0", "qwen2": None, "qwen3": "Q4_0", "gemma3_text": "Q8_0"}


@pytest.fixture(autouse=True, scope="module")
def _own_cache(tmp_path_factory):
    """The synthetic files are converted into this run's cache, not the user's (set before the
    module's other fixtures: autouse first); the real weights stay in the user's, converted once
    per machine (their test puts back the cache this replaced, which it yields: None for the default)."""
    users = os.environ.get(gguf_in.CACHE_ENV)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(gguf_in.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "gguf-cache"))
        yield users


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    """One GGUF file per architecture, each in its own folder."""
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for model_type, quantized in QUANTIZED.items():
        folder = root / model_type
        folder.mkdir()
        files[model_type] = write_gguf(random_model(model_type), folder / f"tiny-{model_type}.gguf",
                                       quantized=quantized)
    return files


def transformers_greedy(gguf_file: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens on the model its GGUF loader reads from ``gguf_file``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt):].tolist()


def generated(folder: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """``rmsnorm-deploy generate FOLDER --input-ids ...``: the new tokens."""
    code, output = run_cli(["generate", str(folder), "--input-ids", ",".join(map(str, prompt)),
                            "--max-new-tokens", str(new_tokens), "--json"])
    assert code == 0, output
    return json.loads(output[output.index("{"):])["tokens"][0]


def _until_eos(tokens: list[int]) -> list[int]:
    eos = VOCAB - 1
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def _export(model: Path, out: Path, *args: str) -> str:
    code, output = run_cli(["export", str(model), "-o", str(out / "model.onnx"), *args])
    assert code == 0, output
    return output


def _check_source(out: Path, gguf_file: Path, architecture: str) -> None:
    """The metadata and report.json record the GGUF file: its path, SHA-256 and architecture."""
    expected = {"kind": "gguf", "path": str(gguf_file.resolve()), "sha256": gguf_in.file_sha256(gguf_file),
                "architecture": architecture}
    meta = ModelMetadata.read(onnx.load(str(out / "model.onnx"), load_external_data=False))
    report = json.loads((out / "report.json").read_text())
    for source in (meta.source, report["source"]):
        assert {k: source.get(k) for k in expected} == expected


@pytest.mark.parametrize("model_type, architecture", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_onnxruntime_target_generates_transformers_greedy_tokens(gguf_files, tmp_path, model_type, architecture):
    gguf_file = gguf_files[model_type]
    # qwen2 through the folder that holds its one .gguf; the others through the file
    model = gguf_file.parent if model_type == "qwen2" else gguf_file
    _export(model, tmp_path, "--kv-cache", "--target", "onnxruntime")
    _check_source(tmp_path, gguf_file, architecture)
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json", "genai_config.json"):
        assert (tmp_path / name).is_file(), name
    ours = generated(tmp_path, PROMPT, NEW_TOKENS)
    assert _until_eos(ours) == _until_eos(transformers_greedy(gguf_file, PROMPT, NEW_TOKENS))


def onnx_greedy(model_path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of a plain export (``input_ids -> logits``, no cache): the whole sequence each step."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    ids = list(prompt)
    for _ in range(new_tokens):
        (logits,) = session.run(["logits"], {"input_ids": np.array([ids], dtype=np.int64)})
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def gemma3_plain(gguf_files, tmp_path_factory) -> Path:
    """The plain export of the Gemma 3 GGUF, the file copied into the model's folder first (the one
    traced export of this module: torch.onnx takes ~15 s here)."""
    folder = tmp_path_factory.mktemp("gemma3-plain")
    gguf_file = folder / gguf_files["gemma3_text"].name
    shutil.copy(gguf_files["gemma3_text"], gguf_file)
    _export(gguf_file, folder)
    return folder


def test_gemma3_plain_graph_gives_transformers_greedy_tokens(gemma3_plain):
    """Gemma 3 (offset gains stored as ``1 + w``, q/k norms, sliding window 8 under a longer prompt)
    through the plain graph: the onnxruntime target refuses its sliding window today."""
    gguf_file = gemma3_plain / "tiny-gemma3_text.gguf"
    prompt = PROMPT + PROMPT  # 14 tokens: past the window
    _check_source(gemma3_plain, gguf_file, "gemma3")
    assert onnx_greedy(gemma3_plain / "model.onnx", prompt, NEW_TOKENS) == transformers_greedy(gguf_file, prompt,
                                                                                                 NEW_TOKENS)


def test_quantized_export_of_a_gguf_passes_its_parity(gguf_files, tmp_path):
    output = _export(gguf_files["llama"], tmp_path, "--kv-cache", "--target", "onnxruntime", "--quantize", "int8")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["quantization"].startswith("int8") and report["parity"]["status"] == "pass", output
    assert report["source"]["kind"] == "gguf"


def test_the_chat_template_and_tokenizer_come_along(gguf_files):
    """The converted folder has the GGUF's tokenizer and chat template: what generate --prompt and
    serve --openai-port read from the export's folder (its files are copied there)."""
    from transformers import AutoTokenizer

    from rmsnorm_deploy.serving.openai.text import ChatTemplate

    folder = gguf_in.hf_folder_from_gguf(gguf_files["llama"])
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.encode("the cat", add_special_tokens=False) == [116, 257, 32, 99, 97, 116]  # "he" merged
    template, why = ChatTemplate.load(folder)  # as serve --openai-port reads it
    assert why is None
    assert template.render([{"role": "user", "content": "hi"}]) == (
        f"{SPECIALS[0]}user\nhi{SPECIALS[1]}\n{SPECIALS[0]}assistant\n")


def test_the_default_name_is_the_file_stem_and_several_files_are_refused(gguf_files, tmp_path):
    assert model_name(str(gguf_files["llama"])) == "tiny-llama"
    assert model_name(str(gguf_files["llama"].parent)) == "tiny-llama"
    both = tmp_path / "both"
    both.mkdir()
    for model_type in ("llama", "qwen2"):
        shutil.copy(gguf_files[model_type], both)
    code, output = run_cli(["export", str(both)])
    assert code == 2
    assert f"{both}: holds 2 GGUF files (tiny-llama.gguf, tiny-qwen2.gguf); give the file to export" in output
    assert len(output.strip().splitlines()) == 1


def _validate(model: Path, *args: str) -> tuple[int, str]:
    return run_cli(["validate", str(model), "--reference", "torch", *args])


def test_validate_trusts_a_gguf_path_only_inside_the_models_folder(gemma3_plain, gguf_files, tmp_path):
    gguf_file = gemma3_plain / "tiny-gemma3_text.gguf"
    # inside the model's folder: opened from the metadata alone, converted again and compared
    code, output = _validate(gemma3_plain / "model.onnx")
    assert code == 0, output
    # the same model in another folder: the metadata's path lies outside it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(gemma3_plain / "model.onnx", elsewhere / "model.onnx")
    code, output = _validate(elsewhere / "model.onnx")
    assert code == 2
    assert f"names its source GGUF file {gguf_file.resolve()}, outside the model's folder" in output
    code, output = _validate(elsewhere / "model.onnx", "--source", str(gguf_file))
    assert code == 0, output
    # another file given as the source is refused by its SHA-256, not compared
    code, output = _validate(elsewhere / "model.onnx", "--source", str(gguf_files["llama"]))
    assert code == 2 and "is not that of the GGUF file the model was exported from" in output, output


def _refusal(path: Path) -> str:
    """``export PATH``: exit 2 and one line; the line."""
    code, output = run_cli(["export", str(path), "-o", str(path.parent / "out" / "model.onnx")])
    errors = [line for line in output.splitlines() if line.startswith("rmsnorm-deploy export: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    assert not (path.parent / "out").exists()
    return errors[0]


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip file, not a GGUF")
    assert f"{fake}: not a GGUF file (it does not start with the GGUF magic)" in _refusal(fake)
    missing = tmp_path / "missing.gguf"
    assert f"{missing}: no such file; give a .gguf file or a folder holding one" in _refusal(missing)


def test_a_truncated_gguf_is_refused(gguf_files, tmp_path):
    data = gguf_files["llama"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    assert f"{cut}: damaged or truncated GGUF file" in _refusal(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:40])
    assert f"{header_only}: damaged or truncated GGUF file" in _refusal(header_only)


def test_an_architecture_the_loader_cannot_read_is_refused(tmp_path):
    path = write_gguf(random_model("llama"), tmp_path / "odd.gguf", architecture="grok-9")
    line = _refusal(path)
    assert "GGUF loader cannot read this 'grok-9' file" in line and "not supported" in line


def test_a_tensor_type_the_loader_cannot_dequantize_is_refused(tmp_path):
    import numpy as np

    model = random_model("llama")
    path = write_gguf(model, tmp_path / "f64.gguf", quantized=None,
                      tensor_override={"blk.0.ffn_up.weight": np.zeros((128, 64), dtype=np.float64)})
    line = _refusal(path)
    assert "GGUF loader cannot read this 'llama' file with tensor types F32, F64" in line


@pytest.mark.parametrize("module", ["gguf", "accelerate"])
def test_missing_gguf_or_accelerate_names_the_extra(gguf_files, tmp_path, monkeypatch, module):
    path = tmp_path / "fresh.gguf"
    shutil.copy(gguf_files["qwen2"], path)
    with path.open("ab") as f:
        f.write(b"\0")  # another SHA-256: not in the cache, so it must be converted
    monkeypatch.setitem(sys.modules, module, None)
    line = _refusal(path)
    assert f"needs {module}, which is not installed" in line and "pip install 'rmsnorm-deploy[gguf]'" in line


def test_named_gguf_reads_names_only(tmp_path):
    assert gguf_in.named_gguf(tmp_path) is None  # an empty folder is no GGUF (the folder errors say why)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    assert gguf_in.named_gguf(tmp_path) is None  # config.json: a Hugging Face folder, whatever else it holds
    (tmp_path / "config.json").unlink()
    assert gguf_in.named_gguf(tmp_path) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match="holds 2 GGUF files"):
        gguf_in.named_gguf(tmp_path)


def test_real_smollm2_gguf_generates_transformers_greedy_text(real_weights, monkeypatch, _own_cache):
    """The real SmolLM2-135M-Instruct GGUF (Q4_1) exported from the file itself: generate's text
    tokens equal transformers' greedy tokens on the weights its loader dequantizes."""
    import transformers

    if _own_cache is None:  # the user's cache, where real_weights converts the file once per machine
        monkeypatch.delenv(gguf_in.CACHE_ENV)
    else:
        monkeypatch.setenv(gguf_in.CACHE_ENV, _own_cache)
    result = real_weights.export("kv-ort")  # exported from the GGUF file (real_weights.FROM_GGUF)
    assert result.exit_code == 0, result.output
    assert result.report["source"]["kind"] == "gguf" and result.report["source"]["architecture"] == "llama"
    folder = real_weights.hf_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    prompt = tokenizer.encode("The capital of France is")
    code, output = run_cli(["generate", str(result.folder), "--prompt", "The capital of France is",
                            "--max-new-tokens", "12", "--json"])
    assert code == 0, output
    ours = json.loads(output[output.index("{"):])
    assert ours["prompts"][0] == prompt
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    cut = next((i + 1 for i, t in enumerate(ours["tokens"][0]) if t in eos), len(ours["tokens"][0]))
    assert ours["tokens"][0][:cut] == expected[:cut]
    assert "Paris" in ours["text"][0]
    from rmsnorm_deploy.serving.openai.text import ChatTemplate

    template, why = ChatTemplate.load(result.folder)  # serve --openai-port's chat, from the export's folder
    assert why is None and template.render([{"role": "user", "content": "hi"}]).endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
