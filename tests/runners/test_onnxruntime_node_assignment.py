"""Which provider runs each node, the option that refuses nodes off the requested provider, and
``onnxruntime.preload_dlls()`` before GPU sessions.

Real ONNX Runtime (CPU) for the counts; a fake ``onnxruntime`` module for what only a GPU build
shows (a node on the CPU while the session reports CUDA) and for the order of calls.
"""

from __future__ import annotations

import json
import sys
import types

import onnx
import pytest
from onnx import TensorProto, helper

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.errors import ProviderError
from rmsnorm_deploy.graph.onnx_file import save_onnx
from rmsnorm_deploy.graph.standalone import rmsnorm_model
from rmsnorm_deploy.runners.onnxruntime import RECORD_ASSIGNMENT, NodeAssignment, OnnxRuntimeRunner

ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'rmsnorm-deploy[onnxruntime]'")
CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"


# -- real ONNX Runtime, CPU ----------------------------------------------------------------------
@pytest.mark.parametrize("lowering", ["function", "ort", "inline"])
@pytest.mark.parametrize("shape", [(1, 1), (199, 7), (3, 760)], ids=lambda s: "x".join(map(str, s)))
def test_every_node_of_a_cpu_session_is_counted_on_cpu(lowering, shape):
    if not hasattr(ort.InferenceSession, "get_provider_graph_assignment_info"):
        pytest.skip(f"onnxruntime {ort.__version__} cannot report node assignment")
    model = rmsnorm_model(named_specs()["llama"], dtype="float32", shape=shape, lowering=lowering)
    with OnnxRuntimeRunner(model, ["cpu"], optimization="disable", require_all_nodes_on_provider=True) as runner:
        assignment = runner.node_assignment
    # optimizations off: ONNX Runtime runs the graph's nodes, functions expanded, Constants made initializers
    nodes = model.graph.node if lowering != "function" else model.functions[0].node
    expected = sum(n.op_type != "Constant" for n in nodes)
    assert assignment.counts == {"cpu": expected}
    assert {n.provider for n in assignment.nodes} == {CPU}


def test_validate_reports_nodes_per_provider(tmp_path, capsys):
    if not hasattr(ort.InferenceSession, "get_provider_graph_assignment_info"):
        pytest.skip(f"onnxruntime {ort.__version__} cannot report node assignment")
    path = save_onnx(rmsnorm_model(named_specs()["llama"], dtype="float16", shape=(3, 760)), tmp_path / "m.onnx")
    assert main(["validate", str(path), "--json", "--require-all-nodes-on-provider"]) == 0
    data = json.loads(capsys.readouterr().out)
    (counts,) = data["nodes_per_provider"].values()
    assert list(counts) == ["cpu"] and counts["cpu"] > 0
    assert main(["validate", str(path)]) == 0
    assert f"nodes per provider, onnxruntime[cpu]: {counts['cpu']} on cpu" in capsys.readouterr().out


# -- a fake onnxruntime: what a GPU build does ---------------------------------------------------
def _model() -> onnx.ModelProto:
    """x -> Shape (shape0, int64), x * x (mul_on_gpu), that * x (mul_on_cpu): names the fake assigns."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape0"),
             helper.make_node("Mul", ["x", "x"], ["a"], name="mul_on_gpu"),
             helper.make_node("Mul", ["a", "x"], ["y"], name="mul_on_cpu")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [2])]
    return helper.make_model(helper.make_graph(nodes, "g", [x], outs), opset_imports=[helper.make_opsetid("", 20)])


def _fake_ort(monkeypatch, assignment: dict[str, list[tuple[str, str]]] | None, *, preload: bool = True):
    """An ``onnxruntime`` whose sessions run on what was asked (plus CPU) and assign nodes as
    ``assignment`` says (provider -> [(node name, op type)]); ``None``: an ORT without the API."""
    calls: list[tuple] = []

    class SessionOptions:
        def __init__(self):
            self.entries = {}

        def add_session_config_entry(self, key, value):
            calls.append(("config", key, value))
            self.entries[key] = value

    class Subgraph:
        def __init__(self, ep, nodes):
            self.ep_name = ep
            self._nodes = [types.SimpleNamespace(name=n, op_type=op, domain="") for n, op in nodes]

        def get_nodes(self):
            return self._nodes

    class InferenceSession:
        def __init__(self, source, options, providers, enable_fallback):
            calls.append(("session", tuple(p for p, _ in providers)))
            self.options = options
            self.providers = [p for p, _ in providers] + ([CPU] if all(p != CPU for p, _ in providers) else [])

        def get_providers(self):
            return self.providers

    if assignment is not None:
        def get_provider_graph_assignment_info(self):
            if self.options.entries.get(RECORD_ASSIGNMENT) != "1":
                raise RuntimeError(f"{RECORD_ASSIGNMENT} must be set to 1")
            return [Subgraph(ep, nodes) for ep, nodes in assignment.items()]

        InferenceSession.get_provider_graph_assignment_info = get_provider_graph_assignment_info

    fake = types.ModuleType("onnxruntime")
    fake.__version__ = "1.31.1"
    fake.get_available_providers = lambda: [TRT, CUDA, CPU]
    fake.SessionOptions = SessionOptions
    fake.InferenceSession = InferenceSession
    fake.GraphOptimizationLevel = types.SimpleNamespace(ORT_DISABLE_ALL=0, ORT_ENABLE_BASIC=1, ORT_ENABLE_EXTENDED=2,
                                                        ORT_ENABLE_ALL=99)
    if preload:
        fake.preload_dlls = lambda *a, **k: calls.append(("preload_dlls",))
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    return calls


ON_GPU = {CUDA: [("mul_on_gpu", "Mul"), ("Memcpy_token_1", "MemcpyToHost")],
          CPU: [("shape0", "Shape"), ("mul_on_cpu", "Mul"), ("fused_norm", "SimplifiedLayerNormalization")]}


def test_a_compute_node_on_the_cpu_under_cuda_is_refused_by_name(monkeypatch):
    _fake_ort(monkeypatch, ON_GPU)
    with pytest.raises(ProviderError) as err:
        OnnxRuntimeRunner(_model(), ["cuda"], require_all_nodes_on_provider=True).activate()
    text = str(err.value)
    assert text.startswith("2 of 5 nodes run outside the requested provider(s) cuda: mul_on_cpu (Mul) on cpu; "
                           "fused_norm (SimplifiedLayerNormalization) on cpu;")
    # a shape op on the CPU (ONNX Runtime's choice) and a device copy are not compute nodes
    assert "shape0" not in text and "Memcpy" not in text


def test_without_the_option_the_node_assignment_is_reported_not_refused(monkeypatch):
    _fake_ort(monkeypatch, ON_GPU)
    with OnnxRuntimeRunner(_model(), ["cuda"]) as runner:
        assert runner.node_assignment.counts == {"cpu": 3, "cuda": 2}
        assert runner.node_assignment.describe() == "3 on cpu, 2 on cuda"
        assert [n.name for n in runner.node_assignment.off_providers([CUDA], _model())] == ["mul_on_cpu", "fused_norm"]


def test_all_compute_nodes_on_the_requested_providers_pass(monkeypatch):
    _fake_ort(monkeypatch, {TRT: [("mul_on_gpu", "Mul")], CUDA: [("mul_on_cpu", "Mul")], CPU: [("shape0", "Shape")]})
    with OnnxRuntimeRunner(_model(), ["tensorrt", "cuda"], require_all_nodes_on_provider=True) as runner:
        assert runner.node_assignment.counts == {"cpu": 1, "cuda": 1, "tensorrt": 1}


def test_an_onnxruntime_that_cannot_report_node_assignment_cannot_require_it(monkeypatch):
    _fake_ort(monkeypatch, None)
    with pytest.raises(ProviderError, match=r"onnxruntime 1.31.1 cannot report which provider runs each node"):
        OnnxRuntimeRunner(_model(), ["cuda"], require_all_nodes_on_provider=True).activate()
    with OnnxRuntimeRunner(_model(), ["cuda"]) as runner:
        assert runner.node_assignment is None


def test_a_node_of_unknown_type_is_never_excused():
    assignment = NodeAssignment((types.SimpleNamespace(name="x", op_type="Gather", domain="", provider=CPU),))
    assert assignment.off_providers([CUDA]) == list(assignment.nodes)


# -- preload_dlls ------------------------------------------------------------------------------
@pytest.mark.parametrize("providers", [["cuda"], ["tensorrt", "cuda"], ["tensorrt"]])
def test_preload_dlls_is_called_before_a_gpu_session(monkeypatch, providers):
    calls = _fake_ort(monkeypatch, {CUDA: [("mul_on_gpu", "Mul")]})
    with OnnxRuntimeRunner(_model(), providers):
        pass
    kinds = [c[0] for c in calls]
    assert kinds.count("preload_dlls") == 1 and kinds.index("preload_dlls") < kinds.index("session")


def test_a_cpu_session_does_not_preload_cuda_libraries(monkeypatch):
    calls = _fake_ort(monkeypatch, {CPU: [("mul_on_gpu", "Mul")]})
    with OnnxRuntimeRunner(_model(), ["cpu"]):
        pass
    assert ("preload_dlls",) not in calls and ("session", (CPU,)) in calls


def test_an_onnxruntime_without_preload_dlls_still_starts_a_gpu_session(monkeypatch):
    calls = _fake_ort(monkeypatch, {CUDA: [("mul_on_gpu", "Mul")]}, preload=False)
    with OnnxRuntimeRunner(_model(), ["cuda"]) as runner:
        assert runner.actual_providers == [CUDA, CPU]
    assert ("session", (CUDA,)) in calls


def test_the_fake_model_is_valid():
    onnx.checker.check_model(_model(), full_check=True)
