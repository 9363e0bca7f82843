"""The comparison result: ULPs, NaN/Inf mismatches, first bad indices, and the tolerance table."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from rmsnorm_deploy.contract.compare import compare, ulp_of
from rmsnorm_deploy.contract.tolerances import TOLERANCES, Tolerance, tolerance_for


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_ulp_matches_numpy_spacing(dtype):
    values = np.array([1.0, 1.5, 2.0, 0.0, 3e-5, 1e-8, 1000.0, -7.25], dtype=dtype)
    np.testing.assert_array_equal(ulp_of(values.astype(np.float64), dtype), np.abs(np.spacing(values)).astype(np.float64))


def test_ulp_of_bfloat16():
    assert ulp_of(np.array([1.0, 3.0, 0.0]), "bfloat16").tolist() == [2.0**-7, 2.0**-6, 2.0**-133]


def test_one_ulp_off_is_measured_as_one_ulp():
    e = np.array([1.0, 2.0, 0.5], dtype=np.float16)
    a = np.nextafter(e, np.float16(10))
    result = compare(a, e.astype(np.float64), Tolerance(max_ulp=1))
    assert result.max_ulp == 1.0 and result.passed


def test_failure_reports_first_bad_indices_and_what_would_pass():
    e = np.zeros((3, 4), dtype=np.float32)
    a = e.copy()
    a[1, 2] = 0.5
    a[2, 3] = 0.25
    result = compare(a, e, Tolerance(atol=0.1), name="y")
    assert not result and result.bad_count == 2
    assert result.first_bad == [(1, 2), (2, 3)]
    assert result.first_bad_values == [(0.5, 0.0), (0.25, 0.0)]
    assert "atol>=0.5" in result.summary() and "FAIL" in result.summary()


def test_nan_and_inf_must_sit_where_expected():
    e = np.array([np.inf, -np.inf, 1.0])
    assert compare(e.copy(), e, Tolerance(max_ulp=0)).passed
    bad = np.array([np.inf, np.inf, np.nan])
    result = compare(bad, e, Tolerance(max_ulp=1e9))
    assert result.nan_mismatch == 1 and result.inf_mismatch == 1 and not result.passed


def test_an_expected_nan_is_not_comparable_even_where_the_output_is_nan():
    e = np.array([np.nan, 1.0, 2.0])
    result = compare(e.copy(), e, Tolerance(max_ulp=1e9))
    assert result.nan_mismatch == 0 and result.nan_expected == 1 and not result.passed
    assert "not comparable: the reference is NaN at 1 of 3 elements" in result.summary()
    assert result.to_dict()["problem"] == result.problem()


def test_an_empty_comparison_is_not_a_pass():
    result = compare(np.zeros((0, 7)), np.zeros((0, 7)), Tolerance(max_ulp=1e9))
    assert not result.passed and "nothing compared" in result.summary()


def test_shape_mismatch_is_a_failure_not_a_broadcast():
    result = compare(np.zeros((2, 3)), np.zeros((3,)), Tolerance(atol=1))
    assert not result and "shape (2, 3) != expected (3,)" in result.summary()


def test_bfloat16_arrays_are_compared_in_their_own_ulps():
    e = np.array([1.0, 2.0], dtype=np.float64)
    a = np.array([1.0 + 2**-7, 2.0], dtype=ml_dtypes.bfloat16)
    result = compare(a, e, Tolerance(max_ulp=1))
    assert result.dtype == "bfloat16" and result.max_ulp == 1.0


def test_every_tolerance_has_a_reason():
    assert TOLERANCES
    for key, tol in TOLERANCES.items():
        assert len(tol.reason) > 40, key


def test_unknown_tolerance_key_lists_known_ones():
    with pytest.raises(KeyError, match=r"no tolerance for \('norm', 'tpu', 'float16'\); known"):
        tolerance_for("norm", "tpu", "float16")


def test_result_serializes_to_json():
    import json

    result = compare(np.ones(3, np.float16), np.ones(3), tolerance_for("norm", "onnxruntime", "float16"))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["passed"] is True and data["tolerance"]["max_ulp"] == 3
