"""The TensorRT build's network flags (STRONGLY_TYPED only where it means something, the plugin's
AOT/JIT choice honoured) and the runner's own CUDA stream, tested with fakes of the TensorRT
objects involved: the ``NetworkDefinitionCreationFlag`` enum (members are ints), ``Builder``, an
execution context; the real builds are in test_engines.py and test_plugin_trt.py (``trt``)."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest
import torch

from rmsnorm_deploy import RMSNormSpec, rmsnorm_model
from rmsnorm_deploy.cli import main
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.graph.onnx_file import save_onnx
from rmsnorm_deploy.tensorrt import build as build_module
from rmsnorm_deploy.graph.function import PLUGIN_VERSION
from rmsnorm_deploy.tensorrt import plugin as plugin_module
from rmsnorm_deploy.tensorrt.build import build_engine, network_flags
from rmsnorm_deploy.tensorrt.runtime import PluginError, describe_plugin

STRONGLY_TYPED, PREFER_AOT, PREFER_JIT = 0, 4, 5


def _trt(version: str, *, strongly_typed: bool = True, prefer: bool = True):
    """``tensorrt`` as far as the flags go: its version and ``NetworkDefinitionCreationFlag``."""
    members = {}
    if strongly_typed:
        members["STRONGLY_TYPED"] = STRONGLY_TYPED
    if prefer:
        members.update(PREFER_AOT_PYTHON_PLUGINS=PREFER_AOT, PREFER_JIT_PYTHON_PLUGINS=PREFER_JIT)
    return types.SimpleNamespace(__version__=version, NetworkDefinitionCreationFlag=types.SimpleNamespace(**members))


def _described(implementation: str) -> dict:
    """What ``runtime.register_plugin`` returns for this package's plugin with ``implementation``."""
    info = plugin_module.PluginInfo(
        plugin_module.PLUGIN_NAME, PLUGIN_VERSION, tuple(plugin_module.REGISTRATIONS), implementation,
        plugin_module._NETWORK_FLAGS[implementation], None, "10.9.0.34", "3.6.0")
    return describe_plugin(info)


@pytest.mark.parametrize("version, implementation, bits", [
    ("10.9.0.34", None, {STRONGLY_TYPED}),
    ("10.9.0.34", "aot", {STRONGLY_TYPED, PREFER_AOT}),
    ("10.9.0.34", "jit", {STRONGLY_TYPED, PREFER_JIT}),
    ("10.15.1.29", "jit", {STRONGLY_TYPED, PREFER_JIT}),
    ("11.1.0.106", None, set()),  # deprecated and ignored in 11: not set
    ("11.1.0.106", "aot", {PREFER_AOT}),
    ("11.1.0.106", "jit", {PREFER_JIT}),
])
def test_network_flags(version, implementation, bits):
    flags = network_flags(_trt(version), _described(implementation) if implementation else None)
    assert flags == sum(1 << b for b in bits)


def test_a_tensorrt_without_strongly_typed_is_not_an_attribute_error():
    assert network_flags(_trt("11.2.0.1", strongly_typed=False), None) == 0
    assert network_flags(_trt("10.9.0.34", strongly_typed=False), _described("aot")) == 1 << PREFER_AOT


def test_a_missing_preference_flag_is_an_error_not_another_implementation():
    with pytest.raises(PluginError, match=r"TensorRT 10.9.0.34 has no NetworkDefinitionCreationFlag."
                                          r"PREFER_JIT_PYTHON_PLUGINS, which the plugin's jit implementation needs"):
        network_flags(_trt("10.9.0.34", prefer=False), _described("jit"))


def test_the_plugin_description_keeps_its_network_flags_as_names():
    assert _described("jit")["network_flags"] == ["PREFER_JIT_PYTHON_PLUGINS"]
    assert _described("aot")["implementation"] == "aot"


@pytest.fixture()
def model_path(tmp_path):
    model = rmsnorm_model(RMSNormSpec.llama(), dtype="float16", shape=(3, 7), lowering="plugin")
    return save_onnx(model, tmp_path / "model.onnx")


@pytest.mark.parametrize("implementation", ["aot", "jit"])
def test_the_build_creates_the_network_with_the_implementation_asked_for(monkeypatch, model_path, implementation):
    """Up to ``create_network``, with TensorRT's pieces faked: the plugin is loaded with the
    implementation asked for and the network carries its flag (the build used to prefer AOT always)."""
    loaded, created = [], []

    class Stop(Exception):
        pass

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            created.append(flags)
            raise Stop

    trt = _trt("10.9.0.34")
    trt.Builder = Builder
    monkeypatch.setattr(build_module, "import_tensorrt", lambda feature: trt)
    monkeypatch.setattr(build_module, "make_logger", lambda trt: object())
    monkeypatch.setattr(build_module.Device, "current", classmethod(lambda cls, v: cls(v, "fake GPU", "9.0")))

    def register_plugin(library=None, *, implementation="aot"):
        loaded.append(implementation)
        return _described(implementation)

    monkeypatch.setattr(build_module, "register_plugin", register_plugin)
    with pytest.raises(Stop):
        build_engine(model_path, plugin=True, plugin_impl=implementation, progress=False)
    assert loaded == [implementation]
    prefer = PREFER_AOT if implementation == "aot" else PREFER_JIT
    assert created == [(1 << STRONGLY_TYPED) | (1 << prefer)]


def test_plugin_impl_needs_the_plugin_and_a_known_name(model_path, capsys):
    with pytest.raises(UserError, match="--plugin-impl jit chooses how the plugin runs; add --plugin"):
        build_engine(model_path, plugin_impl="jit")
    with pytest.raises(UserError, match="unknown plugin implementation 'cpp'; choose one of aot, jit"):
        build_engine(model_path, plugin=True, plugin_impl="cpp")
    assert main(["build", str(model_path), "--plugin-impl", "jit"]) == 2
    assert "--plugin-impl jit chooses how the plugin runs; add --plugin" in capsys.readouterr().err


# -- the runner's stream ------------------------------------------------------------------------
class _Stream:
    """A ``torch.cuda.Stream`` as the runner uses it: its handle, and synchronize()."""

    cuda_stream = 0x7F00BEEF

    def __init__(self, events):
        self.events = events

    def synchronize(self):
        self.events.append("synchronize")


class _Context:
    """An ``IExecutionContext`` for one input ``x`` and one output ``y`` of shape [3, 7]."""

    def __init__(self, events):
        self.events = events

    def set_input_shape(self, name, shape):
        return True

    def set_tensor_address(self, name, ptr):
        pass

    def get_tensor_shape(self, name):
        return (3, 7)

    def execute_async_v3(self, stream_handle):
        self.events.append(("execute", stream_handle))
        return True


def test_the_runner_runs_the_engine_on_its_own_stream(monkeypatch, tmp_path):
    from rmsnorm_deploy.tensorrt import runner as runner_module

    events: list = []
    stream = _Stream(events)

    @contextlib.contextmanager
    def on_stream(s):
        events.append(("enter", s))
        yield
        events.append(("exit", s))

    monkeypatch.setattr(runner_module, "_cuda_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(runner_module, "_on_stream", on_stream)
    runner = runner_module.TensorRTRunner(tmp_path / "model.engine")
    runner.context, runner.stream, runner.logger = _Context(events), stream, None
    runner.profiles = types.SimpleNamespace(inputs={})
    runner.io = {"x": {"input": True, "dtype": "float32", "shape": (3, 7), "profile": ((3, 7), (3, 7), (3, 7))},
                 "y": {"input": False, "dtype": "float32", "shape": (3, 7)}}
    runner.is_active = True
    out = runner.infer({"x": np.ones((3, 7), dtype=np.float32)})
    assert out["y"].shape == (3, 7)
    assert events == [("enter", stream), ("execute", _Stream.cuda_stream), "synchronize", ("exit", stream)]
    assert _Stream.cuda_stream != 0  # not the legacy default stream
