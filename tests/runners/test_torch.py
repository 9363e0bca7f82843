"""The torch runner: a rebuilt source behind ``infer(feed) -> outputs``, in its dtype or in float64."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import to_numpy, to_torch
from rmsnorm_deploy.contract.inputs import activations, gain_weights
from rmsnorm_deploy.contract.reference import SpecRMSNorm, oracle, reference
from rmsnorm_deploy.contract.spec import named_specs
from rmsnorm_deploy.contract.tolerances import tolerance_for
from rmsnorm_deploy.errors import ProviderError, UserError
from rmsnorm_deploy.exporter.rebuild import rebuild_source
from rmsnorm_deploy.graph.metadata import ModelMetadata
from rmsnorm_deploy.graph.standalone import rmsnorm_model
from rmsnorm_deploy.runners.torch import TorchRunner, float64_copy
from tests.cases import DTYPES


def _standalone(spec_name, dtype, shape):
    spec = named_specs()[spec_name]
    meta = ModelMetadata.read(rmsnorm_model(spec, dtype=dtype, shape=shape))
    x = activations(shape, dtype, seed=5)
    w = gain_weights(shape[-1:], dtype, spec.gain, seed=6)
    return spec, rebuild_source(meta), ({"x": x} if w is None else {"x": x, "weight": w})


@pytest.mark.parametrize("shape", [(1, 1), (199, 7), (2, 3, 760)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_name", ["llama", "gemma", "nogain"])
def test_source_runs_bit_equal_to_the_reference(spec_name, dtype, shape):
    spec, module, feed = _standalone(spec_name, dtype, shape)
    with TorchRunner(module) as runner:
        y = runner.infer(feed)["y"]
    expected = to_numpy(reference(spec, to_torch(feed["x"]), to_torch(feed["weight"]) if "weight" in feed else None))
    assert y.dtype == expected.dtype
    np.testing.assert_array_equal(y.view(np.uint16) if dtype != "float32" else y,
                                  expected.view(np.uint16) if dtype != "float32" else expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_float64_runner_evaluates_the_oracle(dtype):
    spec, module, feed = _standalone("gemma", dtype, (31, 760))
    with TorchRunner(module, dtype="float64") as runner:
        y = runner.infer(feed)["y"]
        assert runner.name == "torch[cpu,float64]"
    assert y.dtype == np.float64
    result = compare(y, oracle(spec, feed["x"], feed["weight"]), tolerance_for("norm", "torch", "float64"))
    assert result, result.summary()
    assert module.spec.accumulation == "float32", "the float64 copy must leave the source untouched"


def test_float64_copy_widens_every_spec_module():
    block = torch.nn.Sequential(SpecRMSNorm(named_specs()["llama"], 16, torch.float16), torch.nn.Linear(16, 16).half())
    wide = float64_copy(block)
    assert wide[0].spec.accumulation == "float64" and wide[0].weight.dtype == torch.float64
    assert wide[1].weight.dtype == torch.float64
    assert block[0].spec.accumulation == "float32" and block[0].weight.dtype == torch.float16


def test_bfloat16_comes_back_as_ml_dtypes():
    _, module, feed = _standalone("torch", "bfloat16", (4, 8))
    with TorchRunner(module) as runner:
        assert runner.infer(feed)["y"].dtype == np.dtype(ml_dtypes.bfloat16)


def test_cuda_without_a_gpu_is_a_provider_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    _, module, _ = _standalone("torch", "float32", (2, 4))
    with pytest.raises(ProviderError, match="torch sees no CUDA GPU"):
        with TorchRunner(module, device="cuda"):
            pass


def test_bad_device_and_bad_module_outputs():
    with pytest.raises(UserError, match="unknown torch device 'tpu'"):
        TorchRunner(torch.nn.Identity(), device="tpu")
    with TorchRunner(torch.nn.Identity()) as runner:
        with pytest.raises(UserError, match="returned a bare tensor"):
            runner.infer({"input": np.zeros((2, 2), np.float32)})
    _, module, feed = _standalone("torch", "float32", (2, 4))
    with TorchRunner(module) as runner:
        with pytest.raises(UserError, match="does not take these inputs"):
            runner.infer({**feed, "bogus": feed["x"]})


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_source_matches_the_oracle(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and a CUDA build of torch")
    spec, module, feed = _standalone("llama", dtype, (199, 760))
    with TorchRunner(module, device="cuda") as runner:
        y = runner.infer(feed)["y"]
    result = compare(y, oracle(spec, feed["x"], feed["weight"]), tolerance_for("norm", "torch", dtype))
    assert result, result.summary()
