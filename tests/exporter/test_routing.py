"""Routing ties: a failed parity of a graph that routes with TopK, told apart from a real difference.

A toy mixture of experts (a router ``Linear``, top-1, one matrix per expert) runs in PyTorch
and as a hand-written ONNX graph. Making the router's rows 0 and 1 equal in the graph, and
row 1 one float32 ulp larger in PyTorch, puts every token on a near-tie that the two sides
break differently (ONNX ``TopK`` takes the lower index on equal scores): the pattern of
Mixtral's float16 and JetMoE's float32 parity failures, in a model that exports in no time.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.exporter.routing import TopKRecorder, diagnose_routing

pytest.importorskip("onnxruntime", reason="the routing diagnosis runs ONNX Runtime CPU")
from rmsnorm_deploy.exporter.parity import ROUTING_TIE, compare_with_onnxruntime, torch_expectations  # noqa: E402
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402

HIDDEN, EXPERTS = 4, 3


class ToyMoE(torch.nn.Module):
    def __init__(self, router: np.ndarray, experts: np.ndarray):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.router.weight.data = torch.from_numpy(router)
        self.experts = torch.nn.Parameter(torch.from_numpy(experts))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x.to(self.experts.dtype)  # float64 in the parity check's float64 run
        _, idx = torch.topk(self.router(x), 1, dim=-1)
        return {"y": torch.einsum("ti,tio->to", x, self.experts[idx[:, 0]])}


def _weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    router = rng.uniform(0.5, 1.0, (EXPERTS, HIDDEN)).astype(np.float32)
    router[2] *= 0.25  # expert 2 never wins: the tie is between 0 and 1
    router[1] = router[0]
    return router, rng.normal(size=(EXPERTS, HIDDEN, HIDDEN)).astype(np.float32)


def _graph(path, router: np.ndarray, experts: np.ndarray) -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "router_t"], ["scores"], name="router"),
        helper.make_node("TopK", ["scores", "k"], ["top", "idx"], name="model.moe.router/TopK", axis=-1),
        helper.make_node("Squeeze", ["idx", "axis1"], ["idx1"]),
        helper.make_node("Gather", ["experts", "idx1"], ["w"], axis=0),
        helper.make_node("Unsqueeze", ["x", "axis1"], ["x3"]),
        helper.make_node("MatMul", ["x3", "w"], ["y3"]),
        helper.make_node("Squeeze", ["y3", "axis1"], ["y"]),
    ]
    inits = [numpy_helper.from_array(router.T.copy(), "router_t"), numpy_helper.from_array(experts, "experts"),
             numpy_helper.from_array(np.array([1], np.int64), "k"), numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    graph = helper.make_graph(nodes, "toy_moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", HIDDEN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["t", HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _one_ulp_up(row: np.ndarray) -> np.ndarray:
    return np.nextafter(row, np.float32(np.inf)).astype(np.float32)


def _case(tmp_path, *, graph_experts_off: bool = False, graph_router_off: bool = False):
    """The ONNX graph (ties broken towards expert 0) and PyTorch's module (towards expert 1)."""
    router, experts = _weights()
    torch_router = router.copy()
    torch_router[1] = _one_ulp_up(router[1])  # PyTorch's scores for expert 1: ~1 ulp above expert 0's
    graph_router, graph_experts = router.copy(), experts.copy()
    if graph_experts_off:
        graph_experts[1] += 0.5  # a real defect in the expert PyTorch routes to
    if graph_router_off:
        graph_router[2] = 4.0  # a real defect in the router: expert 2 now wins in the graph
    path = tmp_path / "model.onnx"
    _graph(path, graph_router, graph_experts)
    x = torch.from_numpy(np.random.default_rng(1).uniform(0.1, 1.0, (5, HIDDEN)).astype(np.float32))
    return path, ToyMoE(torch_router, experts), {"x": x}


def _diagnose(path, module, feed):
    with torch.no_grad(), TopKRecorder() as recorder:
        out = module(**feed)
    np_feed = {k: v.numpy() for k, v in feed.items()}
    with OnnxRuntimeRunner(path, ["cpu"]) as runner:
        got = runner.infer(np_feed)
    return diagnose_routing(path, np_feed, got, out, recorder.calls, tolerance_for("model", "onnxruntime", "float32"),
                            dtype="float32")


def test_a_near_tie_broken_the_other_way_is_a_routing_tie(tmp_path):
    path, module, feed = _case(tmp_path)
    diagnosis = _diagnose(path, module, feed)
    assert diagnosis.verdict == "tie", diagnosis.describe()
    assert diagnosis.flips and all(f.torch_only == [1] and f.onnx_only == [0] for f in diagnosis.flips)
    assert all(f.margin_ulp <= 4 for f in diagnosis.flips), [f.margin_ulp for f in diagnosis.flips]
    assert all(c.passed for c in diagnosis.imposed) and diagnosis.imposed[0].max_abs < 1e-5
    text = diagnosis.describe()
    assert text.startswith("routing tie: the first of 1 TopK nodes to route differently is model.moe.router/TopK, scores row [")
    assert "torch chose expert(s) [1], ONNX Runtime [0]" in text and "the export is not at fault" in text


def test_a_wrong_expert_is_not_a_routing_tie(tmp_path):
    path, module, feed = _case(tmp_path, graph_experts_off=True)
    diagnosis = _diagnose(path, module, feed)
    assert diagnosis.verdict == "not a tie" and diagnosis.flips
    assert "with PyTorch's routing imposed, ONNX Runtime still differs: y [float32[5, 4]]: FAIL" in diagnosis.detail
    assert diagnosis.describe().startswith("not a routing tie: ")


def test_a_wrong_router_is_not_a_routing_tie(tmp_path):
    path, module, feed = _case(tmp_path, graph_router_off=True)
    diagnosis = _diagnose(path, module, feed)
    assert diagnosis.verdict == "not a tie"
    assert "the router scores differ beyond the tolerance: model.moe.router/TopK scores" in diagnosis.detail
    assert any(f.onnx_only == [2] for f in diagnosis.flips)


def test_a_graph_topk_without_a_pytorch_call_is_not_compared(tmp_path):
    path, module, feed = _case(tmp_path)
    with OnnxRuntimeRunner(path, ["cpu"]) as runner:
        got = runner.infer({"x": feed["x"].numpy()})
    diagnosis = diagnose_routing(path, {"x": feed["x"].numpy()}, got, module(**feed), [],
                                 tolerance_for("model", "onnxruntime", "float32"), dtype="float32")
    assert diagnosis.verdict == "not compared" and not diagnosis.tie
    assert diagnosis.describe() == ("routing not compared: TopK node 0 of the graph (scores [5, 3], k 1) matches none "
                                    "of PyTorch's 0 topk/sort calls left in order")
    unrecorded = diagnose_routing(path, {"x": feed["x"].numpy()}, got, module(**feed), None,
                                  tolerance_for("model", "onnxruntime", "float32"), dtype="float32")
    assert unrecorded.verdict == "not compared" and "were not recorded" in unrecorded.detail


def test_parity_reports_a_routing_tie_as_such_and_never_as_a_pass(tmp_path):
    path, module, feed = _case(tmp_path)
    expected = torch_expectations(module, [], [feed], dtype="float32")
    parity = compare_with_onnxruntime(path, expected, dtype="float32")
    assert parity.status == ROUTING_TIE and parity.failed
    assert parity.reason.startswith("input 5 x 4: routing tie: the first of 1 TopK nodes")
    assert "Before imposing the routing: onnxruntime[cpu] vs float64: y [float32[5, 4]]: FAIL" in parity.reason
    assert parity.to_dict()["routing"][0]["verdict"] == "tie"
    assert "parity: ROUTING TIE: input 5 x 4: routing tie" in parity.table()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # the diagnosis' copies are removed


def test_parity_of_a_real_difference_stays_a_failure_and_says_why(tmp_path):
    path, module, feed = _case(tmp_path, graph_experts_off=True)
    parity = compare_with_onnxruntime(path, torch_expectations(module, [], [feed], dtype="float32"), dtype="float32")
    assert parity.status == "FAIL"
    assert parity.reason.startswith("onnxruntime[cpu] vs float64: y [float32[5, 4]]: FAIL")
    assert "; input 5 x 4: not a routing tie: " in parity.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_recorder_records_topk_and_sort(dtype):
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    with TopKRecorder() as recorder:
        _, small = torch.topk(x, 2, dim=0, largest=False)
        _, order = torch.sort(x[0], descending=True)
        torch.argsort(torch.tensor([3, 1, 2]), stable=True)
    top, srt, ints = recorder.calls
    assert (top.k, top.axis, top.largest, top.scores.shape) == (2, 0, False, (3, 7))
    assert np.array_equal(top.indices, small.numpy()) and top.dtype == str(dtype).replace("torch.", "")
    assert np.array_equal(top.scores.astype(np.float32), x.float().numpy())
    assert (srt.k, srt.axis, srt.largest) == (7, 0, True) and np.array_equal(srt.indices, order.numpy())
    assert (ints.k, ints.largest, ints.dtype) == (3, False, "int64")
    assert recorder.complete


def test_parity_uses_the_calls_recorded_with_precomputed_outputs(tmp_path):
    """The export computes the first feed's outputs once, recording its topk calls there: they
    must reach the diagnosis; outputs given without their calls leave the routing uncompared."""
    path, module, feed = _case(tmp_path)
    with torch.no_grad(), TopKRecorder() as recorder:
        out = module(**feed)
    given = torch_expectations(module, [], [feed], dtype="float32", torch_outputs=[out], torch_topk=[recorder.calls])
    assert given[0].topk is recorder.calls
    assert compare_with_onnxruntime(path, given, dtype="float32").status == ROUTING_TIE
    missing = torch_expectations(module, [], [feed], dtype="float32", torch_outputs=[out])
    parity = compare_with_onnxruntime(path, missing, dtype="float32")
    assert parity.status == "FAIL" and "routing not compared: PyTorch's topk calls were not recorded" in parity.reason


def test_a_large_model_file_is_not_copied(tmp_path, monkeypatch):
    from rmsnorm_deploy.exporter import routing

    path, module, feed = _case(tmp_path)
    monkeypatch.setattr(routing, "COPY_LIMIT_BYTES", 16)
    diagnosis = _diagnose(path, module, feed)
    assert diagnosis.verdict == "not compared" and "it is not copied for the diagnosis" in diagnosis.detail


def test_a_tie_of_masked_scores_has_margin_zero():
    """DeepSeek-V3.2's indexer takes top-k over causally masked scores: -inf ties (margin 0, not NaN)."""
    from rmsnorm_deploy.exporter.routing import TopKCall, _flips

    scores = np.array([[0.5, -np.inf, -np.inf, -np.inf]], np.float32)
    call = TopKCall(scores, np.array([[0, 3]]), k=2, axis=1, largest=True, dtype="float32")
    (flip,) = _flips("indexer/TopK", call, np.array([[0, 1]]), scores.copy())
    assert (flip.torch_only, flip.onnx_only, flip.margin, flip.margin_ulp, flip.runtimes_differ) == ([3], [1], 0, 0, 0)
