"""Hugging Face families exported and run in ONNX Runtime CPU against transformers' eager logits.

Tiny random configs (2 layers, hidden 64). Each family exports once in float32 (max abs error on
the logits within the float32 model tolerance, 1e-4); float16 once each for two families whose
norms round differently (Gemma3: ``1 + w`` in float32, then cast, with q/k norms; Qwen3: cast,
then scale, with q/k norms), within the float16 model tolerance. Llama is exported from a saved
folder (config.json + safetensors), the others from their configs.
"""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.inputs import token_ids
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.pipeline import export_model
from rmsnorm_deploy.exporter.plan import ExportOptions, load_torch_model
from rmsnorm_deploy.exporter.rebuild import rebuild_source
from rmsnorm_deploy.graph.metadata import ModelMetadata

pytest.importorskip("transformers", reason="the Hugging Face export needs transformers")
pytest.importorskip("onnxruntime", reason="the exported models run in ONNX Runtime CPU")
from rmsnorm_deploy.exporter import hf  # noqa: E402
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402

VOCAB = 256
#: family -> (norms in the model, norm class, spec of every norm: the config's default rms_norm_eps)
FAMILIES = {
    "llama": (5, "LlamaRMSNorm", RMSNormSpec.llama(1e-6)),
    "mistral": (5, "MistralRMSNorm", RMSNormSpec.llama(1e-6)),
    "qwen2": (5, "Qwen2RMSNorm", RMSNormSpec.llama(1e-6)),
    "qwen3": (9, "Qwen3RMSNorm", RMSNormSpec.llama(1e-6)),  # + q/k norms over head_dim
    "gemma3": (13, "Gemma3RMSNorm", RMSNormSpec.gemma(1e-6)),  # 4 per layer + q/k norms
    "phi3": (5, "Phi3RMSNorm", RMSNormSpec.llama(1e-5)),
    "olmo2": (9, "Olmo2RMSNorm", RMSNormSpec.olmo2(1e-5)),  # post-norms + q/k norms over hidden
}
#: family -> how many norms stand in each place (graph/placement.py), both sides of the export agreeing
PLACEMENTS = {
    "qwen3": {"pre": 4, "qk": 4, "final": 1},
    "gemma3": {"pre": 4, "qk": 4, "sublayer_output": 4, "final": 1},
    "olmo2": {"qk": 4, "sublayer_output": 4, "final": 1},
}
PRE_NORM = {"pre": 4, "final": 1}
CASES = [(f, "float32") for f in FAMILIES] + [("gemma3", "float16"), ("qwen3", "float16")]


def _config(family: str) -> dict:
    return hf.TINY_CONFIGS[family]


def test_every_tiny_config_is_tested():
    assert set(hf.TINY_CONFIGS) == set(FAMILIES)


@pytest.mark.parametrize("family, dtype", CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_family_export_matches_transformers_eager(family, dtype, tmp_path):
    norm_count, norm_class, spec = FAMILIES[family]
    if family == "llama":  # the folder route: config.json + model.safetensors, nothing from the Hub
        folder = tmp_path / "tiny-llama"
        hf.from_config(_config(family), "float32", seed=1).module.model.save_pretrained(folder)
        assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
        loaded = load_torch_model(str(folder), dtype)
        assert loaded.source == {"kind": "hf", "path": str(folder.resolve()), "model_type": "llama"}
    else:
        loaded = hf.from_config(_config(family), dtype, seed=1)
    path = tmp_path / "out" / "model.onnx"
    result = export_model(loaded, path, ExportOptions(dtype=dtype, batch=2, seq=11))

    norms = result.detection.norms
    assert len(norms) == norm_count and {n.class_name.rsplit(".", 1)[-1] for n in norms} == {norm_class}
    assert {n.spec for n in norms} == {spec}
    model = onnx.load(str(path))
    assert sum(n.op_type == "RMSNorm" for n in model.graph.node) == norm_count
    assert result.parity.status == "pass", result.parity.table()

    # Independently of the parity code: ONNX Runtime against transformers' eager logits.
    eager = loaded.module.model
    tol = tolerance_for("model", "onnxruntime", dtype)
    with OnnxRuntimeRunner(path, ["cpu"]) as runner:
        for shape in [(1, 5), (3, 17)]:
            ids = token_ids(shape, VOCAB, seed=shape[1])
            got = runner.infer({"input_ids": ids})["logits"]
            with torch.no_grad():
                want = eager(input_ids=torch.from_numpy(ids), use_cache=False).logits
            result_cmp = compare(got, want, tol, name="logits", dtype=dtype)
            assert result_cmp, result_cmp.summary()
            if dtype == "float32":
                assert result_cmp.max_abs <= tol.atol  # the family bar: max abs <= 1e-4

    meta = ModelMetadata.read(model)
    assert meta.source["kind"] == "hf" and set(meta.specs) == {n.path for n in norms}
    if family in ("llama", "qwen3"):  # both source forms rebuild the same module
        rebuilt = rebuild_source(meta)
        ids = torch.from_numpy(token_ids((2, 6), VOCAB))
        with torch.no_grad():
            assert torch.equal(rebuilt(input_ids=ids)["logits"], loaded.module(input_ids=ids)["logits"])
    report = json.loads((path.parent / "report.json").read_text())
    assert report["parity"]["status"] == "pass" and report["source"]["kind"] == "hf"
    placed = [n["placement"] for n in report["norms"]]
    assert {p: placed.count(p) for p in placed} == PLACEMENTS.get(family, PRE_NORM)


def test_random_config_models_are_seeded():
    a = hf.from_config(_config("olmo2"), "float32", seed=3).module
    b = hf.from_config(_config("olmo2"), "float32", seed=3).module
    c = hf.from_config(_config("olmo2"), "float32", seed=4).module
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.model.norm.weight, c.model.model.norm.weight)
    assert not torch.equal(a.model.model.norm.weight, torch.ones_like(a.model.model.norm.weight))  # gains moved off 1


@pytest.mark.parametrize("setup, message", [
    ("missing", "not a folder"),
    ("no-config", "no config.json"),
    ("bin-only", r"no \*.safetensors weights \(found pytorch_model.bin: pickled weights are not loaded"),
    ("bad-json", "config.json: not valid JSON"),
    ("unknown-type", "unsupported architecture 'not-a-model'"),
    ("not-causal", "unsupported architecture 'vit': transformers has no causal-LM class for it"),
])
def test_bad_folders_are_one_line_errors(setup, message, tmp_path):
    folder = tmp_path / "m"
    if setup != "missing":
        folder.mkdir()
    if setup == "bin-only":
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (folder / "pytorch_model.bin").write_bytes(b"\x80")
    if setup in ("bad-json", "unknown-type", "not-causal"):
        (folder / "model.safetensors").write_bytes(b"")
        text = {"bad-json": "{", "unknown-type": json.dumps({"model_type": "not-a-model"}),
                "not-causal": json.dumps({"model_type": "vit"})}[setup]
        (folder / "config.json").write_text(text)
    with pytest.raises(UserError, match=message) as info:  # HFModelError, or SideFileError for a damaged file
        hf.load_folder(folder, "float32")
    assert "\n" not in str(info.value)
