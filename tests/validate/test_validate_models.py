"""validate on whole models with a PyTorch source: a small model of a registered source kind here,
and the tiny preset exported by the export pipeline (those tests skip until it is installed)."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.contract.dtypes import numpy_dtype, onnx_type, torch_dtype
from rmsnorm_deploy.contract.reference import SpecRMSNorm
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.exporter.rebuild import source_builder
from rmsnorm_deploy.graph.function import DOMAIN, DOMAIN_VERSION, rmsnorm_node
from rmsnorm_deploy.graph.lowerings import lower_model
from rmsnorm_deploy.graph.metadata import ModelMetadata, tool_versions
from rmsnorm_deploy.graph.onnx_file import save_onnx
from rmsnorm_deploy.graph.standalone import ir_version_for
from rmsnorm_deploy.validate.run import validate_model

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'rmsnorm-deploy[onnxruntime]'")

KIND = "test-linear-norm"
HIDDEN = 48


class LinearNorm(torch.nn.Module):
    """``y = RMSNorm(x) @ W``: the smallest model whose output is more than one norm."""

    def __init__(self, meta: ModelMetadata):
        super().__init__()
        (self.spec,) = meta.specs.values()
        weights = _weights(meta.source["seed"])
        self.proj = torch.nn.Parameter(torch.from_numpy(weights["proj"]).to(torch_dtype(meta.dtype)))
        self.norm = SpecRMSNorm(self.spec, HIDDEN, meta.dtype)
        with torch.no_grad():
            self.norm.weight.copy_(torch.from_numpy(weights["gain"]))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.norm(x) @ self.proj}


@source_builder(KIND)
def _rebuild(meta: ModelMetadata) -> torch.nn.Module:
    return LinearNorm(meta)


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"proj": rng.normal(0, HIDDEN**-0.5, (HIDDEN, HIDDEN)).astype(np.float32),
            "gain": rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)}


def linear_norm_model(dtype: str, *, seed: int = 0, spec: RMSNormSpec | None = None) -> onnx.ModelProto:
    spec = spec or RMSNormSpec.llama(1e-5)
    weights = _weights(seed)
    inits = [numpy_helper.from_array(weights["proj"].astype(numpy_dtype(dtype)), "proj"),
             numpy_helper.from_array(weights["gain"].astype(numpy_dtype(dtype)), "gain")]
    nodes = [rmsnorm_node(spec, dtype, ["x", "gain"], ["h"], name="norm"), helper.make_node("MatMul", ["h", "proj"], ["y"])]
    dims = ["batch", "seq", HIDDEN]
    graph = helper.make_graph(nodes, "linear_norm", [helper.make_tensor_value_info("x", onnx_type(dtype), dims)],
                              [helper.make_tensor_value_info("y", onnx_type(dtype), dims)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])
    model.ir_version = ir_version_for(model.opset_import)
    model = lower_model(model, "function")
    ModelMetadata(specs={"norm": spec}, lowering="function", dtype=dtype, source={"kind": KIND, "seed": seed},
                  inputs={"x": {"dtype": dtype, "shape": dims, "kind": "activations"}},
                  dims={"batch": [1, 2, 4], "seq": [1, 7, 32]}, versions=tool_versions()).write(model)
    return model


@pytest.mark.parametrize("inputs", ["normal", "stress"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_model_matches_its_source(tmp_path, dtype, inputs):
    path = save_onnx(linear_norm_model(dtype), tmp_path / "model.onnx")
    report = validate_model(path, inputs=inputs)
    assert report.passed, report.table()
    assert [(r.output, r.check) for r in report.rows] == [("y", "model_vs_float64"), ("norm norm", "norm")]
    assert report.inputs["x"]["shape"] == [2, 7, HIDDEN]  # the metadata's optimal sizes
    assert report.source.startswith(f"{KIND} (rmsnorm_deploy metadata")


def test_model_that_departs_from_its_source_fails(tmp_path, capsys):
    """Weights of another seed in the graph: the model check fails, the norm on its own still passes."""
    model = linear_norm_model("float32", seed=1)
    meta = ModelMetadata.read(model)
    meta.source = {"kind": KIND, "seed": 2}
    meta.write(model)
    path = save_onnx(model, tmp_path / "model.onnx")
    report = validate_model(path)
    statuses = {r.output: r.status for r in report.rows}
    assert statuses == {"y": "FAIL", "norm norm": "pass"}, report.table()
    assert main(["validate", str(path)]) == 1


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_model_against_its_float64_source(tmp_path, dtype):
    report = validate_model(save_onnx(linear_norm_model(dtype), tmp_path / "model.onnx"), reference="float64")
    assert report.passed, report.table()
    assert report.rows[0].check == "model_vs_float64"


# -- the tiny preset, exported by the export pipeline -------------------------------------
needs_presets = pytest.mark.skipif(
    importlib.util.find_spec("rmsnorm_deploy.exporter.presets") is None,
    reason="needs the 'preset' source kind (rmsnorm_deploy.exporter.presets, from the export pipeline): merge the export branch",
)


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory):
    """The tiny preset exported once per dtype with the default (function) lowering."""
    folder = tmp_path_factory.mktemp("tiny")
    paths = {}
    for dtype in ("float32", "float16"):
        path = folder / f"tiny-{dtype}.onnx"
        assert main(["export", "tiny", "-o", str(path), "--dtype", dtype, "--force"]) == 0
        paths[dtype] = path
    return paths


@needs_presets
@pytest.mark.parametrize("inputs", ["normal", "stress"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tiny_preset_export_validates_against_its_source(tiny_preset, dtype, inputs, capsys):
    report = validate_model(tiny_preset[dtype], inputs=inputs)
    assert report.passed, report.table()
    assert report.source.startswith("preset")
    assert any(r.check == "model_vs_float64" for r in report.rows) and any(r.check == "norm" for r in report.rows)
    assert all(n.precision == "float32" for n in report.norms)
    assert main(["audit", str(tiny_preset[dtype])]) == 0


@needs_presets
def test_tiny_preset_export_against_float64(tiny_preset):
    report = validate_model(tiny_preset["float16"], reference="float64")
    assert report.passed, report.table()
