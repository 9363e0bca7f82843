"""The ONNX Runtime runner: numbers, bf16 in and out, input checks, and no silent provider fallback."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.inputs import activations, gain_weights
from rmsnorm_deploy.contract.reference import oracle
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import InputError, LoweringError, ProviderError, UserError
from rmsnorm_deploy.graph.standalone import rmsnorm_model
from tests.cases import DTYPES

ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'rmsnorm-deploy[onnxruntime]'")

from rmsnorm_deploy.runners.onnxruntime import (  # noqa: E402
    OnnxRuntimeRunner,
    missing_provider_libraries,
    provider_name,
    short_provider_name,
)

SHAPES = [(1, 1), (199, 7), (3, 760)]


def _feed(spec, dtype, shape, kind="normal"):
    x = activations(shape, dtype, seed=3, kind=kind)
    w = gain_weights(shape[-1:], dtype, spec.gain, seed=4)
    return {"x": x} if w is None else {"x": x, "weight": w}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("lowering", ["function", "ort", "inline"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_name", ["llama", "gemma"])
def test_cpu_runner_matches_the_oracle(spec_name, dtype, lowering, shape):
    spec = named_specs()[spec_name]
    try:
        model = rmsnorm_model(spec, dtype=dtype, shape=shape, lowering=lowering)
    except LoweringError as exc:
        assert lowering == "ort" and spec.order == "cast_then_scale" and dtype != "float32", exc
        pytest.skip(f"the lowering refuses this spec: {exc}")
    feed = _feed(spec, dtype, shape)
    try:
        with OnnxRuntimeRunner(model, ["cpu"]) as runner:
            out = runner.infer(feed)
            assert runner.actual_providers == ["CPUExecutionProvider"]
    except UserError as exc:
        assert "NOT_IMPLEMENTED" in str(exc), exc
        pytest.skip(f"ONNX Runtime CPU has no kernel for it: {exc}")
    y = out["y"]
    assert y.dtype == np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    assert y.shape == shape
    result = compare(y, oracle(spec, feed["x"], feed.get("weight")), tolerance_for("norm", "onnxruntime", dtype))
    assert result, result.summary()


def test_bfloat16_goes_in_and_comes_out_as_ml_dtypes():
    spec = named_specs()["torch"]
    model = rmsnorm_model(spec, dtype="bfloat16", shape=(5, 64))
    feed = _feed(spec, "bfloat16", (5, 64), kind="stress")
    with OnnxRuntimeRunner(model) as runner:
        y = runner.infer(feed)["y"]
    assert y.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.all(y[1] == 0), "the stress inputs' all-zero row must normalize to zeros, not NaN"
    assert np.isfinite(y.astype(np.float32)).all()


def test_optimized_model_is_written_where_asked(tmp_path):
    model = rmsnorm_model(named_specs()["torch"], dtype="float32", shape=(4, 16))
    target = tmp_path / "optimized.onnx"
    with OnnxRuntimeRunner(model, ["cpu"], optimization="all", optimized_model_path=target):
        pass
    assert target.stat().st_size > 0


def test_optimized_model_keeps_its_weights_beside_it_not_in_it(tmp_path):
    """Readers of the optimized graph (the audit of what ONNX Runtime ran) want the graph: its
    weights of 1 KB and more go to a file beside it, so neither ONNX Runtime nor the reader holds
    another copy of the model's weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
                              initializer=[numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    target = tmp_path / "optimized.onnx"
    with OnnxRuntimeRunner(model, ["cpu"], optimization="all", optimized_model_path=target) as runner:
        runner.infer({"x": np.ones((2, 64), np.float32)})
    graph_only = onnx.load(str(target), load_external_data=False)
    assert all(len(t.raw_data) < 1024 for t in graph_only.graph.initializer)
    assert (tmp_path / "optimized.onnx.data").stat().st_size >= weight.nbytes
    with_data = onnx.load(str(target))
    assert any(np.array_equal(numpy_helper.to_array(t), weight) for t in with_data.graph.initializer)


@pytest.mark.parametrize(
    "feed_change, message",
    [
        (lambda f: {"x": f["x"]}, "missing ['weight']"),
        (lambda f: {**f, "extra": f["x"]}, "unexpected ['extra']"),
        (lambda f: {**f, "x": f["x"].astype(np.float32)}, "'x' is float32 but the model wants float16"),
        (lambda f: {**f, "x": f["x"][:, :8]}, "'x' has shape [4, 8] but the model wants ['d0', 16]"),
        (lambda f: {**f, "x": f["x"][None]}, "'x' has shape [1, 4, 16]"),
    ],
    ids=["missing", "unexpected", "dtype", "shape", "rank"],
)
def test_wrong_inputs_are_one_line_errors(feed_change, message):
    spec = named_specs()["llama"]
    model = rmsnorm_model(spec, dtype="float16", shape=(4, 16))
    with OnnxRuntimeRunner(model) as runner:
        with pytest.raises(InputError) as err:
            runner.infer(feed_change(_feed(spec, "float16", (4, 16))))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_runner_outside_its_with_block_refuses():
    runner = OnnxRuntimeRunner(rmsnorm_model(named_specs()["torch"], dtype="float32", shape=(2, 8)))
    with pytest.raises(RuntimeError, match="outside its `with` block"):
        runner.infer({})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"providers": ["gpu"]}, "unknown provider 'gpu'; choose from cpu, cuda, tensorrt"),
        ({"providers": []}, "no provider requested"),
        ({"optimization": "max"}, "unknown optimization level 'max'"),
        ({"provider_options": {"cuda": {"device_id": 0}}}, "options given for CUDAExecutionProvider, which was not requested"),
    ],
)
def test_bad_runner_arguments(kwargs, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(")):
        OnnxRuntimeRunner(b"", **kwargs)


def test_provider_names_round_trip():
    for short in ("cpu", "cuda", "tensorrt"):
        assert short_provider_name(provider_name(short)) == short
    assert provider_name("CUDAExecutionProvider") == "CUDAExecutionProvider"
    assert missing_provider_libraries("CPUExecutionProvider") == []


def _cuda_status() -> tuple[bool, str]:
    """(whether ORT's CUDA provider really runs here, why not)."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, "this onnxruntime build has no CUDA provider"
    try:
        with OnnxRuntimeRunner(rmsnorm_model(named_specs()["torch"], dtype="float32", shape=(1, 4)), ["cuda"]):
            return True, ""
    except ProviderError as exc:
        return False, str(exc)


@pytest.mark.parametrize("provider", ["cuda", "tensorrt"])
def test_provider_missing_from_the_build_is_refused(provider):
    if provider_name(provider) in ort.get_available_providers():
        pytest.skip(f"this onnxruntime build has {provider_name(provider)} (onnxruntime-gpu)")
    model = rmsnorm_model(named_specs()["torch"], dtype="float32", shape=(2, 8))
    with pytest.raises(ProviderError, match=f"{provider_name(provider)} is not in this onnxruntime build"):
        with OnnxRuntimeRunner(model, [provider]):
            pass


def test_gpu_build_without_cuda_raises_instead_of_running_on_cpu():
    """onnxruntime-gpu asked for CUDA without the CUDA libraries creates a CPU session; the runner refuses."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu (this build has no CUDA provider to fall back from)")
    usable, _ = _cuda_status()
    if usable:
        pytest.skip("CUDA is usable here: there is no fallback to observe")
    model = rmsnorm_model(named_specs()["llama"], dtype="float16", shape=(3, 8))
    with pytest.raises(ProviderError) as err:
        with OnnxRuntimeRunner(model, ["cuda"]):
            pass
    text = str(err.value)
    assert "requested CUDAExecutionProvider but ONNX Runtime created a session on CPUExecutionProvider" in text
    missing = missing_provider_libraries("CUDAExecutionProvider")
    if missing:
        assert f"missing {missing[0]}" in text
    else:
        assert "no NVIDIA GPU is visible" in text


def test_gpu_build_without_tensorrt_libraries_raises():
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu (this build has no TensorRT provider)")
    if not missing_provider_libraries("TensorrtExecutionProvider"):
        pytest.skip("TensorRT's libraries load here: there is no failure to observe")
    model = rmsnorm_model(named_specs()["torch"], dtype="float32", shape=(2, 8))
    with pytest.raises(ProviderError, match="TensorrtExecutionProvider.*libnvinfer"):
        with OnnxRuntimeRunner(model, ["tensorrt", "cuda"]):
            pass


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["normal", "stress"])
def test_cuda_runner_matches_the_oracle(dtype, kind):
    usable, why = _cuda_status()
    if not usable:
        pytest.skip(f"needs ONNX Runtime's CUDA provider: {why}")
    spec = named_specs()["llama"]
    model = rmsnorm_model(spec, dtype=dtype, shape=(199, 760))
    feed = _feed(spec, dtype, (199, 760), kind)
    with OnnxRuntimeRunner(model, ["cuda"]) as runner:
        y = runner.infer(feed)["y"]
        assert "CUDAExecutionProvider" in runner.actual_providers
    result = compare(y, oracle(spec, feed["x"], feed["weight"]), tolerance_for("norm", "onnxruntime", dtype))
    assert result, result.summary()
