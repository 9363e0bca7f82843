"""The fused Triton kernel against the spec's reference and float64 oracle.

On a machine without a GPU the kernel runs in Triton's interpreter: ``conftest.py`` sets
``TRITON_INTERPRET=1`` before anything imports triton (Triton fixes the mode at import).
With a GPU the same tests run the compiled kernel on CUDA tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.cases import DTYPES, ODD_SHAPES

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.contract.inputs import activations
from rmsnorm_deploy.contract.reference import SpecRMSNorm, oracle, reference
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import InputError

pytest.importorskip("triton", reason="the kernel tests need triton (pip install 'rmsnorm-deploy[triton]')")

from rmsnorm_deploy.kernels.functional import rms_norm  # noqa: E402
from rmsnorm_deploy.kernels.module import TritonRMSNorm  # noqa: E402
from rmsnorm_deploy.kernels.triton_rmsnorm import (  # noqa: E402
    MAX_HIDDEN,
    launch_config,
    triton_interprets,
)

# With a GPU these tests run the compiled kernel on CUDA tensors: they belong to the GPU suite
# (`pytest -m "cuda or trt"`). Without one they run in the interpreter, in every suite.
pytestmark = [pytest.mark.cuda] if torch.cuda.is_available() else []
#: spec, weight dtype ("same" = the input's): every gain x order ...
GAINS_AND_ORDERS = {
    "torch": (RMSNormSpec.torch_rmsnorm(1e-6), "same"),
    "llama": (RMSNormSpec.llama(1e-6), "same"),
    "gemma": (RMSNormSpec.gemma(1e-6), "same"),
    "offset-cast_then_scale": (RMSNormSpec(1e-5, gain="offset", order="cast_then_scale"), "same"),
    "nogain": (RMSNormSpec(1e-6, gain="none"), None),
}
#: ... and the other choices: a float32 weight under half inputs, epsilon outside the
#: square root, float64 accumulation.
OTHER_CHOICES = {
    "llama-fp32-weight": (RMSNormSpec.llama(1e-5), "float32"),
    "eps-outside-sqrt": (RMSNormSpec(1e-5, order="cast_then_scale", epsilon_placement="outside_sqrt"), "same"),
    "acc-float64": (RMSNormSpec(1e-6, order="cast_then_scale", accumulation="float64"), "same"),
}
VARIANTS = {**GAINS_AND_ORDERS, **OTHER_CHOICES}
REPO = Path(__file__).resolve().parents[2]
#: the odd shapes, plus hidden 128 (several rows per program: per-head q/k norms)
SHAPES = ODD_SHAPES + [(1, 128), (199, 128)]
#: Triton's interpreter spends ~0.1 ms of Python per op per program: 199 rows of 4096 (199
#: programs) cost seconds, so the other choices skip that one shape (they run 1 x 4096).
CASES = [(v, s) for v in GAINS_AND_ORDERS for s in SHAPES] + [
    (v, s) for v in OTHER_CHOICES for s in SHAPES if s != (199, 4096)
]


@pytest.fixture(scope="module")
def device() -> str:
    """Where the kernel runs: the GPU, or the CPU through Triton's interpreter."""
    if torch.cuda.is_available():
        return "cuda"
    if not triton_interprets():
        pytest.fail("no GPU and Triton is not interpreting: TRITON_INTERPRET=1 must be set before triton is imported")
    return "cpu"


def _weight(spec: RMSNormSpec, weight_dtype: str | None, dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor | None:
    if weight_dtype is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    center = 0.0 if spec.gain == "offset" else 1.0
    w = center + 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
    return w.to(torch_dtype(dtype if weight_dtype == "same" else weight_dtype))


def _run(spec, x, w, device):
    y = rms_norm(spec, x.to(device), None if w is None else w.to(device))
    assert y.dtype == x.dtype and y.shape == x.shape
    return y.cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant, shape", CASES, ids=[f"{v}-{s[0]}x{s[1]}" for v, s in CASES])
def test_kernel_matches_oracle(variant, shape, dtype, device):
    """Random activations: within the tolerance table's bound of the float64 oracle."""
    spec, weight_dtype = VARIANTS[variant]
    x = torch.from_numpy(activations(shape, "float32", seed=shape[0] * 7 + shape[1])).to(torch_dtype(dtype))
    w = _weight(spec, weight_dtype, dtype, shape[-1:], seed=shape[1])
    y = _run(spec, x, w, device)
    result = compare(y, oracle(spec, x, w), tolerance_for("norm", "triton", dtype))
    assert result, result.summary()


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (199, 7), (7, 760), (3, 4096), (199, 128)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_bit_equal_to_reference_when_the_sum_is_exact(variant, dtype, shape, device):
    """Inputs k/8 (|k| <= 16): every partial sum of squares is exact in float32, so the
    order of the reduction cannot matter, and every other step rounds where the
    reference rounds: the outputs are bit-equal, in every dtype, spec and shape.

    One exception, from torch: on the CPU its float32 ``sqrt`` is not correctly rounded
    (sqrt(1.4268417) gives 1.1945047, the nearest float32 is 1.1945049), so with epsilon
    outside the square root, float32 outputs are held to the table's float32 bound there.
    """
    spec, weight_dtype = VARIANTS[variant]
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    x = (torch.randint(-16, 17, shape, generator=gen).to(torch.float32) / 8).to(torch_dtype(dtype))
    w = _weight(spec, weight_dtype, dtype, shape[-1:], seed=shape[1] + 1)
    y = _run(spec, x, w, device)
    expected = reference(spec, x, w)
    if spec.epsilon_placement == "outside_sqrt" and dtype == "float32":  # the reference runs on the CPU
        result = compare(y, expected, tolerance_for("norm", "triton", "float32"))
        assert result, result.summary()
        return
    differ = (y != expected).nonzero()
    assert differ.numel() == 0, f"{len(differ)} elements differ, first at {differ[0].tolist()}: {y[tuple(differ[0])]} != {expected[tuple(differ[0])]}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["torch", "llama", "gemma"])
def test_stress_inputs_stay_finite_and_exact(variant, dtype, device):
    """|x| from 300 to 60000 (squares overflow float16) and an all-zero row: finite, zeros, oracle-close."""
    spec, weight_dtype = VARIANTS[variant]
    x = torch.from_numpy(activations((9, 760), dtype, seed=3, kind="stress").astype("float32")).to(torch_dtype(dtype))
    w = _weight(spec, weight_dtype, dtype, (760,), seed=4)
    y = _run(spec, x, w, device)
    assert torch.isfinite(y).all()
    assert (y[1] == 0).all(), "an all-zero row must normalize to zeros"
    result = compare(y, oracle(spec, x, w), tolerance_for("norm", "triton", dtype))
    assert result, result.summary()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 = nan, as in torch
def test_nan_and_inf_propagate_as_in_the_reference(device):
    spec = RMSNormSpec.llama(1e-6)
    x = torch.ones(3, 7)
    x[0, 2] = float("nan")
    x[1, 5] = float("inf")
    w = torch.ones(7)
    y = _run(spec, x, w, device)
    expected = reference(spec, x, w)
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    assert torch.equal(y[2], expected[2])


def test_rows_per_program_does_not_change_the_numbers(device):
    """Packing rows (hidden 128) or not: every packing matches the oracle; in the interpreter,
    whose row sums do not depend on the packing, the bits are the same too (on a GPU the
    order of the float32 sum follows the thread layout)."""
    spec = RMSNormSpec.gemma(1e-6)
    x = torch.from_numpy(activations((37, 128), "float32", seed=5)).to(torch.bfloat16)
    w = _weight(spec, "same", "bfloat16", (128,), seed=6)
    outs = [rms_norm(spec, x.to(device), w.to(device), rows_per_program=r).cpu() for r in (1, 4, 64)]
    assert launch_config(128).rows_per_program > 1
    for out in outs:
        result = compare(out, oracle(spec, x, w), tolerance_for("norm", "triton", "bfloat16"))
        assert result, result.summary()
    if device == "cpu":
        assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize(
    "dtype, epsilon, gain",
    [("float16", 3e-6, 1.0004898309707642), ("bfloat16", 3e-6, 1.0039077997207642)],
)
def test_float64_accumulation_rounds_through_float32_like_torch(dtype, epsilon, gain, device):
    """torch converts float64 to float16/bfloat16 through float32 (two roundings). Here the
    float64 result lies just above the midpoint between 1 and the next half value, and its
    float32 rounding lands on that midpoint: a direct rounding gives the upper value, torch's
    gives 1.0 (ties to even). The kernel must give what the reference gives."""
    spec = RMSNormSpec(epsilon, gain="weight", order="scale_then_cast", accumulation="float64")
    x = torch.ones(1, 1, dtype=torch_dtype(dtype))
    w = torch.tensor([gain], dtype=torch.float32)
    expected = reference(spec, x, w)
    assert expected.item() == 1.0
    assert torch.equal(_run(spec, x, w, device), expected)


def test_the_largest_row(device):
    """65536 elements, the most a row may have (one program, 32 warps)."""
    spec = RMSNormSpec.gemma(1e-6)
    x = torch.from_numpy(activations((3, MAX_HIDDEN), "float32", seed=12)).to(torch.bfloat16)
    w = _weight(spec, "same", "bfloat16", (MAX_HIDDEN,), seed=13)
    assert launch_config(MAX_HIDDEN).rows_per_program == 1
    result = compare(_run(spec, x, w, device), oracle(spec, x, w), tolerance_for("norm", "triton", "bfloat16"))
    assert result, result.summary()


def test_leading_dims_and_several_normalized_dims(device):
    """[..., *normalized_shape] of any rank; normalized_dims=2 flattens the last two dims into a row."""
    spec = RMSNormSpec(1e-6, normalized_dims=2, gain="weight", order="cast_then_scale")
    x = torch.from_numpy(activations((2, 3, 5, 24), "float32", seed=7)).to(torch.float16)
    w = _weight(spec, "same", "float16", (5, 24), seed=8)
    y = _run(spec, x, w, device)
    result = compare(y, oracle(spec, x, w), tolerance_for("norm", "triton", "float16"))
    assert result, result.summary()


def test_non_contiguous_and_empty_inputs(device):
    spec = RMSNormSpec.torch_rmsnorm(1e-6)
    x = torch.from_numpy(activations((64, 9), "float32", seed=9)).t()  # [9, 64], rows not contiguous
    w = _weight(spec, "same", "float32", (64,), seed=10)
    y = _run(spec, x, w, device)
    assert compare(y, oracle(spec, x, w), tolerance_for("norm", "triton", "float32"))
    empty = _run(spec, torch.empty(0, 64), w, device)
    assert empty.shape == (0, 64)


def test_contiguous_inputs_reach_the_kernel_as_they_are(monkeypatch, device):
    """No reshaping view, detach or copy per call: at decode sizes a call's host time is most of its cost."""
    from rmsnorm_deploy.kernels import triton_rmsnorm

    seen = []
    monkeypatch.setattr(triton_rmsnorm, "launch_rows", lambda *args: seen.append(args))
    spec = RMSNormSpec.torch_rmsnorm(1e-6)
    x, w = torch.ones(2, 3, 8, device=device), torch.ones(8, device=device, requires_grad=True)
    out = torch.empty_like(x)
    assert rms_norm(spec, x, w, out=out) is out
    (_, rows, weight, y, n_rows, hidden, x_stride, y_stride, _), = seen
    assert rows is x and weight is w and y is out and (n_rows, hidden, x_stride, y_stride) == (6, 8, 8, 8)
    rms_norm(spec, x.transpose(0, 1), w)  # rows still contiguous, but not the tensor: one reshaped copy
    assert seen[1][1] is not x and seen[1][1].is_contiguous() and seen[1][4:8] == (6, 8, 8, 8)


def test_module_is_a_drop_in_for_spec_rmsnorm(device):
    reference_module = SpecRMSNorm(RMSNormSpec.gemma(1e-6), 96, dtype=torch.bfloat16)
    with torch.no_grad():
        reference_module.weight.copy_(torch.linspace(-0.5, 0.5, 96))
    weight = reference_module.weight.detach().clone()  # the oracle's, on the CPU
    kernel_module = TritonRMSNorm.from_module(reference_module).to(device)
    assert kernel_module.weight is reference_module.weight  # shared, so `.to(device)` moved both
    fresh = TritonRMSNorm(RMSNormSpec.gemma(1e-6), 96, dtype=torch.bfloat16)
    fresh.load_state_dict(reference_module.state_dict())
    x = torch.from_numpy(activations((5, 96), "float32", seed=11)).to(torch.bfloat16)
    y = kernel_module(x.to(device)).cpu()
    assert torch.equal(y, fresh.to(device)(x.to(device)).cpu())
    assert compare(y, oracle(reference_module.spec, x, weight), tolerance_for("norm", "triton", "bfloat16"))


def test_cpu_tensors_in_a_compiling_process_are_refused_with_the_fix():
    """A process that imported triton without TRITON_INTERPRET cannot run the kernel on CPU tensors."""
    code = (
        "import torch\n"
        "from rmsnorm_deploy import RMSNormSpec\n"
        "from rmsnorm_deploy.kernels.functional import rms_norm\n"
        "rms_norm(RMSNormSpec(gain='none'), torch.ones(2, 4))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "InputError: the Triton RMSNorm kernel runs on CUDA tensors; x is on cpu" in done.stderr
    assert "set TRITON_INTERPRET=1 before triton is first imported" in done.stderr


@pytest.mark.parametrize(
    "spec, x, w, message",
    [
        (RMSNormSpec.llama(), torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), "reads float32, float16, bfloat16; x is float64"),
        (RMSNormSpec.llama(), torch.ones(2, 8), None, "needs a weight of shape \\[8\\]"),
        (RMSNormSpec.llama(), torch.ones(2, 8), torch.ones(7), "weight has shape \\[7\\]; x's normalized dims are \\[8\\]"),
        (RMSNormSpec.llama(), torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.float16), "weight is float16; the kernel takes a weight in x's dtype \\(bfloat16\\) or float32"),
        (RMSNormSpec(gain="none"), torch.ones(2, 8), torch.ones(8), "takes no weight"),
        (RMSNormSpec(normalized_dims=2, gain="none"), torch.ones(8), None, "x has 1 dims but the spec normalizes the last 2"),
        (RMSNormSpec(gain="none"), torch.ones(1, MAX_HIDDEN + 1), None, f"rows of 1 to {MAX_HIDDEN} elements.*got {MAX_HIDDEN + 1}"),
        (RMSNormSpec(gain="none"), torch.ones(2, 0), None, "empty normalized shape"),
    ],
    ids=["float64-input", "missing-weight", "weight-shape", "weight-dtype", "extra-weight", "too-few-dims", "hidden-too-large", "empty-row"],
)
def test_bad_inputs_are_refused_by_name(spec, x, w, message, device):
    with pytest.raises(InputError, match=message):
        rms_norm(spec, x, w)
