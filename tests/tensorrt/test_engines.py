"""TensorRT engines from our graphs, against the float64 oracle (needs tensorrt and a CUDA GPU).

Every lowering x float32/float16/bfloat16 x plugin off/on: the engine is built with
``build_engine`` (strongly typed, one profile, a shared timing cache), its norms must reduce
in float32, and ``TensorRTRunner`` must match the oracle within the tolerance table on rows 1
and 199, with normal and stress inputs. Lowerings TensorRT cannot import must fail with the
parser's one-line error naming the node and op; the plugin on a graph without our nodes must
be refused. These run in the Docker image (``pytest -m trt``); elsewhere they skip with the reason.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import pytest
from tests.tensorrt._gpu import needs_trt
from tests.tensorrt._models import two_norm_model
from onnx import TensorProto, helper

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.cli import main
from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import to_torch
from rmsnorm_deploy.contract.inputs import activations, gain_weights
from rmsnorm_deploy.contract.reference import oracle
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import InputError, OutputExistsError, UserError
from rmsnorm_deploy.graph.lowerings import LOWERINGS
from rmsnorm_deploy.graph.onnx_file import save_onnx


pytestmark = needs_trt

HIDDEN = 760
PROFILE = ["d0:1,199,256"]


@pytest.fixture(scope="module")
def trt_version() -> tuple[int, int]:
    import tensorrt

    major, minor = tensorrt.__version__.split(".")[:2]
    return int(major), int(minor)


@pytest.fixture(scope="module")
def timing_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("trt-cache") / "timing.cache"


def need_bf16(dtype: str) -> None:
    import torch

    if dtype == "bfloat16" and torch.cuda.get_device_capability(0) < (8, 0):
        pytest.skip("bfloat16 engines need compute capability 8.0 or newer")


def need_plugin(plugin: bool) -> None:
    if plugin and importlib.util.find_spec("rmsnorm_deploy.tensorrt.plugin") is None:
        pytest.skip("needs the RMSNorm plugin: rmsnorm_deploy.tensorrt.plugin is not in this installation")


def spec_for(lowering: str) -> RMSNormSpec:
    return RMSNormSpec.torch_rmsnorm() if lowering == "ort" else RMSNormSpec.llama()


def assert_matches_oracle(runner, spec: RMSNormSpec, dtype: str, hidden: int, rows=(1, 199), kinds=("normal", "stress")):
    tol = tolerance_for("norm", "tensorrt", dtype)
    for n in rows:
        for kind in kinds:
            x = activations((n, hidden), dtype, seed=n, kind=kind)
            w = gain_weights((hidden,), dtype, spec.gain, seed=n + 1)
            feed = {"x": x} if w is None else {"x": x, "weight": w}
            y = runner.infer(feed)["y"]
            assert y.dtype == x.dtype and y.shape == x.shape
            expected = oracle(spec, to_torch(x), None if w is None else to_torch(w))
            result = compare(y, expected, tol, dtype=dtype, name=f"y[{kind}, rows={n}]")
            assert result, result.summary()


def assert_float32_reductions(report, plugin: bool) -> None:
    assert report.ok and report.norms
    for norm in report.norms:
        assert norm.reduction.startswith("float32"), norm.to_dict()
        assert norm.engine_layers or norm.engine_note, norm.to_dict()
        if plugin:
            assert norm.implementation.startswith("plugin (PLUGIN"), norm.to_dict()


@pytest.mark.parametrize("plugin", [False, True], ids=["no-plugin", "plugin"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_every_lowering_dtype_and_plugin(lowering, dtype, plugin, tmp_path, timing_cache, trt_version):
    from rmsnorm_deploy.tensorrt.runner import TensorRTRunner
    from rmsnorm_deploy.tensorrt.build import ParseError, build_engine

    need_bf16(dtype)
    spec = spec_for(lowering)
    path = tmp_path / "model.onnx"
    save_onnx(rmsnorm_model(spec, dtype=dtype, shape=(199, HIDDEN), lowering=lowering), path)
    if plugin and lowering in ("inline", "native", "ort"):
        with pytest.raises(UserError, match=rf"this model has none \(its norms are lowered to '{lowering}'\)"):
            build_engine(path, profiles=PROFILE, plugin=True, progress=False)
        return
    need_plugin(plugin)
    if lowering == "ort":
        with pytest.raises(ParseError, match=r"ONNX parser rejected .* node 'rmsnorm' \(SimplifiedLayerNormalization\)"):
            build_engine(path, profiles=PROFILE, progress=False)
        assert not (tmp_path / "model.engine").exists()
        return
    if lowering == "native" and trt_version < (10, 15):
        with pytest.raises(ParseError, match=r"node 'rmsnorm' \(RMSNormalization\)"):
            build_engine(path, profiles=PROFILE, progress=False)
        return
    report = build_engine(path, profiles=PROFILE, plugin=plugin, timing_cache=timing_cache, progress=False)
    assert report.plugin_used is plugin
    assert report.engine_path.name == ("model.plugin.engine" if plugin else "model.engine")
    assert_float32_reductions(report, plugin)
    sidecar = json.loads(report.sidecar_path.read_text())
    assert sidecar["lowering"] == lowering and sidecar["dtype"] == dtype and (sidecar["plugin"] is not None) is plugin
    with TensorRTRunner(report.engine_path, plugin=plugin) as runner:
        assert runner.io["x"]["dtype"] == dtype and runner.io["y"]["dtype"] == dtype  # strongly typed I/O
        assert_matches_oracle(runner, spec, dtype, HIDDEN)


@pytest.mark.parametrize("impl", ["aot", "jit"])
def test_the_plugin_implementation_asked_for_is_the_one_built(impl, tmp_path, timing_cache):
    """``build --plugin-impl``: the implementation asked for is loaded, recorded in the sidecar and
    run by the runner (which loads the plugin with it)."""
    from rmsnorm_deploy.tensorrt.runner import TensorRTRunner
    from rmsnorm_deploy.tensorrt.build import build_engine

    need_plugin(True)
    spec = RMSNormSpec.llama()
    path = tmp_path / "model.onnx"
    save_onnx(rmsnorm_model(spec, dtype="float16", shape=(199, HIDDEN), lowering="plugin"), path)
    report = build_engine(path, profiles=PROFILE, plugin=True, plugin_impl=impl, timing_cache=timing_cache,
                          progress=False)
    assert report.plugin["implementation"] == impl
    assert json.loads(report.sidecar_path.read_text())["plugin"]["implementation"] == impl
    with TensorRTRunner(report.engine_path, plugin=True) as runner:
        assert runner.stream.cuda_stream != 0  # its own stream, not the legacy default one
        assert_matches_oracle(runner, spec, "float16", HIDDEN)


@pytest.mark.parametrize("plugin", [False, True], ids=["no-plugin", "plugin"])
@pytest.mark.parametrize("hidden", [1, 7, 4096])
def test_odd_hidden_sizes(hidden, plugin, tmp_path, timing_cache):
    from rmsnorm_deploy.tensorrt.runner import TensorRTRunner
    from rmsnorm_deploy.tensorrt.build import build_engine

    need_plugin(plugin)
    spec = RMSNormSpec.llama()
    path = tmp_path / "model.onnx"
    save_onnx(rmsnorm_model(spec, dtype="float16", shape=(199, hidden)), path)
    report = build_engine(path, profiles=PROFILE, plugin=plugin, timing_cache=timing_cache, progress=False)
    assert_float32_reductions(report, plugin)
    with TensorRTRunner(report.engine_path, plugin=plugin) as runner:
        assert_matches_oracle(runner, spec, "float16", hidden)


@pytest.mark.parametrize("plugin", [False, True], ids=["no-plugin", "plugin"])
@pytest.mark.parametrize("name", sorted(named_specs()))
def test_every_named_spec(name, plugin, tmp_path, timing_cache):
    from rmsnorm_deploy.tensorrt.runner import TensorRTRunner
    from rmsnorm_deploy.tensorrt.build import build_engine

    need_plugin(plugin)
    spec = named_specs()[name]
    path = tmp_path / "model.onnx"
    save_onnx(rmsnorm_model(spec, dtype="float16", shape=(199, HIDDEN)), path)
    report = build_engine(path, profiles=PROFILE, plugin=plugin, timing_cache=timing_cache, progress=False)
    assert_float32_reductions(report, plugin)
    with TensorRTRunner(report.engine_path, plugin=plugin) as runner:
        assert_matches_oracle(runner, spec, "float16", HIDDEN, rows=(199,))


@pytest.mark.parametrize("plugin", [False, True], ids=["no-plugin", "plugin"])
def test_two_overloads_in_one_model_each_run_their_own_spec(plugin, tmp_path, timing_cache):
    from rmsnorm_deploy.tensorrt.runner import TensorRTRunner
    from rmsnorm_deploy.tensorrt.build import build_engine

    need_plugin(plugin)
    spec_a, spec_b = RMSNormSpec.llama(), RMSNormSpec.gemma()
    path = tmp_path / "model.onnx"
    save_onnx(two_norm_model(spec_a, spec_b, dtype="float16", hidden=HIDDEN), path)
    report = build_engine(path, profiles=["d0:1,64,256"], plugin=plugin, timing_cache=timing_cache, progress=False)
    assert [n.norm for n in report.norms] == ["norm_a", "norm_b"]
    assert_float32_reductions(report, plugin)
    tol = tolerance_for("norm", "tensorrt", "float16")
    x = activations((199, HIDDEN), "float16", seed=7, kind="stress")
    w1 = gain_weights((HIDDEN,), "float16", "weight", seed=8)
    w2 = gain_weights((HIDDEN,), "float16", "offset", seed=9)
    with TensorRTRunner(report.engine_path, plugin=plugin) as runner:
        out = runner.infer({"x": x, "w1": w1, "w2": w2})
    r1 = compare(out["y1"], oracle(spec_a, to_torch(x), to_torch(w1)), tol, dtype="float16", name="y1")
    r2 = compare(out["y2"], oracle(spec_b, to_torch(out["y1"]), to_torch(w2)), tol, dtype="float16", name="y2")
    assert r1, r1.summary()
    assert r2, r2.summary()


def test_a_float16_reduction_fails_the_build_and_writes_nothing(tmp_path):
    from rmsnorm_deploy.tensorrt.build import build_engine
    from rmsnorm_deploy.tensorrt.precision import PrecisionError

    h = TensorProto.FLOAT16
    nodes = [
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("two", h, [], [2.0])),
        helper.make_node("Constant", [], ["eps"], value=helper.make_tensor("eps", h, [], [1e-6])),
        helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("axes", TensorProto.INT64, [1], [-1])),
        helper.make_node("Pow", ["x", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], name="mean"),
        helper.make_node("Add", ["ms", "eps"], ["mse"], name="add_eps"),
        helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt"),
        helper.make_node("Div", ["x", "rms"], ["y"], name="div"),
    ]
    graph = helper.make_graph(nodes, "fp16_norm", [helper.make_tensor_value_info("x", h, ["d0", 64])],
                              [helper.make_tensor_value_info("y", h, ["d0", 64])])
    path = tmp_path / "fp16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    with pytest.raises(PrecisionError, match=r"norm 'y': its reduction runs in float16") as info:
        build_engine(path, profiles=["d0:1,8,16"], progress=False)
    assert info.value.exit_code == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp16.onnx"]
    assert main(["build", str(path), "--profile", "d0:1,8,16", "--no-progress"]) == 1


def test_cli_build_report_timing_cache_and_force(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    save_onnx(rmsnorm_model(RMSNormSpec.gemma(), dtype="bfloat16" if _bf16_ok() else "float16",
                             shape=(199, HIDDEN)), path)
    cache = tmp_path / "timing.cache"
    args = ["build", str(path), "--profile", "d0:1,64,256", "--timing-cache", str(cache), "--workspace", "1G",
            "--no-progress", "--json", str(tmp_path / "report.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "built in" in out and "plugin: not used" in out and "rmsnorm" in out and "ok" in out
    assert cache.stat().st_size > 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["profiles"]["dims"]["d0"]["max"] == 256 and report["norms"][0]["ok"] is True
    assert main(args) == 2
    assert "model.engine exists; pass --force" in capsys.readouterr().err
    assert main(args + ["--force"]) == 0  # the timing cache written above is read back


def _bf16_ok() -> bool:
    import torch

    return torch.cuda.get_device_capability(0) >= (8, 0)


def test_runner_refuses_shapes_outside_the_profile_and_foreign_engines(tmp_path, timing_cache):
    from rmsnorm_deploy.tensorrt.runner import TensorRTRunner
    from rmsnorm_deploy.tensorrt.build import build_engine
    from rmsnorm_deploy.tensorrt.sidecar import EngineMismatchError

    spec = RMSNormSpec.llama()
    path = tmp_path / "model.onnx"
    save_onnx(rmsnorm_model(spec, dtype="float16", shape=(8, 64)), path)
    report = build_engine(path, profiles=["d0:1,8,16"], timing_cache=timing_cache, progress=False)
    w = gain_weights((64,), "float16", "weight")
    with TensorRTRunner(report.engine_path) as runner:
        with pytest.raises(InputError, match=r"input 'x' shape \[17, 64\] is outside the engine's profile: d0=17 not in "
                                             r"1..16"):
            runner.infer({"x": activations((17, 64), "float16"), "weight": w})
        with pytest.raises(InputError, match=r"input 'x' is float32 but the engine wants float16"):
            runner.infer({"x": activations((4, 64), "float32"), "weight": w})
        with pytest.raises(InputError, match=r"missing \['weight'\]"):
            runner.infer({"x": activations((4, 64), "float16")})
    sidecar = json.loads(report.sidecar_path.read_text())
    sidecar["tensorrt"] = "10.0.0.0"
    report.sidecar_path.write_text(json.dumps(sidecar))
    with pytest.raises(EngineMismatchError, match=r"was built for TensorRT 10.0.0.0 \(this is "):
        TensorRTRunner(report.engine_path).activate()
    with pytest.raises(OutputExistsError):
        build_engine(path, report.engine_path, profiles=["d0:1,8,16"], progress=False)


def test_a_missing_plugin_library_is_a_one_line_error(tmp_path):
    from rmsnorm_deploy.tensorrt.runtime import register_plugin

    need_plugin(True)
    with pytest.raises(UserError) as info:
        register_plugin(library=tmp_path / "librmsnorm_missing.so")
    assert "\n" not in str(info.value)


def test_bfloat16_feeds_and_fetches_through_ml_dtypes(tmp_path, timing_cache):
    import ml_dtypes

    from rmsnorm_deploy.tensorrt.runner import TensorRTRunner
    from rmsnorm_deploy.tensorrt.build import build_engine

    need_bf16("bfloat16")
    path = tmp_path / "model.onnx"
    save_onnx(rmsnorm_model(RMSNormSpec.olmo2(), dtype="bfloat16", shape=(4, 7, 96)), path)
    report = build_engine(path, timing_cache=timing_cache, progress=False)  # ranges from the metadata
    assert report.profiles.dims["d0"].source == "model metadata"
    x = activations((3, 5, 96), "bfloat16")
    with TensorRTRunner(report.engine_path) as runner:
        y = runner.infer({"x": x, "weight": gain_weights((96,), "bfloat16", "weight")})["y"]
    assert y.dtype == np.dtype(ml_dtypes.bfloat16) and y.shape == (3, 5, 96)
