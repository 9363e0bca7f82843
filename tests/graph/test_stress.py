"""Stress values and special values, in every lowering, in ONNX Runtime CPU.

float16 activations of magnitude 300 to 60000 have squares of 9e4 to 3.6e9: a float16
reduction overflows to inf and the norm collapses to zeros. Every lowering must keep the
reduction in float32 and match the oracle; all-zero rows give zeros; NaN and Inf propagate
exactly as in the torch modules (our reference is bit-equal to them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.cases import DTYPES

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import to_numpy, to_torch
from rmsnorm_deploy.contract.inputs import activations, gain_weights
from rmsnorm_deploy.contract.reference import oracle, reference
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import LoweringError
from rmsnorm_deploy.graph.lowerings import LOWERINGS
from rmsnorm_deploy.graph.standalone import rmsnorm_model

pytest.importorskip("onnxruntime", reason="needs onnxruntime (pip install 'rmsnorm-deploy[onnxruntime]')")
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402

SPECS = named_specs()
SHAPE = (199, 760)


def _run(spec, dtype, lowering, x, w):
    try:
        model = rmsnorm_model(spec, dtype=dtype, shape=x.shape, lowering=lowering)
    except LoweringError as exc:
        pytest.skip(f"{lowering} cannot represent this spec: {exc}")
    feed = {"x": x} if w is None else {"x": x, "weight": w}
    try:
        with OnnxRuntimeRunner(model, ["cpu"]) as runner:
            return runner.infer(feed)["y"]
    except Exception as exc:  # the CPU gaps are asserted in test_parity_ort.py
        if "Could not find an implementation" in str(exc):
            pytest.skip(f"ONNX Runtime CPU has no kernel for {lowering} in {dtype} (see test_parity_ort.py)")
        raise


def test_stress_inputs_really_overflow_a_half_precision_reduction():
    x = to_torch(activations(SHAPE, "float16", kind="stress"))
    assert torch.isinf(x.pow(2).mean(-1)).any()  # float16 arithmetic
    assert torch.isfinite(x.float().pow(2).mean(-1)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_name", ["torch", "llama", "gemma", "nogain"])
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_stress_inputs_stay_finite_and_exact(lowering, spec_name, dtype):
    spec = SPECS[spec_name]
    x = activations(SHAPE, dtype, seed=3, kind="stress")
    w = gain_weights(SHAPE[-1:], dtype, spec.gain, seed=4)
    y = _run(spec, dtype, lowering, x, w).astype(np.float64)
    zero_row = np.all(x.astype(np.float64) == 0, axis=-1)
    assert zero_row.any()
    assert np.all(np.isfinite(y))
    assert np.all(y[zero_row] == 0), "an all-zero row must give zeros"
    x_t, w_t = to_torch(x), (to_torch(w) if w is not None else None)
    result = compare(y, oracle(spec, x_t, w_t), tolerance_for("norm", "onnxruntime", dtype), dtype=dtype)
    assert result, result.summary()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_nan_and_inf_propagate_as_in_torch(lowering, dtype):
    spec = SPECS["gemma"] if lowering == "ort" else SPECS["llama"]
    x = activations((6, 7), dtype, seed=5)
    x[0, 3] = np.nan
    x[1, 2] = np.inf
    x[2, 0] = -np.inf
    x[3, :] = 0
    w = gain_weights((7,), dtype, spec.gain, seed=6)
    y = _run(spec, dtype, lowering, x, w)
    expected = to_numpy(reference(spec, to_torch(x), to_torch(w)))
    y64, e64 = y.astype(np.float64), expected.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(y64), np.isnan(e64))
    np.testing.assert_array_equal(np.isinf(y64), np.isinf(e64))
    assert np.all(np.isnan(y64[0])), "a NaN poisons its row"
    assert np.isnan(y64[1, 2]) and np.all(y64[1, np.arange(7) != 2] == 0), "inf / inf is NaN, the rest of the row is 0"
    assert np.all(y64[3] == 0)
    finite = np.isfinite(e64)
    result = compare(y64[finite], e64[finite], tolerance_for("norm_vs_torch", "onnxruntime", dtype), dtype=dtype)
    assert result, result.summary()
