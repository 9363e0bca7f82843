"""validate on a gated standalone model: the source rebuilt with its gate input, the norm checked
against the float64 oracle fed the gate tensor."""

from __future__ import annotations

import pytest
from tests.cases import DTYPES

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.graph.onnx_file import save_onnx
from rmsnorm_deploy.graph.standalone import rmsnorm_model
from rmsnorm_deploy.validate.run import validate_model

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'rmsnorm-deploy[onnxruntime]'")


@pytest.mark.parametrize("reference", ["torch", "float64"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", [RMSNormSpec.mamba2_gated(1e-5, group_size=38), RMSNormSpec.qwen3_next_gated(1e-6)],
                         ids=["mamba2", "qwen3_next"])
def test_gated_standalone_model_passes_against_source_and_oracle(tmp_path, spec, dtype, reference):
    path = save_onnx(rmsnorm_model(spec, dtype=dtype, shape=(199, 760)), tmp_path / "m.onnx")
    report = validate_model(path, reference=reference)
    assert report.passed, report.table()
    assert report.inputs["z"]["kind"].startswith("activations")
    checks = [(r.output if r.output == "y" else "norm", r.check, r.status) for r in report.rows]
    if reference == "torch":
        assert checks == [("y", "norm_vs_torch", "pass"), ("norm", "norm", "pass")]
    else:
        assert checks == [("y", "norm", "pass")]
    (norm,) = report.norms
    assert norm.precision == "float32" and "gated" in norm.spec
