"""The RMSNorm plugin inside TensorRT engines, against the float64 oracle.

Marked ``trt``: skipped, saying why, without tensorrt and a CUDA GPU (run them in the
Docker image). The engines are built here with TensorRT's Python API directly, from
models made by the ``plugin`` lowering; the ahead-of-time engine is then run in a fresh
process that imports nothing of this package (and by ``trtexec`` when it is installed),
and the same graph is built without the plugin, where TensorRT inlines the function.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.cases import DTYPES

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.inputs import activations, gain_weights
from rmsnorm_deploy.contract.reference import oracle
from rmsnorm_deploy.contract.tolerances import tolerance_for

pytestmark = pytest.mark.trt
REPO = Path(__file__).resolve().parents[2]
SPECS = {
    "torch": RMSNormSpec.torch_rmsnorm(1e-6),
    "llama": RMSNormSpec.llama(1e-6),
    "gemma": RMSNormSpec.gemma(1e-6),
    "nogain": RMSNormSpec(1e-6, gain="none"),
    "eps-outside-sqrt": RMSNormSpec(1e-5, order="cast_then_scale", epsilon_placement="outside_sqrt"),
    "qk-norm-2d": RMSNormSpec(1e-6, normalized_dims=2, order="cast_then_scale"),
}
#: example shapes; the leading dims are dynamic in the model and the engine's profile
SHAPES = {"199x7": (199, 7), "1x4096": (1, 4096), "199x4096": (199, 4096), "2x5x128": (2, 5, 128)}
MAX_ROWS = 512


@pytest.fixture(scope="module")
def trt():
    module = pytest.importorskip("tensorrt", reason="needs tensorrt: run the GPU suite in the Docker image")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: TensorRT builds and runs engines on one")
    return module


@pytest.fixture(scope="module")
def plugins(trt):
    from rmsnorm_deploy.tensorrt.plugin_loader import load_plugin

    return {impl: load_plugin(implementation=impl) for impl in ("aot", "jit")}


def _build(trt, model, network_flags: int = 0):
    """A serialized engine for ``model`` and the layer types of its network."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    from rmsnorm_deploy.tensorrt.build import network_flags as creation_flags

    # STRONGLY_TYPED on TensorRT 10; 11 is always strongly typed and ignores it
    network = builder.create_network(network_flags | creation_flags(trt, None))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString()):
        raise AssertionError("; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    layer_types = [network.get_layer(i).type for i in range(network.num_layers)]
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    dynamic = False
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        dims = list(tensor.shape)
        if any(d < 0 for d in dims):
            dynamic = True
            profile.set_shape(tensor.name, [1 if d < 0 else d for d in dims], [8 if d < 0 else d for d in dims],
                              [MAX_ROWS if d < 0 else d for d in dims])
    if dynamic:
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    assert serialized is not None, "TensorRT failed to build the engine (see its log above)"
    return bytes(serialized), layer_types


def _run(trt, engine_bytes: bytes, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    logger = trt.Logger(trt.Logger.WARNING)
    engine = trt.Runtime(logger).deserialize_cuda_engine(engine_bytes)
    context = engine.create_execution_context()
    for name, tensor in feed.items():
        context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    y = torch.empty(tuple(context.get_tensor_shape("y")), dtype=feed["x"].dtype, device="cuda")
    context.set_tensor_address("y", y.data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    return y


def _feed(spec: RMSNormSpec, dtype: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    from rmsnorm_deploy.contract.dtypes import to_torch

    feed = {"x": to_torch(activations(shape, dtype, seed=sum(shape)))}
    if spec.has_gain:
        feed["weight"] = to_torch(gain_weights(shape[len(shape) - spec.normalized_dims:], dtype, spec.gain))
    return {k: v.cuda() for k, v in feed.items()}


def _model(spec, dtype, shape):
    return rmsnorm_model(spec, dtype=dtype, shape=shape, lowering="plugin")


def _shape_for(spec: RMSNormSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` for a spec over one trailing dim; over two (q/k norms over [heads, head_dim]) a dim of 2 is added."""
    return shape if spec.normalized_dims == 1 else (*shape[:-1], 2, shape[-1])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("implementation", ["aot", "jit"])
def test_engine_with_the_plugin_matches_the_oracle(trt, plugins, implementation, spec_name, dtype, shape):
    spec = SPECS[spec_name]
    info = plugins[implementation]
    dims = _shape_for(spec, SHAPES[shape])
    engine, layer_types = _build(trt, _model(spec, dtype, dims), info.network_flag_bits(trt))
    assert trt.LayerType.PLUGIN_V3 in layer_types, f"the RMSNorm node was not mapped to the plugin: {layer_types}"
    assert trt.LayerType.REDUCE not in layer_types, "the local function was inlined instead of the plugin"
    feed = _feed(spec, dtype, dims)
    y = _run(trt, engine, feed)
    expected = oracle(spec, feed["x"].cpu(), feed["weight"].cpu() if "weight" in feed else None)
    result = compare(y.cpu(), expected, tolerance_for("norm", "tensorrt", dtype))
    assert result, result.summary()


_RUN_ALONE = """
import sys, tensorrt as trt, torch
engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(open(sys.argv[1], "rb").read())
assert engine is not None, "the engine did not deserialize without the Python plugin"
tensors = torch.load(sys.argv[2])
context = engine.create_execution_context()
for name, t in tensors.items():
    context.set_input_shape(name, tuple(t.shape)); context.set_tensor_address(name, t.data_ptr())
y = torch.empty(tuple(context.get_tensor_shape("y")), dtype=tensors["x"].dtype, device="cuda")
context.set_tensor_address("y", y.data_ptr())
assert context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
torch.cuda.synchronize()
torch.save(y.cpu(), sys.argv[3])
"""


def _alone_env() -> dict[str, str]:
    """The environment of a process that does not import this package (so no Python plugin is registered)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_aot_engine_runs_in_a_process_without_the_plugin(trt, plugins, tmp_path):
    spec = SPECS["llama"]
    engine, _ = _build(trt, _model(spec, "bfloat16", (64, 4096)), plugins["aot"].network_flag_bits(trt))
    feed = _feed(spec, "bfloat16", (64, 4096))
    (tmp_path / "model.engine").write_bytes(engine)
    torch.save(feed, tmp_path / "feed.pt")
    done = subprocess.run(
        [sys.executable, "-c", _RUN_ALONE, str(tmp_path / "model.engine"), str(tmp_path / "feed.pt"), str(tmp_path / "y.pt")],
        env=_alone_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "y.pt"), _run(trt, engine, feed).cpu())


def test_aot_engine_runs_under_trtexec(trt, plugins, tmp_path):
    exe = shutil.which("trtexec") or next((str(p) for p in Path("/usr/src/tensorrt/bin").glob("trtexec")), None)
    if exe is None:
        pytest.skip("needs trtexec (in NGC TensorRT images at /usr/src/tensorrt/bin)")
    engine, _ = _build(trt, _model(SPECS["gemma"], "float16", (16, 4096)), plugins["aot"].network_flag_bits(trt))
    path = tmp_path / "model.engine"
    path.write_bytes(engine)
    done = subprocess.run([exe, f"--loadEngine={path}", "--shapes=x:16x4096", "--iterations=10"], env=_alone_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


_BUILD_WITHOUT_PLUGIN = """
import sys, onnx, tensorrt as trt
logger = trt.Logger(trt.Logger.WARNING)
builder = trt.Builder(logger)
flags = 0
if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
    flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
network = builder.create_network(flags)
parser = trt.OnnxParser(network, logger)
assert parser.parse(open(sys.argv[1], "rb").read()), [str(parser.get_error(i)) for i in range(parser.num_errors)]
types = {network.get_layer(i).type for i in range(network.num_layers)}
assert trt.LayerType.PLUGIN_V3 not in types and trt.LayerType.REDUCE in types, types
print("inlined")
"""


def test_without_the_plugin_tensorrt_inlines_the_function(trt, tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(_model(SPECS["llama"], "float16", (4, 256)).SerializeToString())
    done = subprocess.run([sys.executable, "-c", _BUILD_WITHOUT_PLUGIN, str(path)], env=_alone_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "inlined" in done.stdout, done.stderr[-3000:]

