"""Presets: every TOML in models/ loads, has the published shape, and rebuilds from metadata."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.exporter.presets import (
    PACKAGE_PRESETS,
    REPO_PRESETS,
    PresetError,
    build_preset,
    load_preset,
    parse_preset,
    preset_names,
)
from rmsnorm_deploy.exporter.rebuild import rebuild_source
from rmsnorm_deploy.graph.metadata import ModelMetadata

#: preset -> (layers of the full model, its published parameter count: the preset is one block of it)
PUBLISHED = {
    "llama3-8b-block": (32, 8_030_261_248),  # meta-llama/Meta-Llama-3-8B
    "mistral-7b-block": (32, 7_248_023_552),  # mistralai/Mistral-7B-v0.3
    "qwen3-8b-block": (36, 8_190_735_360),  # Qwen/Qwen3-8B
    "gemma-2b-block": (18, 2_506_172_416),  # google/gemma-2b
}
NORM_SPECS = {
    "tiny": RMSNormSpec.llama(1e-5),
    "llama3-8b-block": RMSNormSpec.llama(1e-5),
    "mistral-7b-block": RMSNormSpec.llama(1e-5),
    "qwen3-8b-block": RMSNormSpec.llama(1e-6),
    "gemma-2b-block": RMSNormSpec.gemma(1e-6),
}


def test_every_repository_preset_is_listed_and_loads():
    names = {p.stem for p in REPO_PRESETS.glob("*.toml")}
    assert names == set(NORM_SPECS) and set(preset_names()) == names
    for name in names:
        preset = load_preset(name)
        assert preset.args.norm == NORM_SPECS[name], name
        assert preset.description


def test_shipped_tiny_preset_is_the_repository_one():
    assert (PACKAGE_PRESETS / "tiny.toml").read_bytes() == (REPO_PRESETS / "tiny.toml").read_bytes()
    assert [p.name for p in PACKAGE_PRESETS.glob("*.toml")] == ["tiny.toml"]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_block_presets_have_the_published_shape(name):
    layers, published = PUBLISHED[name]
    args = load_preset(name).args
    assert args.n_layers == 1
    assert dataclasses.replace(args, n_layers=layers).parameter_count() == published
    with torch.device("meta"):  # the real module, without allocating its weights
        from rmsnorm_deploy.exporter.blocks import Transformer

        model = Transformer(args, "float16")
    assert sum(p.numel() for p in model.parameters()) == args.parameter_count()


def test_qwen3_preset_normalizes_q_and_k_over_head_dim():
    args = load_preset("qwen3-8b-block").args
    assert args.qk_norm and args.resolved_head_dim == 128 and args.norm_count() == 5


def test_preset_by_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text((REPO_PRESETS / "tiny.toml").read_text().replace("n_layers = 2", "n_layers = 1"))
    preset = load_preset(str(path))
    assert preset.name == "mine" and preset.args.n_layers == 1 and preset.path == path


def test_preset_source_rebuilds_the_same_model():
    preset = load_preset("tiny")
    loaded = build_preset(preset, "float16")
    meta = ModelMetadata(specs={}, lowering="function", dtype="float16", source=loaded.source)
    rebuilt = rebuild_source(meta)
    ids = torch.randint(0, preset.args.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(rebuilt(input_ids=ids)["logits"], loaded.module(input_ids=ids)["logits"])
    assert not rebuilt.training


BAD = {
    "not toml": ("[model\nx=", "not valid TOML"),
    "no norm": ("[model]\nvocab_size=8\ndim=8\nn_layers=1\nn_heads=2\nintermediate_size=8\n", r"missing the \[norm\] table"),
    "unknown section": ("[modle]\n[model]\n[norm]\n", r"unknown top-level entries \['modle'\]"),
    "bad field": ("[model]\nvocab_size=8\ndim=8\nn_layers=1\nn_heads=2\nintermediate_size=8\nhidden=3\n[norm]\n",
                  r"unknown model field\(s\) \['hidden'\]"),
    "bad spec": ("[model]\nvocab_size=8\ndim=8\nn_layers=1\nn_heads=2\nintermediate_size=8\n[norm]\ngain='scale'\n",
                 "unknown gain 'scale'"),
    "bad seed": ("[model]\nvocab_size=8\ndim=8\nn_layers=1\nn_heads=2\nintermediate_size=8\n[norm]\n[weights]\nseed=-1\n",
                 "seed must be an integer >= 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_presets_are_one_line_errors_naming_the_file(case, tmp_path):
    text, message = BAD[case]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PresetError, match=message) as info:
        load_preset(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(PresetError, match=r"unknown model 'tinyy': not a preset name \(.*tiny.*\)"):
        load_preset("tinyy")
    with pytest.raises(PresetError, match="preset file nowhere/x.toml does not exist"):
        load_preset("nowhere/x.toml")


def test_parse_preset_without_file():
    preset = parse_preset((REPO_PRESETS / "tiny.toml").read_text(), name="t")
    assert preset.source()["toml"].startswith("# tiny") and preset.source()["seed"] == 0
