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
import importlib.util
import json
import math
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
from rmsnorm_deploy.decoder.divergence import divergence  # noqa: E402
from rmsnorm_deploy.decoder.perplexity import SHIPPED_TEXT, log_softmax64, perplexity, scored_positions  # noqa: E402

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
    assert got["log_ratio"] == got["log_ratio_stderr"] == got["kl_stderr"] == 0.0


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
    assert got["log_ratio"] == pytest.approx(math.log(got["perplexity"] / got["reference_perplexity"]), abs=1e-12)
    assert got["log_ratio_stderr"] > 0.0


def test_the_log_ratio_uncertainty_is_llama_perplexity_s():
    """The paired standard error equals llama-perplexity's covariance form of it (perplexity.cpp,
    ``log_ppl_ratio_unc``), computed here from its running sums."""
    rng = np.random.default_rng(3)
    vocab, window = 11, np.asarray(rng.integers(0, 11, 40), np.int64)
    model, reference = rng.normal(size=(40, vocab)), rng.normal(size=(40, vocab))
    got = divergence(lambda _w: model, lambda _w: reference, [window], text_tokens=40)
    rows = scored_positions(len(window), None)
    targets = window[rows.start + 1:]
    nll = -log_softmax64(model[rows])[np.arange(len(targets)), targets]
    nll_base = -log_softmax64(reference[rows])[np.arange(len(targets)), targets]
    n = len(nll)

    def spread(a, b):
        return ((a * b).sum() / n - a.sum() / n * (b.sum() / n)) / (n - 1)

    unc = math.sqrt(spread(nll, nll) + spread(nll_base, nll_base) - 2 * spread(nll, nll_base))
    assert got.scored_tokens == n and got.log_ratio == pytest.approx(nll.mean() - nll_base.mean(), abs=1e-12)
    assert got.log_ratio_stderr == pytest.approx(unc, rel=1e-9)
    kl = [(np.exp(p) * (p - q)).sum() for p, q in zip(log_softmax64(reference[rows]), log_softmax64(model[rows]))]
    assert got.kl_stderr == pytest.approx(math.sqrt(spread(np.array(kl), np.array(kl))), rel=1e-9)


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
     ["not a KV-cache model folder perplexity reads (it holds model.onnx)", "genai_config.json beside",
      "optimum's ORTModelForCausalLM"]),
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


# -- folders of optimum and onnxruntime-genai ---------------------------------------------------------
def _foreign_copy(source: Path, target: Path, *, kind: str) -> Path:
    """``source`` (our float32 folder) as the other writers lay it out: our metadata gone; optimum's
    without genai_config.json; genai's without config.json, its graph in ``decoder.onnx`` with the
    token input named ``tokens`` and genai_config.json naming both."""
    import onnx

    from rmsnorm_deploy.graph.metadata import PREFIX

    shutil.copytree(source, target)
    model = onnx.load(str(target / "model.onnx"))
    kept = [p for p in model.metadata_props if not p.key.startswith(PREFIX)]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    (target / "model.onnx").unlink()
    if kind == "optimum":
        (target / "genai_config.json").unlink()
        onnx.save(model, str(target / "model.onnx"))
        return target
    (target / "config.json").unlink()
    for value in model.graph.input:
        if value.name == "input_ids":
            value.name = "tokens"
    for node in model.graph.node:
        node.input[:] = ["tokens" if name == "input_ids" else name for name in node.input]
    onnx.save(model, str(target / "decoder.onnx"))
    config = json.loads((target / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "decoder.onnx"
    config["model"]["decoder"]["inputs"]["input_ids"] = "tokens"
    (target / "genai_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def foreign(folders, tmp_path_factory):
    """``{"optimum" | "genai": folder}``: our float32 folder as optimum and onnxruntime-genai lay it out."""
    _, folder = folders
    root = tmp_path_factory.mktemp("foreign")
    return {kind: _foreign_copy(folder["float32"], root / kind, kind=kind) for kind in ("optimum", "genai")}


def test_folders_of_optimum_and_genai_give_our_numbers(capsys, folders, foreign, token_file, tmp_path):
    """The same graph in the three layouts: the same perplexity, KL 0 on either side, chunks or strides."""
    _, folder = folders
    path, _ = token_file
    base = ["--tokens", str(path), "--context", str(CONTEXT)]
    ours = _json(capsys, [str(folder["float32"]), *base])
    got = _json(capsys, [str(foreign["optimum"]), *base, "--kl-divergence", str(foreign["genai"])])
    assert (got["model_kind"], got["reference_kind"]) == ("optimum", "onnxruntime-genai")
    assert got["perplexity"] == got["reference_perplexity"] == ours["perplexity"]
    assert got["kl_max"] == 0.0 and got["same_top"] == 1.0 and got["scored_tokens"] == ours["scored_tokens"]
    strided = _json(capsys, [str(foreign["genai"]), *base, "--stride", "5", "--kl-divergence", str(folder["int4"])])
    alone = _json(capsys, [str(folder["float32"]), *base, "--stride", "5"])
    assert strided["reference_perplexity"] != strided["perplexity"] == alone["perplexity"]
    assert (strided["stride"], strided["scored_tokens"]) == (5, alone["scored_tokens"])
    text = tmp_path / "text.txt"  # read with the genai folder's own tokenizer and BOS
    text.write_text("the program is free software " * 8, encoding="utf-8")
    on_text = [_json(capsys, [str(f), "--text", str(text), "--context", str(CONTEXT)])
               for f in (foreign["genai"], folder["float32"])]
    assert on_text[0]["bos_token_id"] == BOS and on_text[0]["perplexity"] == on_text[1]["perplexity"]


def test_threads_are_the_sessions(folders, foreign):
    from rmsnorm_deploy.decoder.kv_folders import open_kv_folder

    _, folder = folders
    for path in (folder["float32"], foreign["optimum"], foreign["genai"]):
        with open_kv_folder(path, intra_op_threads=1) as model:
            assert model.session.get_session_options().intra_op_num_threads == 1


def test_the_progress_bar_is_on_stderr_only_when_asked(capsys, folders, token_file):
    _, folder = folders
    path, _ = token_file
    argv = ["perplexity", str(folder["float32"]), "--tokens", str(path), "--context", str(CONTEXT), "--json"]
    assert main(argv) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and json.loads(quiet.out)["chunks"] == 3  # stderr is not a terminal here
    assert main([*argv, "--progress"]) == 0
    shown = capsys.readouterr()
    assert json.loads(shown.out) == {**json.loads(quiet.out), "seconds": json.loads(shown.out)["seconds"]}
    lines = shown.err.splitlines()
    assert lines[0].startswith("perplexity [....") and " 0/3 (0%)" in lines[0]
    assert lines[-1].startswith("perplexity [####") and " 3/3 (100%)" in lines[-1] and len(lines) == 4


def test_on_a_terminal_the_bar_is_redrawn_in_place():
    import io

    from rmsnorm_deploy.progress import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    bar = ProgressBar("perplexity", stream=stream, redraw_seconds=3600.0)
    for done in range(5):
        bar.update(done, 4)  # the first drawn, the next ones within the redraw time skipped, the last drawn
    assert stream.getvalue().count("\r") == 2 and stream.getvalue().endswith("4/4 (100%), 0s\x1b[K\n")


@pytest.mark.parametrize("damage, fragments", [
    ("no_model", ["not a KV-cache model folder perplexity reads (it holds config.json, model.onnx.data, tokenizer.json)",
                  "expected model.onnx with rmsnorm-deploy's KV-cache metadata"]),
    ("filename_out", ["model.decoder.filename is '../decoder.onnx'", "a plain file name"]),
    ("filename_missing", ["model.decoder.filename names gone.onnx, which is not in"]),
    ("extra_input", ["the graph takes inputs perplexity cannot feed: ['use_cache_branch']"]),
    ("data_out", ["external data '../outside.data' points outside the model's folder", "refusing to read it"]),
    ("layers", ["num_hidden_layers is 3, the graph has 2 layers of past"]),
    ("stride", ["stride must be an integer from 1 to the context minus 1 (15), got 16"]),
])
def test_foreign_folders_are_refused_in_one_line(capsys, foreign, token_file, tmp_path, damage, fragments):
    import onnx

    path, _ = token_file
    bad = tmp_path / "bad"
    kind = "optimum" if damage in ("no_model", "extra_input", "data_out") else "genai"
    shutil.copytree(foreign[kind], bad)
    extra: list[str] = []
    config = json.loads((bad / "genai_config.json").read_text()) if kind == "genai" else None
    if damage == "no_model":
        (bad / "model.onnx").unlink()
    elif damage == "extra_input":
        model = onnx.load(str(bad / "model.onnx"))
        model.graph.input.append(onnx.helper.make_tensor_value_info("use_cache_branch", onnx.TensorProto.BOOL, [1]))
        onnx.save(model, str(bad / "model.onnx"))
    elif damage == "data_out":
        from onnx import external_data_helper

        (tmp_path / "outside.data").write_bytes(b"\0" * 4096)
        model = onnx.load(str(bad / "model.onnx"))
        tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
        external_data_helper.set_external_data(tensor, location="../outside.data", offset=0,
                                               length=len(tensor.raw_data))
        tensor.data_location = onnx.TensorProto.EXTERNAL
        tensor.ClearField("raw_data")
        onnx.save(model, str(bad / "model.onnx"))
    elif damage == "filename_out":
        config["model"]["decoder"]["filename"] = "../decoder.onnx"
    elif damage == "filename_missing":
        config["model"]["decoder"]["filename"] = "gone.onnx"
    elif damage == "layers":
        config["model"]["decoder"]["num_hidden_layers"] = 3
    elif damage == "stride":
        extra = ["--stride", "16"]
    if config is not None:
        (bad / "genai_config.json").write_text(json.dumps(config))
    code = main(["perplexity", str(bad), "--tokens", str(path), "--context", str(CONTEXT), *extra])
    _one_line_error(capsys, code, *fragments)


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None,
                    reason="needs onnxruntime-genai (pip install onnxruntime-genai) for its model builder")
def test_a_folder_of_genai_builder_gives_transformers_perplexity(capsys, monkeypatch, tmp_path, token_file):
    """onnxruntime-genai's own builder (in this process, float32 for CPU) on a tiny random Llama: the
    command reads its folder and gives transformers' loss on the same chunks. The intermediate size
    differs from the vocabulary: the builder takes any Linear as wide as the vocabulary for the LM head;
    GroupQueryAttention on CPU wants a head size that is a multiple of 16."""
    import contextlib
    import io

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    source, out = tmp_path / "hf", tmp_path / "genai"
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=BOS,
                         eos_token_id=2)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(config).eval()
    lm.save_pretrained(source)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(source)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from onnxruntime_genai.models import builder

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        extra = builder.parse_extra_options(None, str(source), str(out), "fp32", "cpu", str(tmp_path / "cache"), {})
        builder.create_model(None, str(source), str(out), "fp32", "cpu", str(tmp_path / "cache"), **extra)
    path, ids = token_file
    got = _json(capsys, [str(out), "--tokens", str(path), "--context", str(CONTEXT)])
    assert got["model_kind"] == "onnxruntime-genai" and got["chunks"] == 3
    windows = torch.from_numpy(np.asarray(ids[: 3 * CONTEXT]).reshape(3, CONTEXT))
    labels = windows.clone()
    labels[:, : CONTEXT // 2 + 1] = -100
    with torch.no_grad():
        loss = lm(input_ids=windows, labels=labels).loss.item()
    assert got["mean_nll"] == pytest.approx(loss, rel=1e-5)
