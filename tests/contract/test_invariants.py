"""Property tests of the invariants in the seed documents, on the oracle, the reference and ONNX Runtime.

* a positive rescaling of the input leaves the output unchanged (where epsilon is negligible);
* a negative scale flips the sign;
* adding a constant is NOT removed, unlike LayerNorm (RMSNorm keeps the feature mean);
* normalizing over another axis is a different function.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.dtypes import to_numpy, to_torch
from rmsnorm_deploy.contract.reference import oracle, reference

SPECS = [RMSNormSpec.torch_rmsnorm(1e-6), RMSNormSpec.llama(1e-6), RMSNormSpec.gemma(1e-6), RMSNormSpec(1e-6, gain="none")]

rows_hidden = st.tuples(st.integers(1, 6), st.integers(2, 48))
values = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)


def _matrix(shape):
    return arrays(np.float64, shape, elements=values)


def _weight(hidden: int, spec: RMSNormSpec) -> torch.Tensor | None:
    if not spec.has_gain:
        return None
    return torch.linspace(-1.5, 1.5, hidden, dtype=torch.float64) + (1.0 if spec.gain == "weight" else 0.0)


@st.composite
def case(draw):
    shape = draw(rows_hidden)
    x = draw(_matrix(shape))
    spec = draw(st.sampled_from(SPECS))
    return spec, x


def _mean_square(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) ** 2).mean(axis=-1, keepdims=True)


@given(case(), st.floats(1e-3, 1e3))
def test_positive_scaling_leaves_oracle_unchanged(sc, c):
    spec, x = sc
    ms = _mean_square(x)
    assume(np.all(ms * min(c, 1.0) ** 2 > 1e-2))
    w = _weight(x.shape[-1], spec)
    y1 = to_numpy(oracle(spec, torch.from_numpy(x), w))
    y2 = to_numpy(oracle(spec, torch.from_numpy(x * c), w))
    # exactly: y(cx) = x / sqrt(ms + eps / c^2); the gap to y(x) is at most |eps/c^2 - eps| / (2 ms) relative
    eps = spec.epsilon_float32
    bound = np.abs(eps / c**2 - eps) / (2 * ms) * np.abs(y1) + 1e-12 * (1 + np.abs(y1))
    assert np.all(np.abs(y2 - y1) <= bound)


@given(case(), st.integers(-6, 6), st.sampled_from(["float32", "float16", "bfloat16"]))
def test_power_of_two_scaling_is_bit_exact_in_the_reference(sc, k, dtype):
    spec, x = sc
    tx = to_torch(x).to(getattr(torch, dtype))
    scaled = tx * 2.0**k
    # stay clear of overflow and underflow in the dtype, and of epsilon in float32
    assume(torch.isfinite(scaled).all() and torch.equal(scaled / 2.0**k, tx))
    ms = tx.float().pow(2).mean(-1)
    assume(bool((ms * min(4.0**k, 1.0) > 1e-6 * 2**26).all()))
    w = _weight(x.shape[-1], spec)
    w = None if w is None else w.to(tx.dtype)
    assert torch.equal(reference(spec, scaled, w), reference(spec, tx, w))


@given(case())
def test_negative_scale_flips_the_sign(sc):
    spec, x = sc
    w = _weight(x.shape[-1], spec)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        tx = torch.from_numpy(x).to(dtype)
        assert torch.equal(reference(spec, -tx, None if w is None else w.to(dtype)),
                           -reference(spec, tx, None if w is None else w.to(dtype)))
    assert torch.equal(oracle(spec, -torch.from_numpy(x), w), -oracle(spec, torch.from_numpy(x), w))


@given(case(), st.floats(0.5, 50.0), st.sampled_from([-1.0, 1.0]))
def test_adding_a_constant_is_not_removed_unlike_layernorm(sc, magnitude, sign):
    spec, x = sc
    rms = np.sqrt(_mean_square(x))
    assume(np.all(rms > 1e-2) and np.all(x.std(axis=-1) > 1e-3 * rms[:, 0]))  # not a constant row
    k = sign * magnitude * rms
    spec = RMSNormSpec(spec.epsilon, gain="none")
    tx, tk = torch.from_numpy(x), torch.from_numpy(x + k)
    ln = torch.nn.functional.layer_norm
    # LayerNorm removes the shift (up to rounding) ...
    torch.testing.assert_close(ln(tk, tk.shape[-1:]), ln(tx, tx.shape[-1:]), rtol=1e-6, atol=1e-6)
    # ... RMSNorm does not: every row changes by far more than rounding.
    diff = (oracle(spec, tk) - oracle(spec, tx)).abs().amax(dim=-1)
    assert bool((diff > 1e-6).all())


@given(arrays(np.float64, st.tuples(st.integers(2, 6), st.integers(2, 6)), elements=st.floats(0.1, 10.0)))
def test_normalizing_another_axis_is_another_function(x):
    x = x * np.arange(1, x.shape[1] + 1)  # make columns differ in scale so the axes are distinguishable
    row_ms = (x**2).mean(axis=1)
    assume(row_ms.max() > 1.001 * row_ms.min())  # rows of one rms make joint and per-row norms agree
    spec = RMSNormSpec(1e-6, gain="none")
    over_hidden = oracle(spec, torch.from_numpy(x))
    over_rows = oracle(spec, torch.from_numpy(x.T.copy())).T
    jointly = oracle(RMSNormSpec(1e-6, normalized_dims=2, gain="none"), torch.from_numpy(x))
    assert not torch.allclose(over_hidden, over_rows, rtol=1e-6)
    assert not torch.allclose(over_hidden, jointly, rtol=1e-6)


# -- the same invariants on the shipped artifact: the function lowering in ONNX Runtime -----------
ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime (pip install 'rmsnorm-deploy[onnxruntime]')")


@pytest.fixture(scope="module")
def ort_norm():
    from rmsnorm_deploy.graph.standalone import rmsnorm_model
    from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner

    spec = RMSNormSpec.llama(1e-6)
    runner = OnnxRuntimeRunner(rmsnorm_model(spec, dtype="float16", shape=(4, 32)), ["cpu"])
    with runner:
        yield lambda x, w: runner.infer({"x": x, "weight": w})["y"]


@given(arrays(np.float16, st.tuples(st.integers(1, 5), st.just(32)), elements=st.floats(-100, 100, width=16)),
       st.integers(-4, 4))
def test_onnxruntime_keeps_scale_and_sign_invariance(ort_norm, x, k):
    ms = (x.astype(np.float32) ** 2).mean(axis=-1)
    assume(np.all(ms * min(4.0**k, 1.0) > 1e-6 * 2**26))
    scaled = (x * np.float16(2.0**k)).astype(np.float16)
    assume(np.all(np.isfinite(scaled)) and np.array_equal(scaled.astype(np.float32) / 2.0**k, x.astype(np.float32)))
    w = np.linspace(-1.5, 1.5, 32).astype(np.float16)
    base = ort_norm(x, w)
    np.testing.assert_array_equal(ort_norm(scaled, w), base)
    np.testing.assert_array_equal(ort_norm(-x, w), -base)
