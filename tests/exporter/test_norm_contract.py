"""The static contract of a graph's norms against the source module's (``exporter.norm_contract``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import helper, numpy_helper

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.exporter.detect import detect_norms
from rmsnorm_deploy.exporter.norm_contract import check_norm_contract
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.function import DOMAIN, DOMAIN_VERSION, rmsnorm_node
from rmsnorm_deploy.graph.lowerings import lower_model
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.standalone import ir_version_for

HIDDEN = 16


class SourceModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.RMSNorm(HIDDEN, eps=1e-5)
        self.b = torch.nn.RMSNorm(HIDDEN, eps=1e-5)
        with torch.no_grad():
            self.a.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN))
            self.b.weight.copy_(torch.linspace(1.5, 0.5, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _graph(source: SourceModel, specs: dict[str, RMSNormSpec], gains: dict[str, np.ndarray] | None = None):
    """A float32 graph of the norms ``specs`` names, one after the other, their gains the source's
    unless ``gains`` says otherwise."""
    gains = gains or {}
    nodes, inits, current = [], [], "x"
    for name, spec in specs.items():
        weight = gains.get(name, getattr(source, name).weight.detach().numpy())
        inits.append(numpy_helper.from_array(weight.astype(np.float32), f"{name}.weight"))
        nodes.append(rmsnorm_node(spec, "float32", [current, f"{name}.weight"], [f"{name}.out"], name=name))
        current = f"{name}.out"
    value = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "norms", [value("x", 1, ["n", HIDDEN])], [value(current, 1, ["n", HIDDEN])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])
    model.ir_version = ir_version_for(model.opset_import)
    return lower_model(model, "function")


def _contract(model, meta_specs: dict[str, RMSNormSpec], source: SourceModel):
    meta = ModelMetadata(specs=meta_specs, lowering="function", dtype="float32")
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return check_norm_contract(audit_model(model), meta, detect_norms(source), inits)


@pytest.fixture
def source() -> SourceModel:
    return SourceModel()


def test_a_graph_that_is_its_source_has_no_mismatch(source):
    spec = RMSNormSpec.torch_rmsnorm(1e-5)
    contract = _contract(_graph(source, {"a": spec, "b": spec}), {"a": spec, "b": spec}, source)
    assert contract.compared == ["a", "b"] and contract.mismatches == [] and contract.notes == []


def test_each_field_of_each_norm_and_its_gain_are_compared(source):
    spec = RMSNormSpec.torch_rmsnorm(1e-5)
    wrong = RMSNormSpec(1e-2, gain="offset", order="cast_then_scale")
    gains = {"b": np.full(HIDDEN, 2.0, np.float32)}
    contract = _contract(_graph(source, {"a": wrong, "b": spec}, gains), {"a": spec, "b": spec}, source)
    messages = [m.message for m in contract.mismatches]
    for where in ("the metadata", "the checkpoint"):
        assert f"norm a: epsilon 0.01 in the graph, 1e-05 in {where}" in messages
        assert f"norm a: gain offset in the graph, weight in {where}" in messages
        assert f"norm a: order cast_then_scale in the graph, scale_then_cast in {where}" in messages
    assert any(m.startswith("norm a: gain values differ from the checkpoint's weight") for m in messages), messages
    assert any(m.startswith("norm b: gain values differ from the checkpoint's weight at 16 of 16 elements")
               for m in messages), messages
    assert {m.norm for m in contract.mismatches} == {"a", "b"}


def test_a_dropped_norm_and_an_added_one_are_named(source):
    spec = RMSNormSpec.torch_rmsnorm(1e-5)
    contract = _contract(_graph(source, {"a": spec}), {"a": spec}, source)
    assert [m.message for m in contract.mismatches] == ["norm b: in the checkpoint, not in the graph (a dropped norm)"]
    extra = _graph(source, {"a": spec, "b": spec})
    extra.graph.node[-1].name = "c"
    contract = _contract(extra, {"a": spec, "b": spec, "c": spec}, source)
    messages = [m.message for m in contract.mismatches]
    assert "norm c: in the graph, not in the checkpoint (an added norm)" in messages
    assert "norm b: in the checkpoint, not in the graph (a dropped norm)" in messages
    assert "norm c: in the metadata, not in the checkpoint" in messages
