"""Placement on ONNX graphs written op by op: each rule, in every lowering, through Casts and
through ONNX Runtime's fused SkipSimplifiedLayerNormalization; the audit's contract findings
(a placement other than the metadata's, a LayerNorm standing for an RMSNorm)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.graph.audit import audit_model
from rmsnorm_deploy.graph.function import rmsnorm_node
from rmsnorm_deploy.graph.lowerings import lower_model
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.placement import (
    PLACEMENTS,
    contract_findings,
    graph_placements,
    mean_subtracting_findings,
)

H = 8
SPEC = RMSNormSpec.llama(1e-6)


class G:
    """A float32 graph from input ``x`` [batch, seq, H], its norms as our RMSNorm nodes."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def new(self, prefix: str = "t") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def op(self, op_type: str, *inputs: str, domain: str = "", outputs: int = 1, **attrs) -> str | list[str]:
        outs = [self.new() for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.new(op_type), domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def weight(self, *shape: int) -> str:
        name = self.new("w")
        rng = np.random.default_rng(self.n)
        self.inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
        return name

    def linear(self, x: str) -> str:
        return self.op("MatMul", x, self.weight(H, H))

    def norm(self, x: str, name: str) -> str:
        y = self.new("y")
        self.nodes.append(rmsnorm_node(SPEC, "float32", [x, self.weight(H)], [y], name=name))
        return y

    def attention(self, q: str, k: str, v: str) -> str:
        scores = self.op("MatMul", q, self.op("Transpose", k, perm=[0, 2, 1]))
        scale = numpy_helper.from_array(np.array(0.5, dtype=np.float32), self.new("c"))
        self.inits.append(scale)
        return self.op("MatMul", self.op("Softmax", self.op("Mul", scores, scale.name), axis=-1), v)

    def rotary(self, q: str) -> str:
        cos, sin = self.weight(H), self.weight(H)
        return self.op("Add", self.op("Mul", q, cos), self.op("Mul", self.op("Neg", q), sin))

    def model(self, output: str, *, opset: int = 18) -> onnx.ModelProto:
        self.nodes.append(helper.make_node("Identity", [output], ["logits"]))
        g = helper.make_graph(self.nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", H])],
                              [helper.make_tensor_value_info("logits", TP.FLOAT, None)], initializer=self.inits)
        domains = {n.domain for n in self.nodes if n.domain}
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]
                                  + [helper.make_opsetid(d, 1) for d in sorted(domains)])
        model.ir_version = 10
        return model


def pre_norm_lm(*, qk_norm: bool = True, value_norm: bool = True, cast_residual: bool = False) -> G:
    """Two pre-norm layers (q/k norms over the hidden size, a value norm, rotary on q and k), a final norm, a head."""
    g, h = G(), "x"
    for i in range(2):
        a = g.norm(h, f"layers.{i}.attn_norm")
        q, k, v = g.linear(a), g.linear(a), g.linear(a)
        if qk_norm:
            q, k = g.norm(q, f"layers.{i}.q_norm"), g.norm(k, f"layers.{i}.k_norm")
        if value_norm:
            v = g.norm(v, f"layers.{i}.v_norm")
        residual = g.op("Cast", h, to=TP.FLOAT) if cast_residual else h
        h = g.op("Add", residual, g.linear(g.attention(g.rotary(q), g.rotary(k), v)))
        f = g.norm(h, f"layers.{i}.ffn_norm")
        h = g.op("Add", h, g.linear(g.op("Relu", g.linear(f))))
    return g, g.linear(g.norm(h, "norm"))


PRE_NORM = {**{f"layers.{i}.{n}": p for i in range(2)
               for n, p in [("attn_norm", "pre"), ("q_norm", "qk"), ("k_norm", "qk"), ("v_norm", "other"),
                            ("ffn_norm", "pre")]}, "norm": "final"}


def post_norm_lm() -> tuple[G, str]:
    """``h = norm(h + f(h))`` three times, then a head: two ``post`` norms and the last one ``final``."""
    g, h = G(), "x"
    for i in range(3):
        h = g.norm(g.op("Add", h, g.linear(g.op("Relu", g.linear(h)))), f"layers.{i}.norm")
    return g, g.linear(h)


def sublayer_output_lm() -> tuple[G, str]:
    """OLMo2's block ``h = h + norm(f(h))`` twice, then a final norm and a head."""
    g, h = G(), "x"
    for i in range(2):
        q, k, v = g.linear(h), g.linear(h), g.linear(h)
        q, k = g.norm(q, f"layers.{i}.q_norm"), g.norm(k, f"layers.{i}.k_norm")
        h = g.op("Add", h, g.norm(g.linear(g.attention(q, k, v)), f"layers.{i}.post_attention_norm"))
        h = g.op("Add", h, g.norm(g.linear(g.op("Relu", g.linear(h))), f"layers.{i}.post_ffn_norm"))
    return g, g.linear(g.norm(h, "norm"))


SUBLAYER = {**{f"layers.{i}.{n}": p for i in range(2) for n, p in [
    ("q_norm", "qk"), ("k_norm", "qk"), ("post_attention_norm", "sublayer_output"),
    ("post_ffn_norm", "sublayer_output")]}, "norm": "final"}

#: lowering -> opset
LOWERING_OPSETS = {"function": 18, "inline": 18, "native": 23, "ort": 18}


@pytest.mark.parametrize("lowering", list(LOWERING_OPSETS))
@pytest.mark.parametrize("build, expected", [(pre_norm_lm, PRE_NORM), (post_norm_lm, {
    "layers.0.norm": "post", "layers.1.norm": "post", "layers.2.norm": "final"}),
    (sublayer_output_lm, SUBLAYER)], ids=["pre", "post", "sublayer_output"])
def test_each_rule_in_every_lowering(build, expected, lowering):
    g, out = build()
    model = g.model(out, opset=LOWERING_OPSETS[lowering])
    names = {n.output[0]: n.name for n in model.graph.node if n.op_type == "RMSNorm"}
    lowered = lower_model(model, lowering)
    assert graph_placements(lowered, names=names) == expected
    # without the names a norm is labelled by the audit (its node name, or in `inline` its reduction)
    placed = graph_placements(lowered)
    assert sorted(placed.values()) == sorted(expected.values())


def test_every_placement_is_documented():
    assert set(PRE_NORM.values()) | set(SUBLAYER.values()) | {"post"} == set(PLACEMENTS)


def test_casts_are_seen_through():
    g, out = pre_norm_lm(qk_norm=False, value_norm=False, cast_residual=True)
    placed = graph_placements(lower_model(g.model(out), "function"))
    assert placed == {"layers.0.attn_norm": "pre", "layers.0.ffn_norm": "pre", "layers.1.attn_norm": "pre",
                      "layers.1.ffn_norm": "pre", "norm": "final"}


def test_a_rotary_add_is_not_a_residual_add():
    """``q·cos + rot(q)·sin`` adds two activations; neither derives from the other, so a norm
    whose output only reaches it (and no softmax) is not ``sublayer_output``."""
    g = G()
    q = g.norm(g.linear("x"), "q_norm")
    placed = graph_placements(lower_model(g.model(g.linear(g.rotary(q))), "function"))
    assert placed == {"q_norm": "final"}  # it reaches the output through one weight: a head


def _skip(g: G, x: str, skip: str, name: str, *, sum_output: bool) -> tuple[str, str]:
    y, s = g.new("y"), (g.new("sum") if sum_output else "")
    g.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [x, skip, g.weight(H)], [y, "", "", s],
                                    name=name, domain="com.microsoft", epsilon=1e-6))
    return y, s


def test_through_onnx_runtime_skip_simplified_layer_normalization():
    """ONNX Runtime's transformers optimizer fuses ``norm(h + f(...))`` into one node whose fourth output
    is the residual sum: the next layer adds to that sum, so the fused norm is still ``pre``."""
    g = G()
    y0 = g.op("SimplifiedLayerNormalization", "x", g.weight(H), axis=-1, epsilon=1e-6)
    g.nodes[-1].name = "layers.0.attn_norm"
    y1, s1 = _skip(g, "x", g.linear(y0), "layers.0.ffn_norm", sum_output=True)
    y2, s2 = _skip(g, s1, g.linear(g.op("Relu", g.linear(y1))), "layers.1.attn_norm", sum_output=True)
    y3, _ = _skip(g, s2, g.linear(y2), "norm", sum_output=False)
    model = g.model(g.linear(y3))
    reductions = audit_model(model)
    assert [r.op for r in reductions] == ["SimplifiedLayerNormalization"] + ["SkipSimplifiedLayerNormalization"] * 3
    assert graph_placements(model, reductions) == {
        "layers.0.attn_norm": "pre", "layers.0.ffn_norm": "pre", "layers.1.attn_norm": "pre", "norm": "final"}


def _exported_like(build=pre_norm_lm, lowering="function") -> onnx.ModelProto:
    """A graph with the metadata our export writes: specs and the placements of the source."""
    g, out = build()
    model = g.model(out, opset=LOWERING_OPSETS[lowering])
    outputs = {n.name: n.output[0] for n in model.graph.node if n.op_type == "RMSNorm"}
    expected = PRE_NORM if build is pre_norm_lm else SUBLAYER
    model = lower_model(model, lowering)
    ModelMetadata(specs={k: SPEC for k in outputs}, lowering=lowering, dtype="float32",
                  placements={k: {"placement": expected[k], "output": v} for k, v in outputs.items()}).write(model)
    return model


@pytest.mark.parametrize("lowering", ["function", "inline"])
def test_audit_names_our_norms_and_agrees_with_the_metadata(lowering, tmp_path, capsys):
    model = _exported_like(lowering=lowering)
    reductions = audit_model(model)
    assert contract_findings(model, reductions, ModelMetadata.read(model)) == []
    assert {r.node: r.placement for r in reductions} == PRE_NORM  # inline too: named by output tensor
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert main(["audit", str(path), "--optimization", "none", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["node"]: r["placement"] for r in data["reductions"]} == PRE_NORM and data["findings"] == []
    assert main(["audit", str(path), "--optimization", "none"]) == 0
    table = capsys.readouterr().out
    assert "placement" in table.splitlines()[0] and "sublayer_output" not in table
    assert sum(" pre " in line for line in table.splitlines()) == 4


def _rewire_first_residual(model: onnx.ModelProto, norm_output: str) -> None:
    """Make the residual add after a pre-norm add the normalized value instead of the bypassed input."""
    norm = next(n for n in model.graph.node if norm_output in n.output)
    x = norm.input[0]
    add = next(n for n in model.graph.node if n.op_type == "Add" and x in n.input and n is not norm)
    add.input[list(add.input).index(x)] = norm_output


def test_audit_fails_a_graph_that_places_a_norm_elsewhere_than_its_source(tmp_path, capsys):
    model = _exported_like()
    meta = ModelMetadata.read(model)
    _rewire_first_residual(model, meta.placements["layers.1.ffn_norm"]["output"])
    findings = contract_findings(model, audit_model(model), meta)
    assert [(f.level, f.norm) for f in findings] == [("error", "layers.1.ffn_norm")]
    assert "places it 'post', the source model 'pre'" in findings[0].message
    path = tmp_path / "edited.onnx"
    onnx.save(model, str(path))
    assert main(["audit", str(path), "--optimization", "none"]) == 1
    assert "error: norm layers.1.ffn_norm: the graph places it 'post', the source model 'pre'" in capsys.readouterr().out


def _layer_norm(model: onnx.ModelProto, norm_name: str, bias: np.ndarray | None) -> None:
    """Replace our node ``norm_name`` by a LayerNormalization writing the same tensor."""
    i, node = next((i, n) for i, n in enumerate(model.graph.node) if n.name == norm_name)
    inputs = [node.input[0], node.input[1]]
    if bias is not None:
        model.graph.initializer.append(numpy_helper.from_array(bias.astype(np.float32), "ln_bias"))
        inputs.append("ln_bias")
    model.graph.node.remove(node)
    model.graph.node.insert(i, helper.make_node("LayerNormalization", inputs, list(node.output), name=norm_name,
                                                axis=-1, epsilon=1e-6))


def test_a_layer_norm_where_the_metadata_says_rmsnorm_fails_the_audit(tmp_path, capsys):
    model = _exported_like()
    _layer_norm(model, "layers.0.ffn_norm", np.zeros(H))
    findings = contract_findings(model, audit_model(model), ModelMetadata.read(model))
    assert [(f.level, f.norm) for f in findings] == [("error", "layers.0.ffn_norm")]
    assert "subtracts the mean where the model's metadata says RMSNorm" in findings[0].message
    path = tmp_path / "swapped.onnx"
    onnx.save(model, str(path))
    assert main(["audit", str(path), "--optimization", "none"]) == 1
    assert "RMSNorm is not LayerNorm" in capsys.readouterr().out


@pytest.mark.parametrize("bias, flagged", [(None, "has no bias"), (np.zeros(H), "has an all-zero bias"),
                                           (np.full(H, 0.1), None)], ids=["absent", "zero", "nonzero"])
def test_a_third_party_layer_norm_with_zero_bias_is_a_warning(bias, flagged, tmp_path, capsys):
    g, out = pre_norm_lm(qk_norm=False, value_norm=False)
    model = lower_model(g.model(out), "function")
    _layer_norm(model, "norm", bias)
    reductions = audit_model(model)
    findings = contract_findings(model, reductions, None)  # a third party's graph: no metadata
    assert findings == mean_subtracting_findings(model, reductions, None)
    if flagged is None:
        assert findings == []
    else:
        assert [(f.level, f.norm) for f in findings] == [("warning", "norm")] and flagged in findings[0].message
        assert "may be a substituted RMSNorm" in findings[0].message
    path = tmp_path / "third_party.onnx"
    onnx.save(model, str(path))
    assert main(["audit", str(path), "--optimization", "none"]) == 0  # a warning, not a failure
    out = capsys.readouterr().out
    assert ("warning: norm norm: LayerNormalization" in out) == (flagged is not None)
    assert next(r for r in reductions if r.node == "norm").placement == "final"  # placed like any norm


def test_zero_bias_read_from_external_data(tmp_path):
    g, out = pre_norm_lm(qk_norm=False, value_norm=False)
    model = lower_model(g.model(out), "function")
    _layer_norm(model, "norm", np.zeros(H))
    path = tmp_path / "ext.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="ext.data", size_threshold=0)
    loaded = onnx.load(str(path), load_external_data=False)
    findings = mean_subtracting_findings(loaded, audit_model(loaded), None, base_dir=tmp_path)
    assert [f.level for f in findings] == ["warning"]
    assert mean_subtracting_findings(loaded, audit_model(loaded), None, base_dir=tmp_path / "elsewhere") == []


@pytest.mark.parametrize("op_type, domain", [("GroupQueryAttention", "com.microsoft"),
                                             ("MultiHeadAttention", "com.microsoft"), ("Attention", "")])
def test_fused_attention_ops_take_queries_and_keys_at_inputs_0_and_1(op_type, domain):
    """onnxruntime-genai's builder style: q/k norms feed a fused attention op (after a reshape); a norm
    of the values feeds it too, at input 2, and is ``other``."""
    g = G()
    y0, s0 = _skip(g, "x", g.linear("x"), "layers.0.attn_norm", sum_output=True)
    q, k = g.norm(g.linear(y0), "layers.0.q_norm"), g.norm(g.linear(y0), "layers.0.k_norm")
    v = g.norm(g.linear(y0), "layers.0.v_norm")
    shape = numpy_helper.from_array(np.array([0, 0, H], dtype=np.int64), "shape")
    g.inits.append(shape)
    attn = g.op(op_type, g.op("Reshape", q, "shape"), g.op("Reshape", k, "shape"), v, domain=domain)
    y1, _ = _skip(g, s0, g.linear(attn), "norm", sum_output=False)
    model = g.model(g.linear(y1), opset=23 if not domain else 18)
    placed = graph_placements(lower_model(model, "function"))
    assert placed == {"layers.0.attn_norm": "pre", "layers.0.q_norm": "qk", "layers.0.k_norm": "qk",
                      "layers.0.v_norm": "other", "norm": "final"}


@pytest.mark.parametrize("value", ['"pre"', '{"norm": "pre"}', '{"norm": {"placement": 1, "output": "y"}}', "{"])
def test_damaged_placements_metadata_is_a_one_line_error(value, tmp_path, capsys):
    """Our own metadata is input too: placements that are not ``{name: {placement, output}}`` stop the audit."""
    model = _exported_like()
    next(p for p in model.metadata_props if p.key == "rmsnorm_deploy.placements").value = value
    path = tmp_path / "damaged.onnx"
    onnx.save(model, str(path))
    assert main(["audit", str(path), "--optimization", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metadata is damaged" in err


def test_a_layer_norm_between_a_norm_and_the_head_is_a_norm():
    """The same model as tests/exporter/test_placement.py's LayerNorm case, on the graph side: ``other``."""
    g = G()
    y = g.norm("x", "rms")
    ln = g.op("LayerNormalization", y, g.weight(H), g.weight(H), axis=-1, epsilon=1e-5)
    placed = graph_placements(lower_model(g.model(g.linear(ln)), "function"))
    assert placed["rms"] == "other" and sorted(placed.values()) == ["final", "other"]
