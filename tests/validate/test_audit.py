"""audit and validate on graphs made by other tools: torch.onnx (dynamo, opsets 18 and 23) of HF norms,
ONNX Runtime's transformers optimizer and float16 converter, and onnxruntime-genai's model builder.

What they show (with onnxruntime 1.32 on CPU):

* torch.onnx keeps HF's float32 upcast: a Cast/Pow/ReduceMean chain at opset 18, ``RMSNormalization``
  with ``stash_type=1`` at opset 23. No low-precision reduction.
* ONNX Runtime's own float16 converter (``onnxruntime.transformers.float16``) turns the float32
  export's chain into float16 ``Pow``/``ReduceMean``: a float16 reduction, as written. ONNX Runtime's
  CPU provider widens it back to float32 when it runs it; a provider with float16 kernels would not.
* The transformers optimizer fuses the chain into ``SimplifiedLayerNormalization`` and
  ``SkipSimplifiedLayerNormalization``; converted to float16 (its documented next step), the Skip op
  sums in float16 on ONNX Runtime's CUDA provider before 1.27 (onnxruntime#29034). The genai
  builder writes the same op for float16 CUDA models.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
from filelock import FileLock

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.reductions import low_precision_reductions
from rmsnorm_deploy.validate.audit import audit_after_onnxruntime
from rmsnorm_deploy.validate.run import validate_model
from tests.validate.test_validate import assert_self_consistent

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'rmsnorm-deploy[onnxruntime]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'rmsnorm-deploy[hf]'")

HIDDEN = 64


class PreNormBlock(torch.nn.Module):
    """Two pre-norm residual sublayers and a final norm, with HF's own norm classes (Llama's and Gemma's)."""

    def __init__(self):
        super().__init__()
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        torch.manual_seed(0)
        self.norm1, self.norm2 = LlamaRMSNorm(HIDDEN, 1e-6), LlamaRMSNorm(HIDDEN, 1e-6)
        self.final_norm = GemmaRMSNorm(HIDDEN, 1e-6)
        self.up, self.down = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        with torch.no_grad():
            for norm in (self.norm1, self.norm2, self.final_norm):
                norm.weight.uniform_(-0.5, 0.5) if norm is self.final_norm else norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        h = x + self.up(self.norm1(x))
        h = h + self.down(self.norm2(h))
        return self.final_norm(h)


def _export(path: Path, dtype: torch.dtype, opset: int) -> None:
    block = PreNormBlock().to(dtype).eval()
    x = torch.randn(2, 5, HIDDEN, dtype=dtype)
    program = torch.onnx.export(block, (x,), dynamo=True, opset_version=opset, verbose=False,
                                dynamic_shapes=({0: "batch", 1: "seq"},))
    program.save(str(path))


EXPORTS = {
    "hf_fp16_opset18.onnx": (torch.float16, 18),
    "hf_fp16_opset23.onnx": (torch.float16, 23),
    "hf_fp32_opset18.onnx": (torch.float32, 18),
}


@pytest.fixture(scope="session")
def exported(tmp_path_factory) -> Path:
    """The torch.onnx exports, made once per run and shared by the xdist workers through a lock."""
    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's base is a folder of the run's own base, which they share
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "third-party-graphs"
    root.mkdir(exist_ok=True)
    with FileLock(str(root / ".lock")):
        for name, (dtype, opset) in EXPORTS.items():
            if not (root / name).exists():
                _export(root / name, dtype, opset)
    return root


@pytest.mark.parametrize("opset, op", [(18, "Pow>ReduceMean>Add>Sqrt>Reciprocal"), (23, "RMSNormalization")])
def test_torch_export_of_hf_norms_keeps_float32(exported, opset, op):
    written = audit_model(onnx.load(str(exported / f"hf_fp16_opset{opset}.onnx")))
    assert len(written) == 3 and {r.op for r in written} == {op}, written
    assert all(r.input_dtype == "float16" and r.accumulation == "float32" and not r.low_precision for r in written)
    assert all(r.epsilon == pytest.approx(1e-6) and r.normalized_dims == 1 for r in written)


def test_onnx_runtime_runs_the_opset18_export_in_float32_and_validate_checks_each_norm(exported):
    path = exported / "hf_fp16_opset18.onnx"
    ran = audit_after_onnxruntime(path, optimization="all")
    assert len(ran) == 3 and not low_precision_reductions(ran)
    report = validate_model(path, inputs="stress", dims={"batch": 2, "seq": 7})
    assert_self_consistent(report)
    assert [r.output for r in report.rows] == [f"norm {n.name}" for n in report.norms] and len(report.rows) == 3


def test_opset23_export_of_gemma_norm_does_not_load_and_says_so(exported, capsys):
    """torch.onnx writes Gemma's float16 norm at opset 23 as RMSNormalization with a float32 scale (1 + w formed
    in float32) on a float16 input; onnx.checker rejects the types and ONNX Runtime cannot load the graph.
    The audit still reads it; validate stops with one line naming ONNX Runtime's complaint."""
    path = exported / "hf_fp16_opset23.onnx"
    final = audit_model(onnx.load(str(path)))[-1]
    assert final.op == "RMSNormalization" and final.input_dtype == "float16"
    with pytest.raises(onnx.shape_inference.InferenceError, match="RMSNormalization.*inconsistent type"):
        onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ONNX Runtime cannot load the model" in err and "Mul" in err


def test_onnx_runtime_float16_converter_produces_float16_reductions(exported, tmp_path, capsys):
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(onnx.load(str(exported / "hf_fp32_opset18.onnx")), keep_io_types=True)
    path = tmp_path / "converted.onnx"
    onnx.save(converted, str(path))
    written = audit_model(converted)
    assert len(written) == 3 and all(r.low_precision and r.accumulation == "float16" for r in written), written
    assert written[0].input_dtype == "float16"  # the float32 graph input is narrowed before the norm
    # the converter rounded epsilon to float16 too (1e-6 is subnormal there)
    assert written[0].epsilon == pytest.approx(1.0132789611816406e-06)
    ran = audit_after_onnxruntime(path, optimization="disable")
    assert not low_precision_reductions(ran), "ONNX Runtime's CPU provider widens float16 ops to float32"
    assert main(["audit", str(path)]) == 1
    assert "3 accumulate in float16" in capsys.readouterr().out
    report = validate_model(path, inputs="stress", dims={"batch": 2, "seq": 7})
    assert_self_consistent(report)  # on the CPU, where the reductions run in float32


@pytest.fixture
def optimized_fp16(exported, tmp_path) -> Path:
    """The transformers optimizer's fusion of the float32 export, converted to float16 (its documented flow)."""
    from onnxruntime.transformers.optimizer import optimize_model

    optimizer = optimize_model(str(exported / "hf_fp32_opset18.onnx"), model_type="bert", num_heads=0,
                               hidden_size=0, opt_level=0)
    optimizer.convert_float_to_float16(keep_io_types=True)
    path = tmp_path / "optimized_fp16.onnx"
    optimizer.save_model_to_file(str(path))
    return path


def test_transformers_optimizer_writes_skip_ops_that_old_cuda_kernels_sum_in_float16(optimized_fp16, capsys):
    model = onnx.load(str(optimized_fp16))
    ops = [r.op for r in audit_model(model)]
    assert ops == ["SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"]
    installed = audit_model(model)
    assert not low_precision_reductions(installed) and "onnxruntime#29034" in installed[1].note
    pinned = audit_model(model, onnxruntime_version="1.26.0")
    assert [r.accumulation for r in pinned] == ["float32", "float16", "float16"]
    assert main(["audit", str(optimized_fp16), "--onnxruntime-version", "1.26", "--optimization", "none"]) == 1
    assert "2 accumulate in float16" in capsys.readouterr().out


def test_placement_through_the_optimizer_fused_skip_ops(optimized_fp16, capsys):
    """The optimizer fuses each residual Add into the next norm (SkipSimplifiedLayerNormalization) and the
    float16 conversion puts Casts around them: the norms are still pre, pre and final."""
    from rmsnorm_deploy.graph.placement import graph_placements

    model = onnx.load(str(optimized_fp16))
    reductions = audit_model(model)
    placed = graph_placements(model, reductions)
    assert [placed[r.node] for r in reductions] == ["pre", "pre", "final"]
    assert main(["audit", str(optimized_fp16), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    after = [r["placement"] for r in data["reductions"] if r["stage"] != "as written"]
    assert after == ["pre", "pre", "final"]  # and in the graph ONNX Runtime runs


def test_validate_checks_the_optimizer_fused_skip_ops(optimized_fp16):
    report = validate_model(optimized_fp16, inputs="stress", dims={"batch": 2, "seq": 7})
    assert_self_consistent(report)
    assert [r.check for r in report.rows] == ["norm", "norm", "norm"]
    assert report.norms[1].ran["onnxruntime[cpu]"].startswith("SkipSimplifiedLayerNormalization")


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None,
                    reason="needs onnxruntime-genai (pip install onnxruntime-genai) for its model builder")
def test_genai_builder_float16_cuda_model(tmp_path, capsys):
    """The builder needs a Hugging Face folder with a tokenizer; both are made here, offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    source = tmp_path / "tiny-llama"
    config = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(source)
    vocab = {f"t{i}": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(source)
    out = tmp_path / "genai"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(out), "-p", "fp16",
         "-e", "cuda", "-c", str(tmp_path / "cache")], capture_output=True, text=True, env=env, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    pinned = audit_model(model, onnxruntime_version="1.26.0")
    assert [r.op for r in pinned].count("SkipSimplifiedLayerNormalization") == 4
    assert len(low_precision_reductions(pinned)) == 4
    assert not low_precision_reductions(audit_model(model, onnxruntime_version="1.27.0"))
    assert main(["audit", str(out / "model.onnx"), "--onnxruntime-version", "1.26", "--optimization", "none"]) == 1


@pytest.mark.cuda
def test_cuda_runs_the_converted_float16_reductions_in_float16(exported, tmp_path):
    """On ONNX Runtime's CUDA provider the converter's float16 Pow/ReduceMean run as written: stress inputs fail."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from rmsnorm_deploy.errors import ProviderError

    path = tmp_path / "converted.onnx"
    onnx.save(convert_float_to_float16(onnx.load(str(exported / "hf_fp32_opset18.onnx")), keep_io_types=True), str(path))
    try:
        ran = audit_after_onnxruntime(path, optimization="disable", providers=["cuda"])
    except ProviderError as exc:
        pytest.skip(f"needs ONNX Runtime's CUDA provider: {exc}")
    assert low_precision_reductions(ran)
    report = validate_model(path, providers=["cuda"], optimization="disable", inputs="stress",
                            dims={"batch": 2, "seq": 7})
    assert not report.passed, report.table()
