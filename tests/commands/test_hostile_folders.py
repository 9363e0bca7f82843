"""Hugging Face folders as they really are, and as a hostile user makes them, through the CLI.

A hub-cache snapshot (every file a link into ``../../blobs/``) exports with its side files and
generates from a prompt; links, shard indexes and side files that lead out of the folder (or
its cache repository), hold ids that are no token ids, nest without end or give the config
fields wrong types are one line with exit 2 when the folder is opened, by ``export``,
``generate`` and the loader ``serve`` opens a KV-cache folder with, before anything is built.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.commands.test_hostile import _error_after_progress

from rmsnorm_deploy.cli import main

pytest.importorskip("onnxruntime", reason="export and generate run ONNX Runtime")
pytest.importorskip("transformers", reason="a Hugging Face folder needs transformers")
pytest.importorskip("tokenizers", reason="the folder's tokenizer needs tokenizers")

#: the tiny model's special tokens: config.json says eos 2; generation_config.json, what
#: transformers' generate uses, says [2, 3]
EOS = [2, 3]




def _save_plain(folder: Path) -> None:
    """A tiny random Llama (one layer) with a word-level tokenizer, as ``save_pretrained`` writes it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rmsnorm_deploy.exporter.hf import TINY_CONFIGS, from_config

    config = dict(TINY_CONFIGS["llama"], num_hidden_layers=1, bos_token_id=1, eos_token_id=2)
    from_config(config, "float32").module.model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": EOS}))
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(256)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))


def _hub_snapshot(plain: Path, cache: Path, rev: str = "0123abcd") -> Path:
    """``cache/models--org--tiny/snapshots/<rev>/``: every file of ``plain`` a relative link to its blob."""
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    for file in sorted(plain.iterdir()):
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The plain folder, its hub-cache snapshot, and the snapshot exported with ``--kv-cache``
    (one torch.onnx export for the whole module)."""
    root = tmp_path_factory.mktemp("hf")
    plain = root / "plain"
    _save_plain(plain)
    snapshot = _hub_snapshot(plain, root / "hub")
    exported = root / "exported"
    code = main(["export", str(snapshot), "--kv-cache", "-o", str(exported)])
    return {"plain": plain, "snapshot": snapshot, "exported": exported, "export_code": code}


# -- 3. a hub-cache snapshot ------------------------------------------------------------------------
@pytest.mark.slow  # shares the module's one KV-cache export
def test_a_hub_cache_snapshot_exports_with_its_side_files_and_generates(folders, capsys):
    assert folders["export_code"] == 0
    out, plain = folders["exported"], folders["plain"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file() and not (out / name).is_symlink(), name
        assert (out / name).read_bytes() == (plain / name).read_bytes(), name
    assert json.loads((out / "genai_config.json").read_text())["model"]["eos_token_id"] == EOS
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "t5 t6 t7", "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == [[5, 6, 7]] and len(result["text"][0].split()) == len(result["tokens"][0])


@pytest.mark.slow  # shares the module's one KV-cache export
def test_generate_with_hostile_options(folders, capsys):
    """An invalid UTF-8 prompt, a vanishing temperature (NaN probabilities before), a closed pipe."""
    folder = folders["exported"]
    capsys.readouterr()
    line = _error_after_progress(capsys, main(["generate", str(folder), "--prompt", "t5 \udcff\udcfe"]))
    assert "the prompt is not UTF-8 text (bytes ff fe at character 3); give UTF-8 text" in line
    assert main(["generate", str(folder), "--prompt", "t5 t6", "--sample", "--temperature", "1e-310",
                 "--max-new-tokens", "3"]) == 0
    sampled = capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", "t5 t6", "--max-new-tokens", "3"]) == 0
    assert sampled.out.splitlines()[0] == capsys.readouterr().out.splitlines()[0] and sampled.err == ""
    proc = subprocess.Popen([sys.executable, "-m", "rmsnorm_deploy", "generate", str(folder), "--prompt", "t5 t6"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `generate ... | head -c 1`: the reader is gone before the text is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err


def _snapshot_copy(folders, tmp_path, name: str, target: str | Path) -> Path:
    """A second snapshot of the same cache repository in which ``name`` links to ``target``."""
    snapshot = folders["snapshot"]
    copy = snapshot.parent / f"{tmp_path.name[-20:]}-{name}"
    shutil.copytree(snapshot, copy, symlinks=True)
    (copy / name).unlink()
    (copy / name).symlink_to(target)
    return copy


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model.safetensors"])
def test_a_link_out_of_the_cache_repository_is_refused(folders, tmp_path, capsys, name):
    outside = tmp_path / "outside" / name
    outside.parent.mkdir()
    shutil.copyfile(folders["plain"] / name, outside)  # a file that would load: the link alone is wrong
    copy = _snapshot_copy(folders, tmp_path, name, outside)
    line = _error_after_progress(capsys, main(["export", str(copy), "--kv-cache", "-o", str(tmp_path / "out")]))
    assert f"{copy / name} leads to {outside}, outside the model's folder and its hub-cache repository" in line
    assert not (tmp_path / "out").exists()


def test_a_link_to_etc_passwd_is_refused(folders, tmp_path, capsys):
    copy = _snapshot_copy(folders, tmp_path, "tokenizer.json", "/etc/passwd")
    line = _error_after_progress(capsys, main(["export", str(copy), "--kv-cache", "-o", str(tmp_path / "out")]))
    assert "tokenizer.json leads to /etc/passwd, outside the model's folder" in line


# -- 4. a shard index names where the weights are --------------------------------------------------
def _indexed(folders, tmp_path, shard_name) -> Path:
    """The plain folder with its weights under another name and an index naming ``shard_name``
    for every tensor; ``../../outside/model.safetensors`` exists and would load."""
    from safetensors import safe_open

    folder = tmp_path / "a" / "b" / "model"
    shutil.copytree(folders["plain"], folder)
    (folder / "model.safetensors").rename(folder / "decoy.safetensors")
    (tmp_path / "a" / "outside").mkdir()
    shutil.copyfile(folder / "decoy.safetensors", tmp_path / "a" / "outside" / "model.safetensors")
    with safe_open(str(folder / "decoy.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    shard = str(tmp_path / "a" / "outside" / "model.safetensors") if shard_name == "ABSOLUTE" else shard_name
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, shard)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("shard, message", [
    ("../../outside/model.safetensors",
     "its weight_map names '../../outside/model.safetensors', not a file name inside"),
    ("ABSOLUTE", "outside/model.safetensors', not a file name inside the folder; refusing to read it"),
    ("gone.safetensors", "names the shard 'gone.safetensors', which is missing from"),
])
def test_a_shard_index_cannot_steer_reads_outside(folders, tmp_path, capsys, shard, message):
    folder = _indexed(folders, tmp_path, shard)
    line = _error_after_progress(capsys, main(["export", str(folder), "-o", str(tmp_path / "out")]))
    assert message in line and "model.safetensors.index.json" in line
    assert not (tmp_path / "out").exists()


def test_shards_resolve_inside_the_folder_or_its_cache_repository(folders, tmp_path):
    from rmsnorm_deploy.exporter.hf import weight_files

    snapshot = folders["snapshot"]
    blob = (snapshot / "model.safetensors").resolve()
    assert weight_files(snapshot) == [blob] and blob.parent.name == "blobs"
    copy = shutil.copytree(snapshot, snapshot.parent / f"indexed-{tmp_path.name[-20:]}", symlinks=True)
    (copy / "model.safetensors").rename(copy / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_files(copy) == [blob]


# -- 6. a config.json of the wrong types -------------------------------------------------------------
CONFIGS = {
    "rms_norm_eps a string": ({"rms_norm_eps": "1e-6"}, 'rms_norm_eps is "1e-6"; it must be a finite number > 0'),
    "hidden_size a string": ({"hidden_size": "64"}, 'hidden_size is "64"; it must be an integer >= 1'),
    "hidden_size 64.5": ({"hidden_size": 64.5}, "hidden_size is 64.5; it must be an integer >= 1"),
    "hidden_size true": ({"hidden_size": True}, "hidden_size is true; it must be an integer >= 1"),
    "no attention heads": ({"num_attention_heads": 0}, "num_attention_heads is 0; it must be an integer >= 1"),
    "heads not dividing hidden": ({"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
                                  "hidden_size 64 is not a multiple of num_attention_heads 3"),
    "torch_dtype float128": ({"torch_dtype": "float128"}, 'torch_dtype is "float128", not a torch dtype'),
    "a million layers": ({"num_hidden_layers": 1000000}, "num_hidden_layers is 1,000,000, more than the 4096"),
    "a config larger than memory": ({"num_hidden_layers": 4000, "hidden_size": 65536, "head_dim": None},
                                    "GiB of memory but this machine has a budget of"),
    "eos id 2^64": ({"eos_token_id": 2**64}, "config.json: eos_token_id is 18446744073709551616: a token id is"),
    "negative pad id": ({"pad_token_id": -1}, "config.json: pad_token_id is -1: a token id is an integer from 0"),
    "bool bos id": ({"bos_token_id": True}, "config.json: bos_token_id is true: a token id"),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_a_config_of_the_wrong_types_is_error_after_progress(folders, tmp_path, capsys, case):
    changes, message = CONFIGS[case]
    folder = shutil.copytree(folders["plain"], tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    line = _error_after_progress(capsys, main(["export", str(folder), "-o", str(tmp_path / "out")]))
    assert message in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "generation_config.json: holds a JSON array, not an object"),
    ('{"eos_token_id": 18446744073709551616}', "generation_config.json: eos_token_id is 18446744073709551616"),
    ("[" * 100000 + "]" * 100000, "generation_config.json: nested deeper than 32 levels"),
])
def test_a_damaged_generation_config_is_error_after_progress(folders, tmp_path, capsys, content, message):
    folder = shutil.copytree(folders["plain"], tmp_path / "model")
    (folder / "generation_config.json").write_text(content)
    assert message in _error_after_progress(capsys, main(["export", str(folder), "-o", str(tmp_path / "out")]))


# -- 5. hostile side files of an exported folder: generate, and serve's loader -----------------------
def _nested(depth):
    return "[" * depth + "]" * depth


SIDE_FILES = {
    "genai eos 2^64": ("genai_config.json", lambda d: d["model"].update(eos_token_id=2**64),
                       "genai_config.json: model: eos_token_id is 18446744073709551616: a token id is an integer"),
    "genai pad 2^63": ("genai_config.json", lambda d: d["model"].update(pad_token_id=2**63),
                       "pad_token_id is 9223372036854775808: a token id"),
    "genai pad -1": ("genai_config.json", lambda d: d["model"].update(pad_token_id=-1),
                     "pad_token_id is -1: a token id"),
    "genai bos true": ("genai_config.json", lambda d: d["model"].update(bos_token_id=True), "bos_token_id is true"),
    "genai eos list with a string": ("genai_config.json", lambda d: d["model"].update(eos_token_id=[2, "3"]),
                                     'eos_token_id is [2, "3"]: a token id'),
    "genai pad past the vocabulary": ("genai_config.json", lambda d: d["model"].update(pad_token_id=256),
                                      "pad_token_id 256 is outside the model's vocabulary [0, 256)"),
    "genai nested": ("genai_config.json", _nested(100000), "genai_config.json: nested deeper than 32 levels"),
    "genai nested a little": ("genai_config.json", '{"model": ' + _nested(40) + "}", "nested deeper than 32 levels"),
    "genai model a list": ("genai_config.json", '{"model": []}', "genai_config.json: has no 'model' object"),
    "config eos 2^64": ("config.json", lambda d: d.update(eos_token_id=2**64), "config.json: eos_token_id is 1844674"),
    "config nested": ("config.json", _nested(100000), "config.json: nested deeper than 32 levels"),
    "config not UTF-8": ("config.json", b'{"eos_token_id": "\xff"}', "config.json: not UTF-8 text"),
    "generation config a list": ("generation_config.json", "[1, 2]",
                                 "generation_config.json: holds a JSON array, not an object"),
    "generation eos negative": ("generation_config.json", '{"eos_token_id": [2, -3]}', "eos_token_id is [2, -3]"),
}


def _damaged_copy(folders, tmp_path, case) -> Path:
    name, change, _ = SIDE_FILES[case]
    folder = shutil.copytree(folders["exported"], tmp_path / "model")
    if callable(change):
        data = json.loads((folder / name).read_text())
        change(data)
        (folder / name).write_text(json.dumps(data))
    else:
        (folder / name).write_bytes(change if isinstance(change, bytes) else change.encode())
    return folder


@pytest.mark.slow  # shares the module's one KV-cache export
@pytest.mark.parametrize("case", sorted(SIDE_FILES))
def test_hostile_side_files_are_refused_when_the_folder_is_opened(folders, tmp_path, capsys, case):
    folder = _damaged_copy(folders, tmp_path, case)
    line = _error_after_progress(capsys, main(["generate", str(folder), "--input-ids", "5,6", "--max-new-tokens", "2"]))
    assert SIDE_FILES[case][2] in line, line


@pytest.mark.slow  # shares the module's one KV-cache export
@pytest.mark.parametrize("case", ["genai eos 2^64", "config nested", "generation config a list"])
def test_serve_refuses_hostile_side_files_before_a_port_opens(folders, tmp_path, case):
    """``serve`` opens a KV-cache folder through the same loader (``Server.__init__``, before
    ``start`` binds any port)."""
    pytest.importorskip("pytriton", reason="serve needs nvidia-pytriton")
    from rmsnorm_deploy.errors import UserError
    from rmsnorm_deploy.serving.server import Server
    from rmsnorm_deploy.serving.triton.process import ServeOptions

    folder = _damaged_copy(folders, tmp_path, case)
    with pytest.raises(UserError) as exc:
        Server(folder, ServeOptions())
    assert SIDE_FILES[case][2] in str(exc.value) and "\n" not in str(exc.value)
