"""The export pipeline on the tiny preset: every lowering once, every dtype once, and its guarantees.

Each lowering case exports once (torch.onnx.export takes seconds) and checks everything about
its file in one test: the graph, the norm nodes, the metadata, the report, the parity, runs at
shapes other than the traced one, and the rebuilt source.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import onnx
import pytest
import torch

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import to_torch, torch_dtype
from rmsnorm_deploy.contract.inputs import token_ids
from rmsnorm_deploy.contract.reference import oracle
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import LoweringError, OutputExistsError, UserError
from rmsnorm_deploy.exporter import pipeline as export_mod
from rmsnorm_deploy.exporter.parity import check_parity
from rmsnorm_deploy.exporter.pipeline import export_model
from rmsnorm_deploy.exporter.plan import (
    ExportOptions,
    check_options,
    load_torch_model,
    output_path,
)
from rmsnorm_deploy.exporter.rebuild import rebuild_source
from rmsnorm_deploy.exporter.surgery import swapped_modules
from rmsnorm_deploy.exporter.upcast import float64_outputs
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.function import is_rmsnorm_node, rmsnorm_node
from rmsnorm_deploy.graph.metadata import ModelMetadata

pytest.importorskip("onnxruntime", reason="the export-time parity check runs ONNX Runtime CPU")
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402

TINY_NORMS = [f"model.layers.{i}.{n}" for i in range(2) for n in ("attention_norm", "ffn_norm")] + ["model.norm"]
#: lowering -> (dtype, opset, weights forced to external data): each lowering once, each dtype once
CASES = {
    "function": ("float32", None, False),
    "native": ("float16", 23, False),
    "ort": ("float32", 19, False),
    "inline": ("float32", 20, True),
    "plugin": ("bfloat16", 21, False),
}
#: what each lowering leaves in the graph for a norm
NORM_OPS = {"function": "RMSNorm", "plugin": "RMSNorm", "native": "RMSNormalization",
            "ort": "SimplifiedLayerNormalization", "inline": "ReduceMean"}


@pytest.mark.parametrize("lowering", list(CASES))
def test_tiny_export(lowering, tmp_path, monkeypatch):
    dtype, opset, external = CASES[lowering]
    if external:  # exercise the >2 GB path (weights streamed to model.onnx.data) on a small model
        monkeypatch.setattr(export_mod, "EXTERNAL_DATA_THRESHOLD", 1024)
    loaded = load_torch_model("tiny", dtype)
    path = tmp_path / "out" / "model.onnx"
    result = export_model(loaded, path, ExportOptions(dtype=dtype, lowering=lowering, opset=opset, batch=2, seq=7))
    expected_opset = opset or (23 if lowering == "native" else 18)

    # -- files: the model, its data (only when external), the report; no temporary left over
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == sorted(["model.onnx", "report.json"] + (["model.onnx.data"] if external else []))
    model = onnx.load(str(path))
    if external:
        assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in onnx.load(str(path), load_external_data=False).graph.initializer)
    if lowering != "ort":
        onnx.checker.check_model(str(path), full_check=True)
    assert next(i.version for i in model.opset_import if i.domain == "") == expected_opset

    # -- norms: one per module, in the lowering's form, every reduction in float32
    graph_ops = [n.op_type for n in model.graph.node]
    assert graph_ops.count(NORM_OPS[lowering]) == len(TINY_NORMS)
    reductions = [r for r in audit_model(model) if r.kind == "RMSNorm"]
    assert len(reductions) == len(TINY_NORMS) and {r.accumulation for r in reductions} == {"float32"}
    if lowering in ("function", "plugin"):
        nodes = [n for n in model.graph.node if is_rmsnorm_node(n)]
        assert [n.name for n in nodes] == TINY_NORMS
        spec = loaded.module.model.args.norm
        for node in nodes:  # exactly the node rmsnorm_node writes (plus the plugin fields)
            want = rmsnorm_node(spec, dtype, list(node.input), list(node.output), name=node.name,
                                plugin=lowering == "plugin")
            assert node == want
        assert len(model.functions) == 1 and model.functions[0].overload == nodes[0].overload

    # -- metadata: what validate and TensorRT read
    meta = ModelMetadata.read(model)
    assert set(meta.specs) == set(TINY_NORMS) and meta.lowering == lowering and meta.dtype == dtype
    assert meta.source["kind"] == "preset" and meta.source["name"] == "tiny" and "[norm]" in meta.source["toml"]
    assert meta.inputs == {"input_ids": {"dtype": "int64", "shape": ["batch", "seq"], "kind": "token_ids", "high": 512}}
    assert meta.dims == {"batch": [1, 2, 8], "seq": [1, 7, 256]}
    assert {"torch", "onnx", "onnxscript", "rmsnorm-deploy"} <= set(meta.versions)
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq"]

    # -- the report and the export-time parity
    report = json.loads((path.parent / "report.json").read_text())
    assert [n["path"] for n in report["norms"]] == TINY_NORMS and report["lowering"] == lowering
    placements = {n: "final" if n == "model.norm" else "pre" for n in TINY_NORMS}
    assert report["placements"] == placements and [n["placement"] for n in report["norms"]] == list(placements.values())
    assert {k: v["placement"] for k, v in meta.placements.items()} == placements
    parity = result.parity
    assert report["parity"]["status"] == parity.status
    if dtype == "bfloat16":  # ONNX Runtime CPU has no bfloat16 MatMul: not run, and saying why
        assert parity.status == "not run" and "MatMul" in parity.reason and not result.parity_failed
        return
    assert parity.status == "pass", parity.table()
    assert parity.inputs == {"input_ids": [[2, 7], [3, 12]]}
    assert parity.ort_accumulation == "float32"

    # -- shapes other than the traced one, compared here independently of the parity code
    module = rebuild_source(meta)  # also: the rebuilt source computes what was exported
    tol = tolerance_for("model", "onnxruntime", dtype)
    with OnnxRuntimeRunner(path, ["cpu"]) as runner:
        for shape in [(1, 1), (4, 33)]:
            ids = token_ids(shape, 512, seed=sum(shape))
            got = runner.infer({"input_ids": ids})["logits"]
            with torch.no_grad():
                want = loaded.module(input_ids=torch.from_numpy(ids))["logits"]
                again = module(input_ids=torch.from_numpy(ids))["logits"]
            assert torch.equal(want, again)
            result_cmp = compare(got, want, tol, dtype=dtype)
            assert result_cmp, result_cmp.summary()


def test_parity_check_fails_on_a_graph_that_computes_something_else(tmp_path):
    loaded = load_torch_model("tiny", "float32")
    path = tmp_path / "model.onnx"
    result = export_model(loaded, path, ExportOptions(parity=False))
    assert result.parity is None and not (tmp_path / "report.json").exists()
    model = onnx.load(str(path))
    weight = next(t for t in model.graph.initializer if t.name.endswith("layers.1.ffn_norm.weight"))
    values = onnx.numpy_helper.to_array(weight).copy()
    values[3] += 0.5  # one gain off by 0.5: a wrong checkpoint, or a wrong norm
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    onnx.save(model, str(path))
    feed = {"input_ids": torch.from_numpy(token_ids((2, 5), 512))}
    parity = check_parity(path, loaded.module, result.detection.norms, [feed], dtype="float32")
    assert parity.failed and "onnxruntime[cpu] vs float64: logits" in parity.reason
    assert "FAIL" in parity.table()


@pytest.mark.parametrize("variant", ["tiny", "tied+offset"])
def test_float64_view_equals_a_float64_copy_with_oracle_norms(variant):
    loaded = load_torch_model("tiny", "float16")
    module = loaded.module
    if variant == "tied+offset":
        from rmsnorm_deploy.contract.spec import RMSNormSpec
        from rmsnorm_deploy.exporter.blocks import build_model
        from rmsnorm_deploy.exporter.loaded_model import TokenLogits

        args = dataclasses.replace(module.model.args, tie_embeddings=True, norm=RMSNormSpec.gemma(1e-6), qk_norm=True)
        module = TokenLogits(build_model(args, "float16"))
    from rmsnorm_deploy.exporter.detect import detect_norms
    from rmsnorm_deploy.exporter.upcast import OracleRMSNorm

    norms = detect_norms(module).norms
    ids = torch.from_numpy(token_ids((2, 9), 512, seed=4))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    got = float64_outputs(module, norms, input_ids=ids)["logits"]
    copy64 = copy.deepcopy(module).double()
    with swapped_modules(copy64, {n.path: OracleRMSNorm(n.spec, copy64.get_submodule(n.path).weight) for n in norms}):
        with torch.no_grad():
            want = copy64(input_ids=ids)["logits"]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == before[k].dtype for k in before)
    assert "forward" not in vars(module.model.output)  # patches removed


class _ScaledEmbedding(torch.nn.Embedding):
    """Gemma's embedding: the table's rows times sqrt(hidden), a buffer in the model's dtype."""

    def __init__(self, table: torch.nn.Embedding):
        super().__init__(table.num_embeddings, table.embedding_dim, dtype=table.weight.dtype)
        self.weight.data.copy_(table.weight.data)
        self.register_buffer("scale", torch.tensor(table.embedding_dim ** 0.5, dtype=table.weight.dtype),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale.to(self.weight.dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_float64_view_widens_the_rows_an_embedding_subclass_gathers_not_its_table(dtype):
    """A subclass of nn.Embedding computes in float64 exactly as a float64 copy does, while its
    weight stays the model's own tensor (a 262144-row table is 1.3 GB in float64)."""
    from rmsnorm_deploy.exporter.detect import detect_norms
    from rmsnorm_deploy.exporter.upcast import OracleRMSNorm, WidenedOnGather

    module = load_torch_model("tiny", dtype).module
    table = _ScaledEmbedding(module.model.tok_embeddings)
    module.model.tok_embeddings = table
    held = []
    hook = table.register_forward_hook(lambda m, args, out: held.append((m.weight, out.dtype)))
    norms = detect_norms(module).norms
    ids = torch.from_numpy(token_ids((2, 9), 512, seed=4))
    got = float64_outputs(module, norms, input_ids=ids)["logits"]
    hook.remove()
    [(weight, out_dtype)] = held
    assert isinstance(weight, WidenedOnGather) and weight.dtype == torch.float64 and out_dtype == torch.float64
    assert weight.narrow.data_ptr() == table.weight.data_ptr()  # no widened copy of the table
    assert type(table.weight) is torch.nn.Parameter and table.weight.dtype == torch_dtype(dtype)  # restored
    copy64 = copy.deepcopy(module).double()
    with swapped_modules(copy64, {n.path: OracleRMSNorm(n.spec, copy64.get_submodule(n.path).weight) for n in norms}):
        with torch.no_grad():
            want = copy64(input_ids=ids)["logits"]
    assert torch.equal(got, want)


def test_oracle_norms_in_the_float64_view_are_the_spec_oracle():
    loaded = load_torch_model("tiny", "float32")
    from rmsnorm_deploy.exporter.detect import detect_norms
    from rmsnorm_deploy.exporter.upcast import float64_view

    norms = detect_norms(loaded.module).norms
    x = torch.randn(3, 64, dtype=torch.float64)
    with float64_view(loaded.module, norms) as m:
        got = m.get_submodule("model.norm")(x)
    torch.testing.assert_close(got, oracle(norms[-1].spec, x, norms[-1].weight), rtol=0, atol=0)


def test_swapped_modules_restores_after_an_error():
    loaded = load_torch_model("tiny", "float32")
    original = loaded.module.get_submodule("model.norm")
    with pytest.raises(RuntimeError, match="boom"):
        with swapped_modules(loaded.module, {"model.norm": torch.nn.Identity()}):
            assert isinstance(loaded.module.get_submodule("model.norm"), torch.nn.Identity)
            raise RuntimeError("boom")
    assert loaded.module.get_submodule("model.norm") is original


def test_refused_lowering_stops_before_anything_is_written(tmp_path):
    loaded = load_torch_model("tiny", "float16")
    path = tmp_path / "out" / "model.onnx"
    with pytest.raises(LoweringError, match=r"cannot lower norm 'layers.0.attention_norm' .* to 'ort': "
                                            "SimplifiedLayerNormalization applies the gain in float32"):
        export_model(loaded, path, ExportOptions(dtype="float16", lowering="ort"))
    with pytest.raises(LoweringError, match="RMSNormalization exists from opset 23; this model is opset 18"):
        export_model(loaded, path, ExportOptions(dtype="float16", lowering="native", opset=18))
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_clobbered(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"precious")
    loaded = load_torch_model("tiny", "float32")
    with pytest.raises(OutputExistsError, match="exists; pass --force"):
        export_model(loaded, path, ExportOptions())
    assert path.read_bytes() == b"precious"


@pytest.mark.parametrize("options, message", [
    (ExportOptions(dtype="float64"), "dtype 'float64' is not exportable"),
    (ExportOptions(lowering="fused"), "unknown lowering 'fused'"),
    (ExportOptions(opset=17), "opset 17 is not supported; choose an ONNX opset from 18 to 23"),
    (ExportOptions(batch=0), "--batch must be an integer >= 1"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(UserError, match=message):
        check_options(options)


def test_sequence_longer_than_the_model_is_refused(tmp_path):
    with pytest.raises(UserError, match="--seq 300 is longer than the model's 256 positions"):
        export_model(load_torch_model("tiny", "float32"), tmp_path / "m.onnx", ExportOptions(seq=300))
    assert not any(tmp_path.iterdir())


def test_output_path_forms(tmp_path):
    assert str(output_path(None, "tiny", "float16", "native")) == "export/tiny/float16-native/model.onnx"
    assert output_path(str(tmp_path / "x.onnx"), "tiny", "float32", "function") == tmp_path / "x.onnx"
    assert output_path(str(tmp_path / "dir"), "tiny", "float32", "function") == tmp_path / "dir" / "model.onnx"
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="exists and is not a folder"):
        output_path(str(tmp_path / "file"), "tiny", "float32", "function")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_export_norm_op_computes_the_reference(dtype):
    from rmsnorm_deploy.contract.reference import reference
    from rmsnorm_deploy.contract.spec import named_specs
    from rmsnorm_deploy.exporter.torch_op import ExportRMSNorm

    for spec in named_specs().values():
        w = torch.randn(7).to(torch_dtype(dtype)) if spec.has_gain else None
        x = torch.randn(3, 7).to(torch_dtype(dtype))
        assert torch.equal(ExportRMSNorm(spec, w, "n")(x), reference(spec, x, w))


def test_token_ids_are_seeded_and_in_range():
    a, b = token_ids((3, 40), 17, seed=2), token_ids((3, 40), 17, seed=2)
    assert a.dtype == np.int64 and np.array_equal(a, b) and a.min() >= 0 and a.max() < 17
    assert not np.array_equal(a, token_ids((3, 40), 17, seed=3))
    assert to_torch(a).dtype == torch.int64


def _tiny_with_audio_norm():
    """The tiny preset with a weightless norm-like module its forward never calls (an audio branch)."""
    from tests.exporter.test_probing import MeanVarianceNormLayer

    loaded = load_torch_model("tiny", "float32")
    loaded.module.model.audio_norm = MeanVarianceNormLayer()
    return loaded


def test_a_norm_the_forward_never_calls_is_reported_not_exported_and_the_graph_audit_passes(tmp_path):
    path = tmp_path / "model.onnx"
    result = export_model(_tiny_with_audio_norm(), path, ExportOptions(batch=2, seq=7))
    assert not result.parity_failed
    assert [n.path for n in result.detection.norms] == TINY_NORMS
    left = {"path": "model.audio_norm", "name": "audio_norm",
            "class": "tests.exporter.test_probing.MeanVarianceNormLayer",
            "reason": "has no weight and no normalized_shape, and the model's forward does not call it on the "
                      "example input, so it is not on the exported path"}
    assert result.report["not_exported_norms"] == [left]
    assert json.loads((tmp_path / "report.json").read_text())["not_exported_norms"] == [left]
    assert len(result.report["norms"]) == len(TINY_NORMS) and "model.audio_norm" not in result.report["placements"]
    model = onnx.load(str(path))
    assert sum(1 for n in model.graph.node if is_rmsnorm_node(n)) == len(TINY_NORMS)
    assert len([r for r in audit_model(model) if r.kind == "RMSNorm"]) == len(TINY_NORMS)


def test_a_norm_with_a_weight_the_traced_forward_never_calls_is_reported_not_exported(tmp_path):
    """A multimodal projector's norm on text input: detected (it has a weight), never called by the
    run the export traces, so not in the graph; listed instead of refusing the export."""
    import copy

    loaded = load_torch_model("tiny", "float32")
    loaded.module.model.projector_norm = copy.deepcopy(loaded.module.model.norm)
    path = tmp_path / "model.onnx"
    result = export_model(loaded, path, ExportOptions(batch=2, seq=7))
    assert not result.parity_failed
    assert [n.path for n in result.detection.norms] == TINY_NORMS
    assert [(n["path"], n["reason"]) for n in result.report["not_exported_norms"]] == [
        ("model.projector_norm", "is not called by the forward the export traces, on its input, so it is not on the "
                                 "exported path")]
    assert "model.projector_norm" not in result.report["placements"]
    model = onnx.load(str(path))
    assert sum(1 for n in model.graph.node if is_rmsnorm_node(n)) == len(TINY_NORMS)
    assert len([r for r in audit_model(model) if r.kind == "RMSNorm"]) == len(TINY_NORMS)


def test_a_not_exported_norm_that_the_traced_forward_calls_stops_the_export(tmp_path, monkeypatch):
    loaded = _tiny_with_audio_norm()
    inner = loaded.module.model
    detected = []

    def detect_then_mark(*args, **kwargs):  # the forward changes after detection (as a KV-cache trace may)
        detected.append(export_mod.detect_norms.__wrapped__(*args, **kwargs))
        return detected[-1]

    detect_then_mark.__wrapped__ = export_mod.detect_norms
    monkeypatch.setattr(export_mod, "detect_norms", detect_then_mark)

    def audio_branch(*_):
        if detected:
            inner.audio_norm(torch.zeros(1, 8))

    inner.register_forward_pre_hook(audio_branch)
    with pytest.raises(UserError, match=r"^module 'audio_norm' \(.*MeanVarianceNormLayer\) is called by the forward "
                                        r"the export traces but not by the example run"):
        export_model(loaded, tmp_path / "model.onnx", ExportOptions(batch=2, seq=7))
    assert detected and not any(tmp_path.iterdir())


def test_the_weights_are_held_once_while_the_model_is_saved_and_released_before_the_check(tmp_path, monkeypatch):
    """The saved graph carries no copy of the weights (they are streamed from the exporter's tensors
    into the file), and the module's weights are freed before onnx.checker reads the file back:
    a real checkpoint would otherwise hold them three or four times over."""
    loaded = load_torch_model("tiny", "float32")
    weight_bytes = loaded.weight_bytes()
    saved, checked = [], []
    save_onnx, checker = export_mod.save_onnx, export_mod._checker

    def spy_save(model, path, **kwargs):
        held = sum(len(t.raw_data) for t in model.graph.initializer)
        saved.append((held, sum(t.nbytes for t in kwargs["weights"])))
        return save_onnx(model, path, **kwargs)

    def spy_checker(path, options, **kwargs):
        checked.append((loaded.module, path.stat().st_size))
        return checker(path, options, **kwargs)

    monkeypatch.setattr(export_mod, "save_onnx", spy_save)
    monkeypatch.setattr(export_mod, "_checker", spy_checker)
    path = tmp_path / "model.onnx"
    result = export_model(loaded, path, ExportOptions(batch=1, seq=4, release_model=True))
    assert result.parity.status == "pass", result.parity.table()
    [(held, streamed)] = saved
    assert held < 4096 and streamed > 0.9 * weight_bytes  # the graph's own weights are the 1 KB-or-less ones
    [(module, size)] = checked
    assert module is None and size > weight_bytes  # released once the file holds the weights


def test_the_float64_view_keeps_an_eager_attention_softmax_in_float64():
    """Eager attention's ``softmax(scores, dtype=float32)`` on a row that sees only padding: float64's
    mask value is -inf in float32, so the row is NaN; inside the view it stays float64 and finite."""
    import torch.nn.functional as F

    from rmsnorm_deploy.exporter.upcast import softmax_never_narrows

    low = torch.finfo(torch.float64).min
    scores = torch.tensor([[0.5, low], [low, low]], dtype=torch.float64)
    assert torch.isnan(F.softmax(scores, dim=-1, dtype=torch.float32)).any()
    with softmax_never_narrows():
        got = F.softmax(scores, dim=-1, dtype=torch.float32)
        narrow = F.softmax(scores.float(), dim=-1, dtype=torch.float16)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    assert narrow.dtype == torch.float16  # only float64 inputs keep their dtype
    assert F.softmax(scores, dim=-1, dtype=torch.float32).dtype == torch.float32  # restored
