"""A KV-cache graph's two TensorRT profiles (prefill, decode) from its metadata (no TensorRT needed)."""

from __future__ import annotations

import pytest
from tests.decoder.test_convention import _layout, kv_graph

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import InputError, UserError
from rmsnorm_deploy.decoder.convention import KVCacheError
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.tensorrt.profiles import (
    engine_profiles,
    kv_cache_profiles,
    profiles_from_dict,
    profiles_to_dict,
)


def _model(max_length: int = 128, batch: int = 2, seq: int = 16, dtype: str = "float32"):
    lay = _layout(max_length=max_length, dtype=dtype)
    model = kv_graph(lay)
    meta = ModelMetadata(specs={"n": RMSNormSpec.llama(1e-6)}, lowering="function", dtype=dtype,
                         inputs=lay.metadata_inputs(), dims=lay.dims(batch=batch, sequence=seq, max_batch=8),
                         kv_cache=lay.to_dict())
    meta.write(model)
    return model, ModelMetadata.read(model), lay


@pytest.mark.parametrize("max_length, seq", [(128, 16), (7, 3), (2, 1)])
def test_prefill_and_decode_profiles_come_from_the_metadata(max_length, seq):
    model, meta, lay = _model(max_length=max_length, seq=seq)
    prefill, decode = engine_profiles(model, meta)
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert prefill.dims["past"].as_list() == [0, 0, 0]
    assert prefill.dims["sequence"].as_list() == [1, seq, max_length]
    assert prefill.dims["total"].as_list() == prefill.dims["sequence"].as_list()
    assert decode.dims["sequence"].as_list() == [1, 1, 1]
    assert decode.dims["past"].min == 1 and decode.dims["past"].max == max_length - 1
    assert decode.dims["total"].as_list() == [2, decode.dims["past"].opt + 1, max_length]
    assert prefill.dims["batch"].as_list() == decode.dims["batch"].as_list() == [1, 2, 8]
    past = decode.inputs["past_key_values.1.value"]
    assert past.min == (1, 2, 1, 16) and past.max == (8, 2, max_length - 1, 16)
    assert prefill.inputs["past_key_values.0.key"].max == (8, 2, 0, 16)
    assert decode.inputs["input_ids"].max == (8, 1)
    # a decode step at the longest past fits; a prompt in the decode profile does not
    decode.check_shape("attention_mask", (3, max_length))
    prefill.check_shape("input_ids", (1, max_length))
    with pytest.raises(InputError, match="outside the engine's profile"):
        decode.check_shape("input_ids", (1, 2))


def test_batch_and_sequence_can_be_given_past_and_total_cannot():
    model, meta, _ = _model()
    prefill, decode = engine_profiles(model, meta, ["batch:1,4,4", "sequence:1,32,64"])
    assert prefill.dims["batch"].source == "--profile" and prefill.dims["batch"].max == 4
    assert decode.dims["past"].max == 63 and prefill.dims["sequence"].max == 64
    with pytest.raises(UserError, match="past and total follow from batch and sequence"):
        engine_profiles(model, meta, ["past:1,2,3"])
    with pytest.raises(UserError, match="exceeds the model's 128 positions"):
        engine_profiles(model, meta, ["sequence:1,2,4096"])
    with pytest.raises(UserError, match="need 1 <= min <= opt <= max"):
        engine_profiles(model, meta, ["batch:2,1,4"])


def test_a_kv_graph_with_another_dynamic_dim_is_refused():
    model, meta, lay = _model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "rows"
    with pytest.raises(UserError, match=r"dynamic dims \['rows'\]"):
        kv_cache_profiles(model, lay, None, meta.dims)


def test_damaged_kv_metadata_is_refused_before_any_profile():
    model, meta, _ = _model()
    meta.kv_cache = {**meta.kv_cache, "head_dim": 0}
    with pytest.raises(KVCacheError, match="head_dim must be an integer"):
        engine_profiles(model, meta)


def test_a_profile_set_round_trips_through_the_sidecar_dict():
    model, meta, _ = _model()
    profiles = engine_profiles(model, meta)
    data = profiles_to_dict(profiles)
    assert list(data) == ["profile_set"]
    back = profiles_from_dict(data)
    assert [p.name for p in back] == ["prefill", "decode"]
    assert [p.to_dict() for p in back] == [p.to_dict() for p in profiles]
    single = profiles[:1]
    assert profiles_from_dict(profiles_to_dict(single))[0].to_dict() == single[0].to_dict()


def test_a_graph_without_kv_metadata_keeps_one_profile():
    from rmsnorm_deploy import rmsnorm_model

    model = rmsnorm_model(RMSNormSpec.llama(), dtype="float32", shape=(2, 8))
    assert len(engine_profiles(model, ModelMetadata.read(model))) == 1


def test_check_trt_knows_kv_cache_graphs():
    from rmsnorm_deploy.tensorrt.compat import check_model

    model, meta, _ = _model()
    reports = check_model(model, ["10.15"])
    kv = [f for f in reports[0].findings if f.op == "KV cache"]
    assert len(kv) == 1 and not kv[0].blocking and "prefill (past 0" in kv[0].problem
    # metadata that does not describe the graph blocks: build could not make its profiles
    meta.kv_cache = {**meta.kv_cache, "kv_heads": 4}
    meta.write(model)
    kv = [f for f in check_model(model, ["10.15"])[0].findings if f.op == "KV cache"]
    assert kv[0].blocking and "the KV-cache convention says ['batch', 4, 'past', 16]" in kv[0].problem
