"""`rmsnorm-deploy perplexity`: the library's perplexity over a folder, its KL divergence from a
reference export (0 against itself, more than 0 for int4 against float32), the shipped text read
with the folder's tokenizer, what `export --quantize` reports quantization cost on that text, and
one-line errors with exit code 2.

One tiny random Llama (transformers, seed 0) is written twice by the graph writer, float32 and int4,
with a word-level tokenizer.json over the shipped text (its BOS in front) beside them; a copy without
the tokenizer stands for the tiny models that have none (token ids through --tokens)."""

from __future__ import annotations

import collections
import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="perplexity runs ONNX Runtime")
pytest.importorskip("transformers", reason="transformers builds the tiny model")
tokenizers = pytest.importorskip("tokenizers", reason="the folders' tokenizer.json is read with tokenizers")

from rmsnorm_deploy.cli import main  # noqa: E402
from rmsnorm_deploy.decoder.generate import KVCacheModel  # noqa: E402
from rmsnorm_deploy.decoder.perplexity import SHIPPED_TEXT, perplexity  # noqa: E402

CONTEXT = 16
BOS = 1  # the tiny Llama config's bos_token_id


def _word_tokenizer(text: str, vocab: int) -> object:
    """A word-level tokenizer over ``text``'s most frequent words that puts ``<s>`` (id 1) in front."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = collections.Counter(re.findall(r"\w+|[^\w\s]", text)).most_common(vocab - 4)
    ids = {"<pad>": 0, "<s>": BOS, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, (w, _) in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return tok


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``(loaded model, {"float32" | "int4" | "bare": folder})``: "bare" is float32 without a tokenizer."""
    from rmsnorm_deploy.decoder.convention import KVCacheLayout
    from rmsnorm_deploy.decoder.genai_config import write_serving_files
    from rmsnorm_deploy.decoder.ort_export import write_ort_decoder
    from rmsnorm_deploy.decoder.quantize import Quantization
    from rmsnorm_deploy.exporter import hf
    from rmsnorm_deploy.graph.metadata import ModelMetadata

    root = tmp_path_factory.mktemp("perplexity-cli")
    loaded = hf.from_config(hf.TINY_CONFIGS["llama"], "float32", seed=0)
    tokenizer = _word_tokenizer(SHIPPED_TEXT.read_text(encoding="utf-8"), loaded.vocab_size)
    out = {}
    for name, quantization in (("float32", None), ("int4", Quantization("int4", 32, 0, False))):
        path = root / name / "model.onnx"
        dec = write_ort_decoder(loaded, path, force=False, quantization=quantization)
        write_serving_files(path, KVCacheLayout.from_dict(ModelMetadata.read(dec.model).kv_cache), loaded.source,
                            force=False)
        tokenizer.save(str(path.parent / "tokenizer.json"))
        out[name] = path.parent
    out["bare"] = root / "bare"
    shutil.copytree(out["float32"], out["bare"])
    (out["bare"] / "tokenizer.json").unlink()
    return loaded, out


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    """3 chunks of random ids (and a tail that is dropped), none of them BOS."""
    ids = np.random.default_rng(5).integers(3, 256, size=3 * CONTEXT + 5)
    path = tmp_path_factory.mktemp("tokens") / "ids.txt"
    path.write_text(" ".join(map(str, ids[:10])) + "\n" + ",".join(map(str, ids[10:])) + "\n")
    return path, [int(t) for t in ids]


def _json(capsys, argv: list[str]) -> dict:
    code = main(["perplexity", *argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_the_command_gives_the_library_perplexity(capsys, folders, token_file):
    _, folder = folders
    path, ids = token_file
    got = _json(capsys, [str(folder["float32"]), "--tokens", str(path), "--context", str(CONTEXT)])
    with KVCacheModel(folder["float32"]) as model:
        want = perplexity(model, ids, context=CONTEXT)
    assert got["perplexity"] == want.perplexity and got["bos_token_id"] is None
    assert (got["chunks"], got["scored_tokens"], got["text_tokens"]) == (3, 3 * (CONTEXT // 2 - 1), len(ids))
    assert main(["perplexity", str(folder["bare"]), "--tokens", str(path), "--context", str(CONTEXT)]) == 0
    assert f"perplexity {want.perplexity:.4f} over 21 tokens (3 chunks of 16" in capsys.readouterr().out


def test_a_model_against_itself_diverges_by_nothing(capsys, folders, token_file):
    _, folder = folders
    path, _ = token_file
    got = _json(capsys, [str(folder["float32"]), "--tokens", str(path), "--context", str(CONTEXT),
                         "--kl-divergence", str(folder["bare"])])
    plain = _json(capsys, [str(folder["float32"]), "--tokens", str(path), "--context", str(CONTEXT)])
    assert got["kl_mean"] == got["kl_max"] == 0.0 and got["same_top"] == 1.0
    assert got["perplexity"] == got["reference_perplexity"] == plain["perplexity"]


def test_int4_against_float32_diverges(capsys, folders, token_file):
    _, folder = folders
    path, _ = token_file
    got = _json(capsys, [str(folder["int4"]), "--tokens", str(path), "--context", str(CONTEXT),
                         "--kl-divergence", str(folder["float32"])])
    alone = {name: _json(capsys, [str(folder[name]), "--tokens", str(path), "--context", str(CONTEXT)])
             for name in ("int4", "float32")}
    assert 0.0 < got["kl_median"] <= got["kl_p99"] <= got["kl_max"] and got["kl_mean"] > 0.0
    assert 0.0 < got["same_top"] <= 1.0 and got["scored_tokens"] == 21
    assert got["perplexity"] == alone["int4"]["perplexity"]
    assert got["reference_perplexity"] == alone["float32"]["perplexity"]


def test_the_shipped_text_is_read_with_the_folder_tokenizer(capsys, folders, tmp_path):
    _, folder = folders
    got = _json(capsys, [str(folder["float32"]), "--context", "64"])
    ids = tokenizers.Tokenizer.from_file(str(folder["float32"] / "tokenizer.json")).encode(
        SHIPPED_TEXT.read_text(encoding="utf-8")).ids
    assert got["text"].startswith("the GNU GPL v3 shipped with rmsnorm-deploy")
    assert got["text_tokens"] == len(ids) and got["chunks"] == len(ids) // 64 and got["bos_token_id"] == BOS
    text = tmp_path / "short.txt"
    text.write_text("the program is free software " * 40, encoding="utf-8")
    got = _json(capsys, [str(folder["float32"]), "--text", str(text), "--context", str(CONTEXT)])
    assert got["text"] == str(text) and got["text_tokens"] == 1 + 5 * 40


def test_the_shipped_text_is_the_gpl_and_package_data():
    """The text is byte for byte Debian's GPL-3 (what benchmarks/results/real_checkpoints.md measured)
    and pyproject.toml ships it with its README."""
    import tomllib

    assert hashlib.sha256(SHIPPED_TEXT.read_bytes()).hexdigest() == \
        "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986"
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["rmsnorm_deploy.decoder"]
    assert {"texts/GPL-3", "texts/README.md"} <= set(shipped)
    assert (SHIPPED_TEXT.parent / "README.md").is_file()


def test_the_quantization_cost_on_text_or_why_not(folders):
    """What `export --quantize` reports beside its parity: the int4 graph against the unquantized
    transformers model on the shipped text; a folder without a tokenizer says it could not measure."""
    from rmsnorm_deploy.decoder.divergence import quantization_text_cost, text_cost_line

    loaded, folder = folders
    lm = loaded.module.model
    cost = quantization_text_cost(lm, folder["int4"], chunks=2, context=64)
    assert cost["measured"] and cost["chunks"] == 2 and cost["scored_tokens"] == 2 * 31
    assert cost["kl_mean"] > 0.0 and cost["bos_token_id"] == BOS and "float32" in cost["reference"]
    assert "same top token" in text_cost_line(cost)
    plain = quantization_text_cost(lm, folder["float32"], chunks=2, context=64)
    assert plain["kl_max"] < 1e-6 and plain["same_top"] == 1.0  # the float32 graph is transformers
    bare = quantization_text_cost(lm, folder["bare"], chunks=2, context=64)
    assert not bare["measured"] and "has no tokenizer.json" in bare["why"]


def _one_line_error(capsys, code: int, *fragments: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("argv, fragments", [
    (["--tokens", "{bad}"], ["'x7' is not a token id"]),
    (["--tokens", "{short}", "--context", "16"], ["the text has 20 tokens", "needs at least 32"]),
    (["--tokens", "{outside}", "--context", "16"], ["token id 256 is outside the model's vocabulary [0, 256)"]),
    (["--tokens", "{ids}", "--context", "2"], ["context must be an integer >= 4"]),
    (["--tokens", "{ids}", "--context", "129"], ["a context of 129 tokens exceeds the model's maximum of 128"]),
    (["--text", "{latin1}"], ["not UTF-8 text (byte 0xe9 at offset 3)"]),
    (["--text", "{missing}"], ["--text", "no such file"]),
    ([], ["has no tokenizer.json to read the text with; give token ids with --tokens FILE"]),
    (["--tokens", "{ids}", "--kl-divergence", "{missing}"], ["no such file or folder"]),
    (["--tokens", "{ids}", "--kl-divergence", "{plain_onnx}"],
     ["not a KV-cache model", "optimum or onnxruntime-genai"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys, folders, tmp_path, argv, fragments):
    from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
    from rmsnorm_deploy.graph.onnx_file import save_onnx

    _, folder = folders
    files = {"bad": "1 2 x7 4", "short": " ".join(["5"] * 20), "outside": " ".join(["5"] * 31 + ["256"]),
             "ids": " ".join(["5"] * 40)}
    paths = {name: tmp_path / f"{name}.txt" for name in files}
    for name, body in files.items():
        paths[name].write_text(body)
    paths["latin1"] = tmp_path / "latin1.txt"
    paths["latin1"].write_bytes("caf\u00e9".encode("latin-1"))
    paths["missing"] = tmp_path / "missing"
    if "{plain_onnx}" in argv:
        paths["plain_onnx"] = tmp_path / "plain" / "model.onnx"
        save_onnx(rmsnorm_model(RMSNormSpec.llama(), dtype="float32", shape=(2, 8)), paths["plain_onnx"])
    argv = [a.format(**{k: str(v) for k, v in paths.items()}) if "{" in a else a for a in argv]
    _one_line_error(capsys, main(["perplexity", str(folder["bare"]), *argv]), *fragments)
