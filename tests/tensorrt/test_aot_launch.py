"""The plugin's ahead-of-time kernel run on a GPU as TensorRT runs it, without TensorRT.

``plugin.aot_kernel`` is what ``@trtp.aot_impl`` hands TensorRT: PTX, a grid, a block and the
argument layout ``(x, [weight,] n_rows, n_cols, x_row_stride, y_row_stride, y, scratch...)``.
Here the CUDA driver loads that PTX (``cuModuleLoadData``, its JIT, as TensorRT's runtime does) and
``cuLaunchKernel`` runs it with that layout, Triton's scratch pointers null; the rows must be the
JIT kernel's to the bit (to the last bit where only the AOT kernel knows its rows' alignment) and within the
tolerance table of the float64 oracle. Needs a CUDA GPU and
``cuda-bindings`` (NVIDIA's Python driver bindings); ``make gpu-check`` runs it.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.compare import compare
from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.contract.inputs import activations
from rmsnorm_deploy.contract.reference import oracle
from rmsnorm_deploy.contract.tolerances import tolerance_for

pytestmark = [pytest.mark.cuda]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: the PTX is loaded and launched by the CUDA driver", allow_module_level=True)
pytest.importorskip("triton", reason="the kernel is compiled by Triton (pip install 'rmsnorm-deploy[triton]')")
driver = pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings (pip install cuda-bindings) to call "
                                                           "the CUDA driver as TensorRT does")

from rmsnorm_deploy.kernels.functional import rms_norm  # noqa: E402
from rmsnorm_deploy.tensorrt.plugin import aot_kernel  # noqa: E402

#: (spec, dtype, weight dtype, row length): each gain, every dtype, a float32 weight, odd and packed rows
CASES = [
    (RMSNormSpec.llama(1e-5), "bfloat16", "bfloat16", 4096),
    (RMSNormSpec.gemma(1e-6), "float16", "float32", 760),
    (RMSNormSpec(gain="none"), "float16", None, 128),
    (RMSNormSpec.llama(1e-6), "float32", "float32", 7),
]


def _check(result: tuple) -> tuple:
    """A driver call's values after its status, which must be success."""
    status, *values = result if isinstance(result, tuple) else (result,)
    assert status == driver.CUresult.CUDA_SUCCESS, f"CUDA driver error {status}"
    return tuple(values)


def _launch(kernel, x: torch.Tensor, weight: torch.Tensor | None, y: torch.Tensor) -> None:
    """``kernel``'s PTX loaded by the driver and launched over x's rows with TensorRT's argument layout."""
    _check(driver.cuInit(0))
    (device,) = _check(driver.cuDeviceGet(torch.cuda.current_device()))
    (context,) = _check(driver.cuDevicePrimaryCtxRetain(device))  # torch's context
    _check(driver.cuCtxSetCurrent(context))
    image = np.frombuffer(kernel.ptx.encode() + b"\0", np.uint8)
    (module,) = _check(driver.cuModuleLoadData(image.ctypes.data))
    try:
        (function,) = _check(driver.cuModuleGetFunction(module, kernel.name.encode()))
        entry = re.search(rf"\.entry\s+{kernel.name}\s*\((.*?)\)", kernel.ptx, re.S)
        assert entry, f"no .entry {kernel.name} in the PTX"
        n_params = len(entry.group(1).split(","))
        n_rows, n_cols = x.shape
        pointers = [x.data_ptr()] + ([weight.data_ptr()] if weight is not None else [])
        values = ([np.array([p], np.uint64) for p in pointers]
                  + [np.array([v], np.int32) for v in (n_rows, n_cols, n_cols, n_cols)]
                  + [np.array([y.data_ptr()], np.uint64)])
        values += [np.array([0], np.uint64) for _ in range(n_params - len(values))]  # scratch: null, unused
        params = np.array([v.ctypes.data for v in values], np.uint64)
        torch.cuda.synchronize()
        _check(driver.cuLaunchKernel(function, kernel.grid_x(n_rows), 1, 1, kernel.block_x, 1, 1, kernel.shared_mem,
                                     driver.CUstream(0), params.ctypes.data, 0))
        _check(driver.cuCtxSynchronize())
    finally:
        _check(driver.cuModuleUnload(module))
        _check(driver.cuDevicePrimaryCtxRelease(device))


@pytest.mark.parametrize("rows", [1, 199])
@pytest.mark.parametrize("spec, dtype, weight_dtype, n_cols", CASES,
                         ids=[f"{s.gain}-{d}-w{w}-{n}" for s, d, w, n in CASES])
def test_the_aot_kernel_launched_as_tensorrt_launches_it_is_the_jit_kernel(spec, dtype, weight_dtype, n_cols, rows):
    x = torch.from_numpy(activations((rows, n_cols), "float32", seed=rows + n_cols)).to(torch_dtype(dtype)).cuda()
    weight = None
    if weight_dtype is not None:
        weight = (1 + 0.1 * torch.randn(n_cols, generator=torch.Generator().manual_seed(n_cols))).to(
            torch_dtype(weight_dtype)).cuda()
    kernel = aot_kernel(spec, dtype, weight_dtype, n_cols)
    y = torch.full_like(x, float("nan"))
    _launch(kernel, x, weight, y)
    jit = rms_norm(spec, x, weight)
    if n_cols % 16 == 0 or math.gcd(n_cols, 16) == 1:
        assert torch.equal(y, jit), "the AOT kernel's rows differ from the JIT kernel's"
    else:
        # The AOT kernel is told its rows are 8-aligned (n_cols, known when the engine is built); the JIT
        # kernel is specialized on divisibility by 16 only, so it loads narrower vectors and sums the
        # squares in another order: an output can differ by its last bit, no more.
        apart = compare(y.cpu(), jit.cpu(), tolerance_for("norm", "triton", dtype))
        assert apart.max_ulp <= 1, f"the AOT kernel's rows are {apart.max_ulp:g} ulps from the JIT kernel's"
    result = compare(y.cpu(), oracle(spec, x.cpu(), None if weight is None else weight.cpu()),
                     tolerance_for("norm", "triton", dtype))
    assert result, result.summary()
