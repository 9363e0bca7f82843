"""Speculative decoding on written tiny folders (``--target onnxruntime``, both cache layouts):
greedy tokens equal to ``generate`` without speculation for prompt lookup and a draft model, the
shared buffer forgetting rejected slots through the mask alone, one-line refusals (a batch on a
GroupQueryAttention graph, a draft of another vocabulary), and ``generate --speculative --json``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="transformers builds the tiny models")
pytest.importorskip("onnxruntime", reason="the graphs run in ONNX Runtime")

from rmsnorm_deploy.cli import main  # noqa: E402
from rmsnorm_deploy.decoder.convention import KVCacheLayout  # noqa: E402
from rmsnorm_deploy.decoder.generate import KVCacheModel, Sampling, SpeculationOptions, generate  # noqa: E402
from rmsnorm_deploy.decoder.genai_config import write_serving_files  # noqa: E402
from rmsnorm_deploy.decoder.ort_export import write_ort_decoder  # noqa: E402
from rmsnorm_deploy.errors import InputError  # noqa: E402
from rmsnorm_deploy.exporter import hf  # noqa: E402
from rmsnorm_deploy.graph.metadata import ModelMetadata  # noqa: E402
from tests.decoder.families import tiny_config  # noqa: E402

#: A prompt that repeats itself: the tiny random model's greedy text then loops, so lookup guesses
#: some tokens right and some wrong (both paths of the rollback run).
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
NEW_TOKENS = 40


def _write(root, name: str, seed: int = 0, vocab: int | None = None, **build):
    config = tiny_config("llama", **({"vocab_size": vocab} if vocab else {}))
    loaded = hf.from_config(config, "float32", seed=seed)
    path = root / name / "model.onnx"
    decoder = write_ort_decoder(loaded, path, force=False, max_length=64, **build)
    write_serving_files(path, KVCacheLayout.from_dict(ModelMetadata.read(decoder.model).kv_cache), loaded.source,
                        force=False)
    return path.parent


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    return {"plain": _write(root, "plain"), "shared": _write(root, "shared", share_buffer=True),
            "draft": _write(root, "draft", seed=1), "same": _write(root, "same", share_buffer=True)}


@pytest.mark.parametrize("layout", ["plain", "shared"])
@pytest.mark.parametrize("proposer", ["ngram", "draft", "same"])
def test_greedy_tokens_equal_generate_without_speculation(folders, layout, proposer):
    """``same``: a draft with the model's own weights (every proposal kept); ``draft``: other
    random weights (most rejected); ``ngram``: prompt lookup (some of each)."""
    with KVCacheModel(folders[layout]) as model:
        want = generate(model, [PROMPT], max_new_tokens=NEW_TOKENS, eos_token_id=None)
        if proposer == "ngram":
            got = generate(model, [PROMPT], max_new_tokens=NEW_TOKENS, eos_token_id=None,
                           speculation=SpeculationOptions("ngram", 4))
        else:
            with KVCacheModel(folders[proposer]) as draft:
                got = generate(model, [PROMPT], max_new_tokens=NEW_TOKENS, eos_token_id=None,
                               speculation=SpeculationOptions(draft, 3))
    assert got.tokens == want.tokens
    spec = got.speculation
    assert spec["verifications"] > 0 and spec["target_passes"] < NEW_TOKENS - 1 or proposer == "draft", spec
    if proposer == "ngram":
        assert 0 < spec["accepted"] < spec["proposed"], spec
    if proposer == "same":
        assert spec["accepted"] == spec["proposed"] and spec["tokens_per_pass"] > 2, spec


def test_sampling_with_speculation_is_seeded_and_in_the_vocabulary(folders):
    sampling = Sampling(do_sample=True, seed=7, temperature=0.7)
    with KVCacheModel(folders["shared"]) as model:
        runs = [generate(model, [PROMPT], max_new_tokens=20, sampling=sampling, eos_token_id=None,
                         speculation=SpeculationOptions("ngram", 4)).tokens for _ in range(2)]
    assert runs[0] == runs[1] and all(0 <= t < 256 for t in runs[0][0])


def test_a_batch_on_a_grouped_query_attention_graph_is_refused_in_one_line(folders):
    with KVCacheModel(folders["shared"]) as model, pytest.raises(InputError, match="one prompt at a time"):
        generate(model, [PROMPT, PROMPT[:3]], max_new_tokens=4, speculation=SpeculationOptions("ngram", 4))


def test_a_graph_computing_in_int8_is_refused_speculation(tmp_path):
    """int8 compute rounds a run of several tokens differently from one: its greedy tokens would change."""
    from rmsnorm_deploy.decoder.quantize import Quantization

    folder = _write(tmp_path, "int4", quantization=Quantization("int4", 32, 4, False))
    with KVCacheModel(folder) as model, pytest.raises(InputError, match="computes in int8 .*--accuracy-level 1"):
        generate(model, [PROMPT], max_new_tokens=4, speculation=SpeculationOptions("ngram", 4))


def test_generate_cli_reports_speculation_and_refuses_another_vocabulary(folders, capsys, tmp_path):
    ids = ",".join(str(t) for t in PROMPT)
    base = ["generate", str(folders["shared"]), "--input-ids", ids, "--max-new-tokens", "12", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--speculative", "ngram", "--speculative-k", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain["tokens"] and "speculation" not in plain
    assert out["speculation"]["proposer"] == "ngram" and out["speculation"]["max_k"] == 3
    assert {"acceptance_rate", "tokens_per_pass", "target_passes"} <= set(out["speculation"])
    other = _write(tmp_path, "other", vocab=128)
    code = main(["generate", str(folders["shared"]), "--input-ids", ids, "--speculative", str(other)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "vocabulary of 128 tokens" in err, err
    code = main(["generate", str(folders["shared"]), "--input-ids", ids, "--speculative", "ngram",
                 "--speculative-k", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--speculative-k must be an integer >= 1" in err, err


@pytest.mark.slow  # shares the exported tiny Llama (tests/kv_models.py: one torch.onnx export per process)
def test_portable_graph_speculates_on_a_left_padded_batch():
    """The portable graph (concatenated caches, one slot per mask column) takes a batch: each row's
    tokens equal ``generate`` without speculation while the rows advance together."""
    from tests.kv_models import exported_kv

    folder, _ = exported_kv("llama")
    rows = [PROMPT, [3, 4, 3, 4, 3, 4, 3], [9, 8, 9, 8, 9, 8]]
    with KVCacheModel(folder) as model:
        want = generate(model, rows, max_new_tokens=24, eos_token_id=None)
        got = generate(model, rows, max_new_tokens=24, eos_token_id=None, speculation=SpeculationOptions("ngram", 4))
    assert got.tokens == want.tokens and got.speculation["verifications"] > 0, got.speculation
