"""``--fuse-attention``: opset-23 Attention and RotaryEmbedding, every norm still its spec.

Each fused export is run in ONNX Runtime CPU at batch 1, 2 and 4 and at sequence lengths from 1
to the model's maximum, against the PyTorch module (eager), within the model tolerance (float32:
max abs <= 1e-4); the graph keeps one ``rmsnorm_deploy::RMSNorm`` node per norm call with every
reduction in float32, as written and as ONNX Runtime runs it. What the rules cannot prove is
left as exported (and counted), and what the option cannot do is refused in one line.
"""

from __future__ import annotations

import json
import math

import onnx
import pytest
import torch
import torch.nn.functional as F

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.inputs import token_ids
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.exporter.fusions import FusionError, fusion_counts_in
from rmsnorm_deploy.exporter.loaded_model import LoadedModel, TokenLogits
from rmsnorm_deploy.exporter.pipeline import export_model
from rmsnorm_deploy.exporter.plan import ExportOptions, check_options, load_torch_model
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.function import is_rmsnorm_node

pytest.importorskip("onnxruntime", reason="the fused graphs run in ONNX Runtime CPU")
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402

#: batch x seq: batch 1, 2 and 4; the shortest sequence, odd lengths (those shorter than the model's
#: maximum), and the maximum itself
SHAPES = [(1, 1), (2, 9), (4, 33), (2, 64)]
UNFUSED_OPS = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization",
               "GroupQueryAttention", "MultiHeadAttention"}


def _check_norms_kept(model: onnx.ModelProto, norm_count: int) -> None:
    """Every norm call is one of our nodes and every reduction accumulates in float32."""
    nodes = [n for n in model.graph.node if is_rmsnorm_node(n)]
    assert len(nodes) == norm_count
    assert not UNFUSED_OPS & {n.op_type for n in model.graph.node}
    assert all(n.domain in ("", "ai.onnx", "rmsnorm_deploy") for n in model.graph.node)
    reductions = [r for r in audit_model(model) if r.kind == "RMSNorm"]
    assert len(reductions) == norm_count and {r.accumulation for r in reductions} == {"float32"}


def _run_shapes(path, module, vocab: int, max_seq: int, dtype: str) -> None:
    tol = tolerance_for("model", "onnxruntime", dtype)
    with OnnxRuntimeRunner(path, ["cpu"]) as runner:
        for shape in [s for s in SHAPES if s[1] < max_seq] + [(1, max_seq)]:
            ids = token_ids(shape, vocab, seed=sum(shape))
            got = runner.infer({"input_ids": ids})["logits"]
            with torch.no_grad():
                want = module(input_ids=torch.from_numpy(ids))["logits"]
            result = compare(got, want, tol, name=f"logits{list(shape)}", dtype=dtype)
            assert result, result.summary()
            if dtype == "float32":
                assert result.max_abs <= tol.atol, result.summary()


def test_tiny_preset_fused_at_every_batch_and_length(tmp_path, capsys):
    from rmsnorm_deploy.cli import main

    path = tmp_path / "model.onnx"
    assert main(["export", "tiny", "--fuse-attention", "-o", str(path)]) == 0
    loaded = load_torch_model("tiny", "float32")
    args = loaded.module.model.args
    layers = args.n_layers
    out = capsys.readouterr().out
    assert "opset 23" in out and f"fused: {layers} Attention ({layers} on shared key/value heads), " \
        f"{2 * layers} RotaryEmbedding" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["opset"] == 23 and report["fuse_attention"] is True
    assert report["fusions"] == {"attention": layers, "shared_kv": layers, "rotary": 2 * layers, "decomposed_rotary": 0}
    parity = report["parity"]
    assert parity["status"] == "pass" and parity["onnxruntime_norm_accumulation"] == "float32"
    assert parity["onnxruntime_norm_ops"] == "SimplifiedLayerNormalization"

    model = onnx.load(str(path))
    onnx.checker.check_model(str(path), full_check=True)
    assert fusion_counts_in(model.graph.node) == {"Attention": layers, "RotaryEmbedding": 2 * layers}
    _check_norms_kept(model, args.norm_count())
    for node in model.graph.node:
        if node.op_type == "Attention":  # the key/value heads themselves, not copies per query head
            assert node.input[1] in _outputs_of(model, "RotaryEmbedding") and not node.input[3:]
    _run_shapes(path, loaded.module, args.vocab_size, args.max_seq_len, "float32")


def _outputs_of(model: onnx.ModelProto, op_type: str) -> set[str]:
    return {o for n in model.graph.node if n.op_type == op_type for o in n.output}


HF_CASES = [("llama", "float32"), ("gemma3", "float32"), ("phi3", "float32"), ("qwen3", "float16")]


@pytest.mark.parametrize("family, dtype", HF_CASES, ids=[f"{f}-{d}" for f, d in HF_CASES])
def test_hf_family_fused_matches_eager(family, dtype, tmp_path):
    pytest.importorskip("transformers", reason="the Hugging Face export needs transformers")
    from rmsnorm_deploy.exporter import hf

    config = hf.TINY_CONFIGS[family]
    loaded = hf.from_config(config, dtype, seed=1)
    path = tmp_path / "model.onnx"
    result = export_model(loaded, path, ExportOptions(dtype=dtype, fuse_attention=True, batch=2, seq=11))
    layers = config["num_hidden_layers"]
    assert result.fusions.to_dict() == {"attention": layers, "shared_kv": layers, "rotary": 2 * layers,
                                        "decomposed_rotary": 0}
    assert result.parity.status == "pass", result.parity.table()
    _check_norms_kept(onnx.load(str(path)), len(result.detection.norms))
    _run_shapes(path, loaded.module, config["vocab_size"], config["max_position_embeddings"], dtype)


class _BufferRotaryModel(torch.nn.Module):
    """A causal LM whose rotary tables are stored buffers (not computed from angles in the graph) and
    whose key/value heads equal its query heads: nothing for either rule to prove."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, max_seq: int = 40):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        angles = torch.arange(max_seq, dtype=torch.float32)[:, None] * torch.rand(self.head_dim // 2)[None]
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos_table", angles.cos())
        self.register_buffer("sin_table", angles.sin())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        x = self.norm(self.embed(input_ids))
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        cos, sin = self.cos_table[:s], self.sin_table[:s]
        q = q * cos + torch.cat([-q[..., self.head_dim // 2:], q[..., : self.head_dim // 2]], dim=-1) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


def test_unprovable_rotary_and_equal_heads_are_left_as_exported(tmp_path):
    torch.manual_seed(0)
    module = TokenLogits(_BufferRotaryModel()).eval()
    loaded = LoadedModel("buffer-rotary", module, "float32", {"kind": "test"}, vocab_size=64, max_seq_len=40)
    path = tmp_path / "model.onnx"
    result = export_model(loaded, path, ExportOptions(fuse_attention=True, batch=2, seq=8))
    assert result.fusions.to_dict() == {"attention": 1, "shared_kv": 0, "rotary": 0, "decomposed_rotary": 1}
    assert "1 rotary embedding(s) left decomposed" in result.fusions.describe()
    assert result.parity.status == "pass", result.parity.table()
    model = onnx.load(str(path))
    assert fusion_counts_in(model.graph.node) == {"Attention": 1, "RotaryEmbedding": 0}
    _check_norms_kept(model, 1)
    _run_shapes(path, module, 64, 40, "float32")


def test_model_without_sdpa_is_refused(tmp_path):
    class EagerAttention(_BufferRotaryModel):
        def forward(self, input_ids):
            x = self.norm(self.embed(input_ids))
            scores = x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1])
            return self.out(scores.softmax(-1) @ x)

    loaded = LoadedModel("eager", TokenLogits(EagerAttention()).eval(), "float32", {"kind": "test"},
                         vocab_size=64, max_seq_len=40)
    path = tmp_path / "model.onnx"
    with pytest.raises(FusionError, match=r"eager: --fuse-attention found no attention to fuse: the model does not "
                                          r"call torch's scaled_dot_product_attention"):
        export_model(loaded, path, ExportOptions(fuse_attention=True, parity=False))
    assert not path.exists()


def test_fuse_attention_needs_opset_23(capsys):
    with pytest.raises(FusionError, match=r"opset-23 ops; this export asks for opset 18 \(leave --opset out or give "
                                          r"--opset 23\)"):
        check_options(ExportOptions(fuse_attention=True, opset=18))
    assert ExportOptions(fuse_attention=True).resolved_opset() == 23
    assert ExportOptions(fuse_attention=True, lowering="native").resolved_opset() == 23

    from rmsnorm_deploy.cli import main

    assert main(["export", "tiny", "--fuse-attention", "--opset", "20", "-o", "unused.onnx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "asks for opset 20" in err[0]
