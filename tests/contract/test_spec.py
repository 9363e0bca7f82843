"""RMSNormSpec: validation messages, named specs, variants, round trips."""

from __future__ import annotations

import math

import pytest

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.errors import SpecError, UserError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epsilon": 0.0}, "epsilon must be finite and > 0, got 0.0"),
        ({"epsilon": -1e-6}, "epsilon must be finite and > 0, got -1e-06"),
        ({"epsilon": math.inf}, "epsilon must be finite and > 0, got inf"),
        ({"epsilon": math.nan}, "epsilon must be finite and > 0, got nan"),
        ({"epsilon": "1e-6"}, "epsilon must be a number, got '1e-6'"),
        ({"normalized_dims": 0}, "normalized_dims must be an integer >= 1"),
        ({"normalized_dims": 1.5}, "normalized_dims must be an integer >= 1"),
        ({"gain": "scale"}, "unknown gain 'scale'; choose one of none, weight, offset"),
        ({"order": "cast_first"}, "unknown order 'cast_first'; choose one of scale_then_cast, cast_then_scale"),
        ({"accumulation": "float16"}, "unknown accumulation 'float16'; choose one of float32, float64"),
        ({"epsilon_placement": "outside"}, "unknown epsilon_placement 'outside'"),
    ],
)
def test_invalid_spec_is_refused_with_its_reason(kwargs, message):
    with pytest.raises(SpecError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        RMSNormSpec(**kwargs)


def test_spec_error_is_a_user_error():
    # The CLI turns UserError into a one-line message and exit code 2.
    assert issubclass(SpecError, UserError)


def test_named_specs_match_their_implementations():
    specs = named_specs()
    assert specs["torch"].order == "scale_then_cast" and specs["torch"].gain == "weight"
    assert specs["llama"].order == "cast_then_scale"
    assert specs["gemma"].gain == "offset" and specs["gemma"].order == "scale_then_cast"
    assert specs["nogain"].has_gain is False


def test_axes_are_the_trailing_dims():
    assert RMSNormSpec(normalized_dims=1).axes == (-1,)
    assert RMSNormSpec(normalized_dims=3).axes == (-3, -2, -1)


def test_epsilon_float32_is_what_graphs_add():
    spec = RMSNormSpec(epsilon=1e-6)
    assert spec.epsilon_float32 != 1e-6
    assert abs(spec.epsilon_float32 - 1e-6) < 1e-13


@pytest.mark.parametrize(
    ("spec", "dtype", "variant"),
    [
        (RMSNormSpec.llama(), "float16", "weight.cast_then_scale.acc_float32.upcast"),
        (RMSNormSpec.llama(), "float32", "weight.acc_float32.same_dtype"),
        (RMSNormSpec.gemma(), "bfloat16", "offset.scale_then_cast.acc_float32.upcast"),
        (RMSNormSpec(gain="none", order="cast_then_scale"), "float16", "none.acc_float32.upcast"),
        (RMSNormSpec(accumulation="float64"), "float32", "weight.scale_then_cast.acc_float64.upcast"),
        (RMSNormSpec(epsilon_placement="outside_sqrt"), "float16", "weight.scale_then_cast.acc_float32.eps_outside_sqrt.upcast"),
    ],
)
def test_variant_names_the_structure_only(spec, dtype, variant):
    assert spec.variant(spec.upcasts(dtype)) == variant


def test_variant_ignores_epsilon_and_axes():
    a = RMSNormSpec(epsilon=1e-5, normalized_dims=1)
    b = RMSNormSpec(epsilon=1e-6, normalized_dims=2)
    assert a.variant(True) == b.variant(True)


def test_dict_round_trip_and_unknown_fields():
    spec = RMSNormSpec(epsilon=3e-6, normalized_dims=2, gain="offset", order="cast_then_scale")
    assert RMSNormSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match=r"unknown spec field\(s\) \['eps'\]"):
        RMSNormSpec.from_dict({"eps": 1e-6})


def test_describe_names_every_choice():
    text = RMSNormSpec.gemma(1e-6).describe()
    assert "(1 + w)" in text and "float32" in text and "scale_then_cast" in text and "1e-06" in text
