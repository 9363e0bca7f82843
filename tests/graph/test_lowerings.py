"""Lowerings: what each writes, and the exact reason when it cannot represent a spec."""

from __future__ import annotations

import onnx
import pytest
from tests.cases import DTYPES

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.errors import LoweringError, UserError
from rmsnorm_deploy.graph.lowerings import LOWERINGS, refusal
from rmsnorm_deploy.graph.metadata import ModelMetadata

SPECS = named_specs()

NATIVE_S2C = (
    "RMSNormalization rounds the normalized value to the input dtype before applying the gain (cast_then_scale); "
    "this spec applies the gain in float32 first (scale_then_cast)"
)
ORT_C2S = (
    "SimplifiedLayerNormalization applies the gain in float32 before rounding to the input dtype (scale_then_cast); "
    "this spec rounds first (cast_then_scale)"
)


@pytest.mark.parametrize(
    ("lowering", "spec", "upcast", "opset", "reason"),
    [
        ("native", SPECS["torch"], True, 23, NATIVE_S2C),
        ("native", SPECS["gemma"], True, 23, NATIVE_S2C),
        ("native", SPECS["llama"], True, 18, "RMSNormalization exists from opset 23; this model is opset 18 (use --opset 23)"),
        ("native", RMSNormSpec(accumulation="float64"), True, 23, "RMSNormalization accumulates in float32 only; this spec accumulates in float64"),
        ("native", RMSNormSpec(epsilon_placement="outside_sqrt"), False, 23, "RMSNormalization adds epsilon inside the square root; this spec adds it outside"),
        ("ort", SPECS["llama"], True, 18, ORT_C2S),
        ("ort", RMSNormSpec(epsilon_placement="outside_sqrt"), True, 18, "SimplifiedLayerNormalization adds epsilon inside the square root; this spec adds it outside"),
        ("turbo", SPECS["llama"], True, 18, "unknown lowering 'turbo'; choose one of function, native, ort, inline, plugin"),
    ],
)
def test_refusal_names_the_reason(lowering, spec, upcast, opset, reason):
    assert refusal(lowering, spec, upcast, opset) == reason


@pytest.mark.parametrize(
    ("lowering", "spec", "upcast", "opset"),
    [
        ("native", SPECS["llama"], True, 23),  # HF Llama's order is RMSNormalization's
        ("native", SPECS["torch"], False, 23),  # float32 in: both orders round once
        ("native", SPECS["nogain"], True, 23),
        ("ort", SPECS["torch"], True, 18),
        ("ort", SPECS["gemma"], True, 18),
        ("ort", SPECS["llama"], False, 18),
    ],
)
def test_representable_specs_are_accepted(lowering, spec, upcast, opset):
    assert refusal(lowering, spec, upcast, opset) is None


@pytest.mark.parametrize("lowering", ["function", "plugin", "inline"])
def test_function_family_represents_every_spec(lowering):
    for spec in [*SPECS.values(), RMSNormSpec(accumulation="float64", epsilon_placement="outside_sqrt")]:
        for upcast in (False, True):
            assert refusal(lowering, spec, upcast, 18) is None


def test_refusal_surfaces_as_lowering_error_naming_the_node():
    with pytest.raises(LoweringError, match=r"^cannot lower RMSNorm node 'rmsnorm' to 'native': " + NATIVE_S2C.replace("(", r"\(").replace(")", r"\)")):
        rmsnorm_model(SPECS["torch"], dtype="float16", shape=(2, 8), lowering="native")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_each_lowering_writes_its_ops(lowering, dtype):
    spec = SPECS["gemma"] if lowering == "ort" else SPECS["llama"]
    if lowering == "native" and dtype == "float32":
        spec = SPECS["gemma"]  # offset gain in float32: scale = 1 + w
    model = rmsnorm_model(spec, dtype=dtype, shape=(3, 8), lowering=lowering)
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    funcs = [(f.domain, f.name, f.overload) for f in model.functions]
    domains = {i.domain for i in model.opset_import}
    if lowering in ("function", "plugin"):
        assert ops == [("rmsnorm_deploy", "RMSNorm")]
        assert funcs == [("rmsnorm_deploy", "RMSNorm", model.graph.node[0].overload)]
        assert "rmsnorm_deploy" in domains
        attrs = {a.name for a in model.graph.node[0].attribute}
        assert ("plugin_namespace" in attrs) == (lowering == "plugin")
    else:
        assert not funcs and "rmsnorm_deploy" not in domains
        assert all(d == "" for d, _ in ops)
    if lowering == "native":
        assert ("", "RMSNormalization") in ops and model.opset_import[0].version == 23
    if lowering == "ort":
        assert ("", "SimplifiedLayerNormalization") in ops
    if lowering == "inline":
        assert ("", "ReduceMean") in ops


@pytest.mark.parametrize("lowering", ["function", "plugin", "inline", "native"])
def test_models_pass_the_full_checker(lowering):
    for dtype in DTYPES:
        for spec in SPECS.values():
            try:
                model = rmsnorm_model(spec, dtype=dtype, shape=(199, 760), lowering=lowering)
            except LoweringError:
                continue
            onnx.checker.check_model(model, full_check=True)


def test_ort_lowering_has_no_onnx_schema_documented():
    # SimplifiedLayerNormalization is ONNX Runtime's, registered in domain "" but absent from
    # ONNX's schema set: the checker cannot check it (README: "the ort lowering").
    model = rmsnorm_model(SPECS["torch"], dtype="float16", shape=(2, 8), lowering="ort")
    with pytest.raises(onnx.checker.ValidationError, match="No Op registered for SimplifiedLayerNormalization"):
        onnx.checker.check_model(model, full_check=True)


def test_ort_offset_gain_in_half_scales_in_float32():
    # Gemma forms 1 + w in float32; a float16 scale would round it, so the op gets a float32 scale.
    model = rmsnorm_model(SPECS["gemma"], dtype="float16", shape=(2, 8), lowering="ort")
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Constant", "Cast", "Add", "SimplifiedLayerNormalization", "CastLike"]


def test_metadata_records_spec_lowering_and_inputs():
    model = rmsnorm_model(SPECS["gemma"], dtype="bfloat16", shape=(4, 5, 64), lowering="inline")
    meta = ModelMetadata.read(model)
    assert meta.specs == {"rmsnorm": SPECS["gemma"]} and meta.lowering == "inline" and meta.dtype == "bfloat16"
    assert meta.inputs["x"]["shape"] == ["d0", "d1", 64] and meta.inputs["weight"]["kind"] == "weight"
    assert meta.dims == {"d0": [1, 4, 16], "d1": [1, 5, 20]}
    assert meta.versions["onnx"] == onnx.__version__


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float64"}, "float64 models are not supported; choose float32, float16 or bfloat16"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"shape": ()}, r"shape \(\) must have at least 1 dims, all >= 1"),
        ({"shape": (0, 8)}, r"shape \(0, 8\) must have at least 1 dims, all >= 1"),
        ({"lowering": "fast"}, "unknown lowering 'fast'"),
        ({"opset": 17}, "opset 17 is not supported"),
    ],
)
def test_builder_rejects_bad_arguments(kwargs, message):
    args = {"dtype": "float16", "shape": (2, 8), "lowering": "function"} | kwargs
    with pytest.raises(UserError, match=message):
        rmsnorm_model(SPECS["llama"], **args)


def test_dtype_accepts_torch_and_numpy_objects():
    import numpy as np
    import torch

    a = rmsnorm_model(SPECS["llama"], dtype=torch.bfloat16, shape=(2, 8))
    b = rmsnorm_model(SPECS["llama"], dtype=np.float16, shape=(2, 8))
    assert a.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    assert b.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
