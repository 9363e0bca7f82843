"""Placement on the PyTorch side (the model run eagerly) and its comparison with the graph at export.

The Hugging Face families come from tiny configs (no Hub) and are only run, not exported (their
exports, which compare both sides, are in test_hf_export.py); a post-norm language model is
exported twice: as it is, and with its graph edited so that one norm moves (refused).
"""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.exporter import pipeline as export_mod
from rmsnorm_deploy.exporter.detect import detect_norms
from rmsnorm_deploy.exporter.loaded_model import LoadedModel, TokenLogits
from rmsnorm_deploy.exporter.pipeline import export_model
from rmsnorm_deploy.exporter.placement import check_placements, torch_placements
from rmsnorm_deploy.exporter.plan import ExportError, ExportOptions, load_torch_model
from rmsnorm_deploy.graph.metadata import ModelMetadata

IDS = {"input_ids": torch.tensor([[3, 1, 4, 1, 5, 9]])}


def _placements(loaded: LoadedModel) -> dict[str, str]:
    detection = detect_norms(loaded.module, dtype=loaded.dtype)
    return torch_placements(loaded.module, detection.norms, IDS)


def _layer(placed: dict[str, str], prefix: str, layer: int = 0) -> dict[str, str]:
    """The placements of one layer, keyed by the norm's name inside it, and of the final norm."""
    inside = f"{prefix}layers.{layer}."
    return {k.removeprefix(inside): v for k, v in placed.items() if k.startswith(inside) or k == f"{prefix}norm"}


def test_tiny_preset_is_pre_norm():
    placed = _placements(load_torch_model("tiny", "float32"))
    assert _layer(placed, "model.", 1) == {"attention_norm": "pre", "ffn_norm": "pre", "model.norm": "final"}
    assert len(placed) == 5


#: family -> placements of the norms of layer 0 and of the final norm
HF_FAMILIES = {
    "llama": {"input_layernorm": "pre", "post_attention_layernorm": "pre"},
    "qwen3": {"input_layernorm": "pre", "self_attn.q_norm": "qk", "self_attn.k_norm": "qk",
              "post_attention_layernorm": "pre"},  # q/k norms per head
    "olmo2": {"self_attn.q_norm": "qk", "self_attn.k_norm": "qk",  # q/k norms over all heads
              "post_attention_layernorm": "sublayer_output", "post_feedforward_layernorm": "sublayer_output"},
    "gemma3": {"input_layernorm": "pre", "self_attn.q_norm": "qk", "self_attn.k_norm": "qk",
               "post_attention_layernorm": "sublayer_output", "pre_feedforward_layernorm": "pre",
               "post_feedforward_layernorm": "sublayer_output"},
}


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_hugging_face_families(family):
    pytest.importorskip("transformers", reason="the Hugging Face families need transformers")
    from rmsnorm_deploy.exporter import hf

    placed = _placements(hf.from_config(hf.TINY_CONFIGS[family], "float32", seed=1))
    want = {**HF_FAMILIES[family], "model.model.norm": "final"}
    assert _layer(placed, "model.model.", 0) == want
    assert _layer(placed, "model.model.", 1) == want


def test_eager_attention_is_recognised_like_sdpa():
    """transformers' eager attention (matmul, softmax) and its SDPA call place the q/k norms alike."""
    pytest.importorskip("transformers", reason="needs transformers")
    from rmsnorm_deploy.exporter import hf

    loaded = hf.from_config(hf.TINY_CONFIGS["qwen3"], "float32", seed=1)
    sdpa = _placements(loaded)
    loaded.module.model.config._attn_implementation = "eager"
    assert _placements(loaded) == sdpa


# (The class names avoid "Norm": detection takes a module whose class name says so for a norm.)
class ResidualThenScaleLayer(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


class ResidualFirstLM(torch.nn.Module):
    """The original transformer's order: ``h = norm(h + f(h))`` per layer, then the head."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(ResidualThenScaleLayer(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


POST = {"model.layers.0.norm": "post", "model.layers.1.norm": "post", "model.layers.2.norm": "final"}


def _post_norm_model() -> LoadedModel:
    return LoadedModel("post-norm", TokenLogits(ResidualFirstLM()).eval(), "float32", {"kind": "module"}, 32, 64)


def test_post_norm_block_in_pytorch():
    assert _placements(_post_norm_model()) == POST


def test_post_norm_model_exports_with_its_placements(tmp_path, capsys):
    """Both sides agree; report.json, the metadata and ``audit --json`` carry each norm's placement."""
    path = tmp_path / "model.onnx"
    result = export_model(_post_norm_model(), path, ExportOptions(dtype="float32", batch=1, seq=5))
    assert result.parity.status == "pass"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["placements"] == POST
    assert {n["path"]: n["placement"] for n in report["norms"]} == POST
    meta = ModelMetadata.read(onnx.load(str(path)))
    assert {k: v["placement"] for k, v in meta.placements.items()} == POST
    assert main(["audit", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    written = [r for r in data["reductions"] if r["stage"] == "as written"]
    assert {r["node"]: r["placement"] for r in written} == POST and data["findings"] == []
    assert [r["placement"] for r in data["reductions"] if r["stage"] != "as written"] == list(POST.values())


def test_export_refuses_a_graph_that_moves_a_norm(tmp_path, monkeypatch):
    """The graph is edited after lowering so that layer 1 adds its sublayer to layer 0's residual sum
    instead of to layer 0's normalized output: layer 0's norm becomes a pre-norm in the graph."""
    lower = export_mod.lower_model

    def lower_and_edit(model: onnx.ModelProto, lowering: str) -> onnx.ModelProto:
        model = lower(model, lowering)
        norm = next(n for n in model.graph.node if n.name == "model.layers.0.norm")
        add = next(n for n in model.graph.node if n.op_type == "Add" and norm.output[0] in n.input)
        add.input[list(add.input).index(norm.output[0])] = norm.input[0]
        return model

    monkeypatch.setattr(export_mod, "lower_model", lower_and_edit)
    path = tmp_path / "model.onnx"
    with pytest.raises(ExportError) as info:
        export_model(_post_norm_model(), path, ExportOptions(dtype="float32", batch=1, seq=5, parity=False))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("norm 'model.layers.0.norm': the exported graph places it 'pre', the PyTorch model 'post'")
    assert not path.exists()


def test_check_placements_names_the_norm_and_both_sides():
    check_placements({"a": "pre", "b": "final"}, {"a": "pre", "b": "final"})
    with pytest.raises(ExportError, match="norm 'b': the exported graph places it 'not found', the PyTorch model 'final'"):
        check_placements({"a": "pre", "b": "final"}, {"a": "pre"})
    with pytest.raises(ExportError, match="norm 'c': the exported graph places it 'qk', the PyTorch model never calls it"):
        check_placements({"a": "pre"}, {"a": "pre", "c": "qk"})


def test_a_norm_called_twice_is_placed_per_call():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(8)
            self.f = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = x + self.f(self.norm(x))
            return {"y": self.norm(x=h)}  # called by keyword too

    module = Shared()
    norms = detect_norms(module, dtype="float32").norms
    placed = torch_placements(module, norms, {"x": torch.randn(1, 3, 8)})
    assert placed == {"norm": "pre", "norm#2": "final"}



class SliceFilledKeys(torch.nn.Module):
    """Keys assembled in a buffer by writes into views of it, as MLA does (DeepSeek-style ``expand_kv``:
    ``new_empty``, then ``keys[..., :n].copy_(k_nope)``): the normalized rotary part reaches the scores
    only through the buffer."""

    def __init__(self, write):
        super().__init__()
        self.q, self.k_nope, self.k_rope, self.v = (torch.nn.Linear(8, 8), torch.nn.Linear(8, 4),
                                                      torch.nn.Linear(8, 4), torch.nn.Linear(8, 8))
        self.k_rope_norm = torch.nn.RMSNorm(4)
        self.write = write

    def forward(self, x):
        q = self.q(x)
        keys = q.new_empty(q.shape)
        self.write(keys[..., :4], self.k_nope(x))
        self.write(keys.narrow(-1, 4, 4), self.k_rope_norm(self.k_rope(x)))
        return {"y": torch.nn.functional.scaled_dot_product_attention(q, keys, self.v(x))}


@pytest.mark.parametrize("write", [lambda view, v: view.copy_(v), lambda view, v: view.__setitem__(..., v)],
                         ids=["copy_", "setitem"])
def test_a_write_into_a_view_reaches_its_base(write):
    """A norm written into a slice of the key buffer feeds attention's keys: ``qk``, as the graph (one
    ``Concat``) places it; recording the write on the slice alone left the norm ``other``."""
    module = SliceFilledKeys(write)
    norms = detect_norms(module, dtype="float32").norms
    assert torch_placements(module, norms, {"x": torch.randn(1, 3, 8)}) == {"k_rope_norm": "qk"}


def test_layer_norms_are_norms_on_both_sides():
    """A LayerNorm (exported as it is) is a norm in the graph; the PyTorch side collapses it too, so a
    norm whose value reaches the head only through a LayerNorm is ``other`` on both sides."""
    class Stacked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rms, self.ln, self.head = torch.nn.RMSNorm(8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4)

        def forward(self, x):
            return {"y": self.head(self.ln(self.rms(x)))}

    module = Stacked()
    detection = detect_norms(module, dtype="float32")
    assert [n.path for n in detection.norms] == ["rms"] and [p for p, _ in detection.other_norms] == ["ln"]
    x = {"x": torch.randn(1, 3, 8)}
    assert torch_placements(module, detection.norms, x, others=["ln"]) == {"rms": "other"}
    assert torch_placements(module, detection.norms, x) == {"rms": "final"}  # the LayerNorm's ops crossed


def test_layer_norms_of_a_wrapped_model_are_found_by_their_model_names():
    """Detection names a LayerNorm as the wrapped model does (without the wrapper's ``model.``);
    placing the norms must find it under the wrapper (DeepSeek-V3.2's indexer LayerNorm crashed
    the export with ``AttributeError: ... has no attribute `layers```)."""
    from rmsnorm_deploy.exporter.detect import PATH_PREFIX_ATTRIBUTE, root_path
    from rmsnorm_deploy.exporter.pipeline import _source_placements

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.LayerNorm(8)])
            self.rms, self.head = torch.nn.RMSNorm(8), torch.nn.Linear(8, 4)

        def forward(self, input_ids):
            x = torch.nn.functional.one_hot(input_ids, 8).float()
            return self.head(self.rms(self.layers[0](x) + x))

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

        def forward(self, input_ids):
            return {"logits": self.model(input_ids)}

    setattr(Wrapper, PATH_PREFIX_ATTRIBUTE, "model.")
    module = Wrapper()
    detection = detect_norms(module, dtype="float32")
    assert [p for p, _ in detection.other_norms] == ["layers.0"]
    assert root_path(module, "layers.0") == "model.layers.0" and root_path(module, "elsewhere") == "elsewhere"
    assert _source_placements(module, detection, torch.tensor([[1, 2, 3]])) == {"model.rms": "final"}


class ScaledSublayerLM(torch.nn.Module):
    """HyperCLOVA X's block: ``h = h + norm(f(h)) * multiplier`` per layer, then a final norm and the head."""

    def __init__(self, multiplier: float, vocab: int = 32, dim: int = 16, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.multiplier = multiplier
        self.embed = torch.nn.Embedding(vocab, dim)
        self.fs = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.post_norms = torch.nn.ModuleList(torch.nn.RMSNorm(dim, eps=1e-6) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for f, post in zip(self.fs, self.post_norms):
            h = h + post(torch.relu(f(h))) * self.multiplier
        return self.head(self.norm(h))


SCALED = {"model.post_norms.0": "sublayer_output", "model.post_norms.1": "sublayer_output", "model.norm": "final"}


@pytest.mark.parametrize("multiplier", [1.0, 0.5], ids=["folded-by-the-exporter", "kept"])
def test_a_constant_scaling_keeps_a_sublayer_output_norm(tmp_path, multiplier):
    """``x + norm(f(x)) * α`` is ``sublayer_output`` on both sides, whether the exporter folds α = 1
    away (the graph has no Mul) or keeps it (a Mul by a constant in both)."""
    loaded = LoadedModel("scaled", TokenLogits(ScaledSublayerLM(multiplier)).eval(), "float32", {"kind": "module"}, 32, 64)
    assert _placements(loaded) == SCALED
    result = export_model(loaded, tmp_path / "model.onnx", ExportOptions(dtype="float32", batch=1, seq=5))
    assert result.parity.status == "pass"
    assert json.loads((tmp_path / "report.json").read_text())["placements"] == SCALED
