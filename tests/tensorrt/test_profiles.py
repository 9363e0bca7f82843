"""Optimization profiles from a model's dynamic dims, its metadata and --profile (no TensorRT needed)."""

from __future__ import annotations

import pytest
from tests.tensorrt._models import two_norm_model
from onnx import TensorProto, helper

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.errors import InputError, UserError
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.tensorrt.profiles import (
    Profiles,
    model_input_dims,
    parse_profile_arg,
    resolve_profiles,
)

SPEC = RMSNormSpec.llama()


@pytest.mark.parametrize("shape", [(1, 7), (199, 760), (2, 3, 1)])
def test_defaults_come_from_the_export_metadata(shape):
    model = rmsnorm_model(SPEC, dtype="float16", shape=shape)
    meta = ModelMetadata.read(model)
    profiles = resolve_profiles(model, None, meta.dims)
    leading = [f"d{i}" for i in range(len(shape) - 1)]
    assert list(profiles.dims) == leading
    for name, size in zip(leading, shape):
        assert profiles.dims[name].as_list() == meta.dims[name] == [1, size, 4 * size]
        assert profiles.dims[name].source == "model metadata"
    x = profiles.inputs["x"]
    assert x.min == tuple([1] * len(leading) + [shape[-1]])
    assert x.opt == tuple(shape)
    assert x.max == tuple([4 * s for s in shape[:-1]] + [shape[-1]])
    w = profiles.inputs["weight"]
    assert w.min == w.opt == w.max == (shape[-1],) and not w.dynamic


def test_a_profile_overrides_the_metadata_for_its_dim_only():
    model = rmsnorm_model(SPEC, dtype="float32", shape=(2, 5, 760))
    meta = ModelMetadata.read(model)
    profiles = resolve_profiles(model, ["d1:1,64,512"], meta.dims)
    assert profiles.dims["d1"].as_list() == [1, 64, 512] and profiles.dims["d1"].source == "--profile"
    assert profiles.dims["d0"].as_list() == [1, 2, 8]
    assert profiles.inputs["x"].max == (8, 512, 760)
    as_mapping = resolve_profiles(model, {"d1": (1, 64, 512)}, meta.dims)
    assert as_mapping.to_dict() == profiles.to_dict()


def test_shared_dims_give_consistent_shapes_to_every_input():
    model = two_norm_model(SPEC, RMSNormSpec.gemma(), dtype="float16", hidden=7)
    profiles = resolve_profiles(model, ["d0:2,3,9"])
    assert profiles.inputs["x"].min == (2, 7) and profiles.inputs["x"].max == (9, 7)
    assert profiles.inputs["w2"].min == (7,)


@pytest.mark.parametrize("text", ["d0", "d0:1,2", "d0:1,2,3,4", ":1,2,3", "d0:a,b,c", "d0:-1,2,3"])
def test_malformed_profiles_are_one_line_errors(text):
    with pytest.raises(UserError, match=r"is not NAME:MIN,OPT,MAX \(for example d0:1,64,256\)"):
        parse_profile_arg(text)


def test_profile_parsing_accepts_spaces_and_names_with_dots():
    assert parse_profile_arg(" x.0 : 1, 8 ,64 ") == ("x.0", (1, 8, 64))


@pytest.mark.parametrize("values", [(0, 1, 2), (4, 2, 8), (1, 9, 8)])
def test_a_range_must_be_ordered_and_positive(values):
    model = rmsnorm_model(SPEC, dtype="float16", shape=(4, 8))
    text = "d0:" + ",".join(map(str, values))
    with pytest.raises(UserError, match=r"profile of 'd0' from --profile: need 1 <= min <= opt <= max, got"):
        resolve_profiles(model, [text])


def test_an_unknown_dim_names_the_dims_the_model_has():
    model = rmsnorm_model(SPEC, dtype="float16", shape=(4, 8))
    with pytest.raises(UserError, match=r"--profile batch: the model has no dynamic dim 'batch'; its dynamic dims: "
                                        r"d0 \(x axis 0\)"):
        resolve_profiles(model, ["batch:1,2,3"])


def test_a_profile_for_an_input_name_explains_profiles_are_per_dim():
    model = rmsnorm_model(SPEC, dtype="float16", shape=(4, 8))
    with pytest.raises(UserError, match=r"'x' is an input: profiles are given per dynamic dim"):
        resolve_profiles(model, ["x:1,2,3"])


def test_a_static_model_takes_no_profile():
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph)
    assert resolve_profiles(model).dims == {}
    with pytest.raises(UserError, match=r"its dynamic dims: none \(all input shapes are static\)"):
        resolve_profiles(model, ["d0:1,2,3"])


def test_a_dynamic_dim_without_any_range_is_refused_with_the_flag_to_pass():
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", None, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", None, 4])])
    model = helper.make_model(graph)
    assert model_input_dims(model) == {"x": ("batch", "x.1", 4)}
    with pytest.raises(UserError, match=r"dynamic dim 'batch' \(x axis 0\) has no range: the model's metadata gives "
                                        r"none; pass --profile batch:MIN,OPT,MAX"):
        resolve_profiles(model)
    with pytest.raises(UserError, match=r"pass --profile x.1:MIN,OPT,MAX"):
        resolve_profiles(model, ["batch:1,1,2"])
    profiles = resolve_profiles(model, ["batch:1,1,2", "x.1:3,5,7"])
    assert profiles.inputs["x"].max == (2, 7, 4)


def test_the_same_dim_twice_is_refused():
    model = rmsnorm_model(SPEC, dtype="float16", shape=(4, 8))
    with pytest.raises(UserError, match=r"--profile d0 is given twice"):
        resolve_profiles(model, ["d0:1,2,3", "d0:1,2,4"])


def test_shapes_are_checked_against_the_profile_and_survive_json():
    model = rmsnorm_model(SPEC, dtype="bfloat16", shape=(199, 760))
    profiles = Profiles.from_dict(resolve_profiles(model, ["d0:1,199,256"]).to_dict())
    profiles.check_shape("x", (1, 760))
    profiles.check_shape("x", (256, 760))
    with pytest.raises(InputError, match=r"input 'x' shape \[257, 760\] is outside the engine's profile: d0=257 not in "
                                         r"1..256; rebuild the engine with a wider --profile \(d0:MIN,OPT,MAX\)"):
        profiles.check_shape("x", (257, 760))
    with pytest.raises(InputError, match=r"axis 1=761 not in 760..760"):
        profiles.check_shape("x", (4, 761))
    with pytest.raises(InputError, match=r"has shape \[4\] but the engine takes rank 2 \(\[d0, 760\]\)"):
        profiles.check_shape("x", (4,))
