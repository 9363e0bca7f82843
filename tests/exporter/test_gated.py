"""Gated norms and gainless value norms through detection and the export pipeline.

Small models hold transformers' own norm classes (a gated norm fed ``x`` and ``z`` from one
projection; Gemma3n's value norm without a gain), export through the torch op to one
``rmsnorm_deploy::RMSNorm`` node per norm and run in ONNX Runtime CPU against eager. The hybrid
families themselves export from tiny configs in ``benchmarks/sweeps/gated_families.py`` (minutes each:
torch.onnx traces their scans), whose results are in ``benchmarks/results/gated_families.md``.
"""

from __future__ import annotations

import onnx
import pytest
import torch

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.inputs import token_ids
from rmsnorm_deploy.contract.reference import reference
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.detect import detect_norms
from rmsnorm_deploy.exporter.gated import gated_candidates
from rmsnorm_deploy.exporter.loaded_model import LoadedModel, TokenLogits
from rmsnorm_deploy.exporter.pipeline import export_model
from rmsnorm_deploy.exporter.plan import ExportOptions
from rmsnorm_deploy.exporter.torch_op import ExportRMSNorm
from rmsnorm_deploy.graph.function import is_rmsnorm_node, spec_from_node
from rmsnorm_deploy.graph.metadata import ModelMetadata

pytest.importorskip("transformers", reason="the gated norm classes come from transformers")
pytest.importorskip("onnxruntime", reason="the exported models run in ONNX Runtime CPU")
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated  # noqa: E402
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm  # noqa: E402
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated  # noqa: E402

from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402

HIDDEN, VOCAB = 64, 97

NORMS = {
    "mamba2": (lambda: MambaRMSNormGated(HIDDEN, group_size=HIDDEN // 2, eps=1e-5),
               RMSNormSpec.mamba2_gated(1e-5, group_size=HIDDEN // 2)),
    "qwen3_next": (lambda: Qwen3NextRMSNormGated(HIDDEN, eps=1e-6), RMSNormSpec.qwen3_next_gated(1e-6)),
    "kimi_linear": (lambda: KimiLinearRMSNormGated(HIDDEN, eps=1e-6), RMSNormSpec.kimi_gated(1e-6)),
    "falcon_h1": (lambda: FalconH1RMSNormGated(HIDDEN, eps=1e-6, n_groups=4, norm_before_gate=True),
                  RMSNormSpec(1e-6, order="scale_then_cast", gate="silu", gate_placement="after_norm", group_size=16)),
    "gemma3n_value_norm": (lambda: Gemma3nRMSNorm(HIDDEN, eps=1e-6, with_scale=False), RMSNormSpec(1e-6, gain="none")),
}


class MixerBlock(torch.nn.Module):
    """Embedding -> projection to x (and z) -> the norm -> LM head: the norm's place in a mixer."""

    def __init__(self, norm: torch.nn.Module, gated: bool):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.gated = gated
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, 2 * HIDDEN if gated else HIDDEN)
        self.norm = norm
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 1.0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(input_ids))
        if not self.gated:
            return self.head(self.norm(h))
        x, z = h.chunk(2, dim=-1)
        return self.head(self.norm(x, z))


def _loaded(name: str, dtype: str) -> LoadedModel:
    make, spec = NORMS[name]
    block = MixerBlock(make(), gated=spec.has_gate).to(getattr(torch, dtype))
    return LoadedModel(name, TokenLogits(block).eval(), dtype, {"kind": "test"}, vocab_size=VOCAB, max_seq_len=64)


#: A grouped gate before the norm, a gate after the cast-back in float16, and the value norm without a
#: gain: each is a whole torch.onnx export (~5-10 s), the unit this test checks; the other placements
#: share this path and are covered by tests/graph/test_gated_lowerings.py. (bfloat16: ONNX Runtime
#: CPU has no bfloat16 MatMul, so the export's parity cannot run there.)
EXPORTS = [("mamba2", "float32"), ("qwen3_next", "float16"), ("gemma3n_value_norm", "float32")]


@pytest.mark.parametrize("name, dtype", EXPORTS, ids=[f"{n}-{d}" for n, d in EXPORTS])
def test_gated_norm_exports_exactly(name, dtype, tmp_path):
    _, spec = NORMS[name]
    loaded = _loaded(name, dtype)
    path = tmp_path / "model.onnx"
    result = export_model(loaded, path, ExportOptions(dtype=dtype, batch=2, seq=7))

    (norm,) = result.detection.norms
    assert norm.path == "model.norm" and norm.how == "known class" and norm.spec == spec
    assert result.parity.status == "pass", result.parity.table()
    model = onnx.load(str(path))
    (node,) = [n for n in model.graph.node if is_rmsnorm_node(n)]
    assert len(node.input) == 1 + spec.has_gain + spec.has_gate
    assert spec_from_node(node) == RMSNormSpec.from_dict({**spec.to_dict(), "epsilon": spec.epsilon_float32})
    assert ModelMetadata.read(model).specs == {"model.norm": spec}

    # Independently of the parity code: ONNX Runtime against eager, on another shape.
    ids = token_ids((3, 11), VOCAB, seed=5)
    with OnnxRuntimeRunner(path, ["cpu"]) as runner:
        got = runner.infer({"input_ids": ids})["logits"]
    with torch.no_grad():
        want = loaded.module(input_ids=torch.from_numpy(ids))["logits"]
    cmp = compare(got, want, tolerance_for("model", "onnxruntime", dtype), name="logits", dtype=dtype)
    assert cmp, cmp.summary()


def test_detection_confirms_a_gated_norm_with_a_gate_input():
    block = MixerBlock(Qwen3NextRMSNormGated(HIDDEN, eps=1e-6), gated=True)
    (norm,) = detect_norms(block).norms
    assert norm.spec == RMSNormSpec.qwen3_next_gated(1e-6)
    # A class whose forward ignores the gate is no longer what its known class says.
    class Ungated(Qwen3NextRMSNormGated):
        def forward(self, hidden_states, gate=None):
            return super().forward(hidden_states, torch.full_like(hidden_states, 30.0))

    from rmsnorm_deploy.exporter import detect

    detect.KNOWN_CLASSES[detect.class_path(Ungated)] = detect.KNOWN_CLASSES[detect.class_path(Qwen3NextRMSNormGated)]
    try:
        with pytest.raises(detect.NormMismatchError, match=r"'norm' \(.*Ungated\) differs from its spec"):
            detect_norms(MixerBlock(Ungated(HIDDEN, eps=1e-6), gated=True))
    finally:
        del detect.KNOWN_CLASSES[detect.class_path(Ungated)]


def test_export_op_refuses_a_missing_or_unexpected_gate():
    x = torch.randn(2, HIDDEN)
    gated = ExportRMSNorm(RMSNormSpec.kimi_gated(1e-6), torch.ones(HIDDEN), "mixer.norm")
    with pytest.raises(UserError, match=r"norm 'mixer.norm' \(.*\) was called without its gate input"):
        gated(x)
    assert torch.equal(gated(x, x), reference(RMSNormSpec.kimi_gated(1e-6), x, torch.ones(HIDDEN), x))
    plain = ExportRMSNorm(RMSNormSpec.llama(1e-6), torch.ones(HIDDEN), "norm")
    with pytest.raises(UserError, match="was called with a gate input its spec does not have"):
        plain(x, x)


def test_gated_norm_called_without_its_gate_stops_the_export(tmp_path):
    class NoGate(MixerBlock):
        def forward(self, input_ids):
            x, _ = self.proj(self.embed(input_ids)).chunk(2, dim=-1)
            return self.head(self.norm(x))  # the HF classes accept gate=None

    block = NoGate(MambaRMSNormGated(HIDDEN, group_size=HIDDEN, eps=1e-5), gated=True)
    loaded = LoadedModel("nogate", TokenLogits(block).eval(), "float32", {"kind": "test"}, VOCAB, 64)
    with pytest.raises(UserError, match="was called without its gate input") as info:
        export_model(loaded, tmp_path / "m.onnx", ExportOptions(dtype="float32", batch=1, seq=4))
    assert "\n" not in str(info.value)


def test_gated_candidates_cover_the_known_classes():
    candidates = gated_candidates(1e-6, 64, group_sizes=(None, 32, 48))
    assert len(candidates) == len(set(candidates))
    assert RMSNormSpec.mamba2_gated(1e-6, 32) in candidates and RMSNormSpec.qwen3_next_gated(1e-6) in candidates
    assert RMSNormSpec.kimi_gated(1e-6) in candidates
    assert all(c.has_gate and c.group_size in (None, 32) for c in candidates)  # 48 does not divide 64
    # 2 activations x 3 placements x (2 orders with a weight + 1 without) x 2 group sizes
    assert len(candidates) == 2 * 3 * 3 * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_gated_and_gemma3n_class_is_detected_and_confirmed(dtype):
    from tests.contract.test_gated import _build, _class

    from rmsnorm_deploy.exporter.gated import GAINLESS_CAPABLE_CLASSES, GATED_CLASSES, PROBE_WIDTH

    dt = getattr(torch, dtype)
    for qualified in GATED_CLASSES:
        norm = _build(qualified, HIDDEN, 2).to(dt)
        with torch.no_grad():
            norm.weight.add_(torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3)).to(dt) * 0.3)
        (found,) = detect_norms(torch.nn.ModuleDict({"mixer": torch.nn.ModuleDict({"norm": norm})})).norms
        assert found.path == "mixer.norm" and found.how == "known class" and found.spec.has_gate, qualified
        assert found.normalized_shape == (HIDDEN,) and found.weight is norm.weight
    for qualified in GAINLESS_CAPABLE_CLASSES:
        for with_scale in (True, False):
            norm = _class(qualified)(HIDDEN, eps=1e-6, with_scale=with_scale).to(dt)
            (found,) = detect_norms(torch.nn.ModuleDict({"v_norm": norm}), dtype=dtype).norms
            assert found.spec == RMSNormSpec(1e-6, gain="weight" if with_scale else "none"), qualified
            # The value norm has no width attribute: it is confirmed at a probe width.
            assert found.normalized_shape == ((HIDDEN,) if with_scale else (PROBE_WIDTH,))
