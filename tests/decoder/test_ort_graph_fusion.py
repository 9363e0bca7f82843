"""What ONNX Runtime runs for the ``--target onnxruntime`` decoder graph: the residual ``Add``
folded into ``SkipSimplifiedLayerNormalization`` under the ``ort`` lowering (numerics checked
against the float64 oracle and transformers), and a lean left-padding prelude."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from rmsnorm_deploy.contract.compare import compare  # noqa: E402
from rmsnorm_deploy.contract.inputs import activations, gain_weights  # noqa: E402
from rmsnorm_deploy.contract.reference import oracle  # noqa: E402
from rmsnorm_deploy.contract.spec import RMSNormSpec  # noqa: E402
from rmsnorm_deploy.contract.tolerances import tolerance_for  # noqa: E402
from rmsnorm_deploy.exporter import hf  # noqa: E402
from rmsnorm_deploy.decoder.ort_graph import build_decoder  # noqa: E402
from rmsnorm_deploy.decoder.ort_model import MS_DOMAIN, SKIP_NORM_OP, skip_norm_node, skip_refusal  # noqa: E402
from rmsnorm_deploy.decoder.ort_parity import audit_norms, decode_parity  # noqa: E402
from rmsnorm_deploy.graph.audit import audit_model  # noqa: E402
from rmsnorm_deploy.runners.onnxruntime import optimized_graph  # noqa: E402
from rmsnorm_deploy.graph.function import is_rmsnorm_node  # noqa: E402
from rmsnorm_deploy.decoder.ort_step import KVDecoderRunner  # noqa: E402
from rmsnorm_deploy.decoder.transformers_step import transformers_generate  # noqa: E402
from tests.kv_models import random_left_padded  # noqa: E402

LAYERS = hf.TINY_CONFIGS["llama"].get("num_hidden_layers", 2)


@pytest.fixture(scope="module")
def llama():
    return hf.from_config(hf.TINY_CONFIGS["llama"], "float32", seed=0)


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def _session_options(optimized: str | None = None):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if optimized:
        so.optimized_model_filepath = optimized
    return so


# -- the fused residual norm --------------------------------------------------------------
def test_ort_lowering_folds_every_residual_add_into_the_skip_norm(llama):
    """Every norm after a residual (both norms of each layer but the first, and the final one) is
    one SkipSimplifiedLayerNormalization in the graph ONNX Runtime runs; no residual Add is left."""
    dec = build_decoder(llama, lowering="ort")
    written = _ops(dec.model)
    assert written[SKIP_NORM_OP] == 2 * LAYERS
    assert written["SimplifiedLayerNormalization"] == 1  # layer 0's input norm has no residual before it
    assert not any(n.op_type == "Add" and "residual" in n.name for n in dec.model.graph.node)
    optimized = _ops(optimized_graph(dec.model))
    assert optimized[SKIP_NORM_OP] == 2 * LAYERS
    assert optimized["Add"] <= 1  # the prelude's index arithmetic only
    # The audit finds every norm, as a float32 reduction, and ties none to a wrong epsilon.
    assert audit_norms(dec.model, dec.norm_nodes) == dec.norm_nodes == 2 * LAYERS + 1
    eps = [r.epsilon for r in audit_model(dec.model) if r.kind.startswith("RMSNorm")]
    assert eps == pytest.approx([llama.module.model.config.rms_norm_eps] * (2 * LAYERS + 1), rel=1e-6)


def test_function_lowering_keeps_our_nodes_and_onnxruntime_does_not_fuse_their_add(llama):
    """The default graph keeps every norm our exact node; ONNX Runtime 1.32 fuses each body into
    SimplifiedLayerNormalization but never folds the residual Add into it (its SkipLayerNormFusion
    matches LayerNormalization only), which is why the ort lowering writes the fused op itself."""
    dec = build_decoder(llama)
    assert sum(is_rmsnorm_node(n) for n in dec.model.graph.node) == 2 * LAYERS + 1
    optimized = _ops(optimized_graph(dec.model))
    assert optimized["SimplifiedLayerNormalization"] == 2 * LAYERS + 1
    assert optimized[SKIP_NORM_OP] == 0, "ONNX Runtime now fuses the residual Add itself: revisit skip_refusal"


def _skip_model(spec: RMSNormSpec, hidden: int) -> onnx.ModelProto:
    node = skip_norm_node(spec, ["x", "skip", "w"], ["y", "sum"], name="norm")
    graph = helper.make_graph(
        [node], "skip-norm",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["rows", hidden]) for n in ("x", "skip")]
        + [helper.make_tensor_value_info("w", TensorProto.FLOAT, [hidden])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["rows", hidden]) for n in ("y", "sum")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("rows", [1, 199])
@pytest.mark.parametrize("hidden", [1, 7, 760])
def test_skip_norm_kernel_within_norm_tolerance_of_float64_oracle(rows, hidden):
    """The fused kernel's sum is the float32 Add exactly, and its norm of that sum is within the
    float32 norm tolerance of the spec's float64 oracle."""
    spec = RMSNormSpec(epsilon=1e-6, gain="weight", order="cast_then_scale")
    assert skip_refusal(spec, "float32") is None
    x = activations((rows, hidden), np.float32, seed=1)
    skip = activations((rows, hidden), np.float32, seed=2)
    w = gain_weights((hidden,), np.float32, "weight")
    sess = ort.InferenceSession(_skip_model(spec, hidden).SerializeToString(), _session_options(),
                                providers=["CPUExecutionProvider"])
    y, total = sess.run(["y", "sum"], {"x": x, "skip": skip, "w": w})
    np.testing.assert_array_equal(total, x + skip)
    expected = oracle(spec, torch.from_numpy(x + skip), torch.from_numpy(w)).numpy()
    result = compare(y, expected, tolerance_for("norm", "onnxruntime", "float32"), name="skip norm", dtype="float32")
    assert result.passed, result.summary()
    assert np.isfinite(y).all()


@pytest.mark.parametrize("spec, dtype, message", [
    (RMSNormSpec(gain="weight", order="scale_then_cast"), "float16", "normalizes the float32 sum of its inputs"),
    (RMSNormSpec(gain="offset"), "float32", "gain is 'offset'"),
    (RMSNormSpec(gain="none"), "float32", "gain is 'none'"),
    (RMSNormSpec(gain="weight", normalized_dims=2), "float32", "normalizes the last 2"),
    (RMSNormSpec(gain="weight", epsilon_placement="outside_sqrt"), "float32", "adds it outside"),
    (RMSNormSpec(gain="weight", order="cast_then_scale"), "float16", "rounds first"),
])
def test_skip_refusal_names_the_reason(spec, dtype, message):
    reason = skip_refusal(spec, dtype)
    assert reason is not None and message in reason


@pytest.mark.parametrize("batch, share_buffer", [(1, True), (3, False), (3, True)])
def test_ort_lowering_greedy_tokens_equal_generate_left_padded(llama, batch, share_buffer):
    """32 greedy tokens, rows left-padded by 0, 2 and 4: transformers' tokens."""
    dec = build_decoder(llama, lowering="ort", share_buffer=share_buffer, max_length=64)
    ids, mask = random_left_padded(batch, 9, llama.vocab_size, seed=5)
    got = KVDecoderRunner(dec.model).greedy(ids, mask, new_tokens=32)
    want = transformers_generate(llama.module.model, ids, mask, max_new_tokens=32, pad_token_id=0, stop_at_eos=False)
    np.testing.assert_array_equal(got.tokens, want)


def test_ort_lowering_step_logits_within_model_tolerance(llama):
    parity = decode_parity(llama, build_decoder(llama, lowering="ort").model, batch=3, prompt=7, steps=4)
    assert len(parity.results) == 5
    assert not parity.failed, parity.table()


# -- the left-padding prelude -------------------------------------------------------------
#: The index ops of the prelude and the rotation back: two Shapes, the chunk of the mask and its
#: valid count, the positions, the two rotations, the gathers, seqlens_k and the total length.
PRELUDE_BUDGET = 18  # 21 before the rotation was rewritten (Range, Squeeze, a Sub and an Add more)


@pytest.mark.parametrize("lowering", ["function", "ort"])
def test_prelude_is_lean(llama, lowering):
    """Nodes a step runs outside the layers, the final norm and the LM head: at most PRELUDE_BUDGET,
    no Range, no Squeeze, and the rotation back moves the hidden state, not the logits. Nodes of
    constants alone (the rotary tables) are folded when the session loads and are not counted."""
    dec = build_decoder(llama, lowering=lowering)
    layer_ops = {"MatMul", "GroupQueryAttention", "Split", "Sigmoid", "Mul", "RMSNorm", SKIP_NORM_OP,
                 "SimplifiedLayerNormalization"}
    constant = {i.name for i in dec.model.graph.initializer}
    for node in dec.model.graph.node:  # topological order
        if all(name in constant for name in node.input if name):
            constant.update(node.output)
    prelude = [n for n in dec.model.graph.node
               if "model.layers." not in n.name and n.op_type not in layer_ops and n.name != "embed/Gather"
               and not set(n.output) <= constant]
    ops = collections.Counter(n.op_type for n in prelude)
    assert not {"Range", "Squeeze", "Constant"} & set(ops), ops
    assert len(prelude) <= PRELUDE_BUDGET, ops
    producer = {o: n for n in dec.model.graph.node for o in n.output}["logits"]
    assert producer.op_type == "MatMul"
    weight = {i.name: i for i in dec.model.graph.initializer}[producer.input[1]]
    assert numpy_helper.to_array(weight).shape == (llama.module.model.config.hidden_size, llama.vocab_size)
