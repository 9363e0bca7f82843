"""TensorRT quickly deployable plugin definitions of ``RMSNorm`` (imported by ``plugin.load_plugin``).

Importing this module registers the plugin in both namespaces (with and without a weight
input). It imports tensorrt, and its annotations must stay real objects (no postponed
evaluation): ``tensorrt.plugin`` validates them. The attribute parameters are the plugin's
fields, :data:`plugin.PLUGIN_FIELDS` (checked below). TensorRT's ONNX parser hands a FLOAT
attribute over as a 1-element float32 field, INTS as an int32 array, STRING as characters;
``tensorrt.plugin``'s creator then converts each field by its annotation here (``tensorrt/plugin/_lib.py``,
``_TemplatePluginCreator.create_plugin``; :func:`plugin.spec_from_fields` reads it back): FLOAT is therefore declared ``npt.NDArray[np.float32]`` (an
annotation ``float`` would call ``float()`` on a 1-D array, which numpy >= 2.4 refuses). Each
decorated function only unpacks its arguments; the work is done in ``plugin.py``, which runs
without tensorrt.
"""

import inspect
from typing import Tuple, Union

import numpy as np
import numpy.typing as npt
import tensorrt as trt
import tensorrt.plugin as trtp

from rmsnorm_deploy.tensorrt import plugin as _plugin

WEIGHTED = f"{_plugin.PLUGIN_NAMESPACE}::{_plugin.PLUGIN_NAME}"
UNWEIGHTED = f"{_plugin.PLUGIN_NAMESPACE_NO_WEIGHT}::{_plugin.PLUGIN_NAME}"

#: TensorRT builds whose tensorrt.plugin can compile ahead of time (10.9 and later).
AOT = _plugin.aot_supported(trt, trtp)
_DTYPES = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}


def _dtype(trt_dtype) -> str:
    return _DTYPES.get(trt_dtype, str(trt_dtype))


def _spec(epsilon, axes, gain, order, accumulation, epsilon_placement):
    return _plugin.spec_from_fields(
        dict(epsilon=epsilon, axes=axes, gain=gain, order=order, accumulation=accumulation,
             epsilon_placement=epsilon_placement)
    )


def _describe(spec, x, weight):
    _plugin.check_io(spec, _dtype(x.dtype), None if weight is None else _dtype(weight.dtype))
    return x.like()


def _compile(spec, x, weight):
    """PTX of the kernel for these inputs, its launch and its integer arguments (rows, cols, strides)."""
    dims = x.shape_expr
    rank = len(dims)
    k = spec.normalized_dims
    static = [dims[i].constant_value() if dims[i].is_constant else None for i in range(rank)]
    n_cols = _plugin.normalized_size(spec, static)
    kernel = _plugin.aot_kernel(spec, _dtype(x.dtype), None if weight is None else _dtype(weight.dtype), n_cols)
    launch = trtp.KernelLaunchParams()
    if rank > k:
        rows = dims[0]
        for i in range(1, rank - k):
            rows = rows * dims[i]
        launch.grid_x = trtp.cdiv(rows, kernel.rows_per_program)
    else:
        rows = 1
        launch.grid_x = 1
    launch.block_x = kernel.block_x
    launch.shared_mem = kernel.shared_mem
    # (x, [weight,] n_rows, n_cols, x_row_stride, y_row_stride, y): contiguous rows, strides = n_cols
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(rows)] + [trtp.SymInt32(n_cols)] * 3)
    return kernel.name.encode(), kernel.ptx.encode(), launch, extra


# -- with a weight: (x, weight) ---------------------------------------------------------------
@trtp.register(WEIGHTED)
def rmsnorm_desc(
    x: trtp.TensorDesc, weight: trtp.TensorDesc, epsilon: npt.NDArray[np.float32], axes: npt.NDArray[np.int32],
    gain: str, order: str, accumulation: str, epsilon_placement: str,
) -> trtp.TensorDesc:
    return _describe(_spec(epsilon, axes, gain, order, accumulation, epsilon_placement), x, weight)


@trtp.impl(WEIGHTED)
def rmsnorm_impl(
    x: trtp.Tensor, weight: trtp.Tensor, epsilon: npt.NDArray[np.float32], axes: npt.NDArray[np.int32],
    gain: str, order: str, accumulation: str, epsilon_placement: str, outputs: Tuple[trtp.Tensor], stream: int,
) -> None:
    _plugin.run_jit(_spec(epsilon, axes, gain, order, accumulation, epsilon_placement), x, weight, outputs[0], stream)


if AOT:

    @trtp.aot_impl(WEIGHTED)
    def rmsnorm_aot_impl(
        x: trtp.TensorDesc, weight: trtp.TensorDesc, epsilon: npt.NDArray[np.float32], axes: npt.NDArray[np.int32],
        gain: str, order: str, accumulation: str, epsilon_placement: str, outputs: Tuple[trtp.TensorDesc],
        tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        return _compile(_spec(epsilon, axes, gain, order, accumulation, epsilon_placement), x, weight)


# -- without a weight (gain "none"): (x) ------------------------------------------------------
@trtp.register(UNWEIGHTED)
def rmsnorm_noweight_desc(
    x: trtp.TensorDesc, epsilon: npt.NDArray[np.float32], axes: npt.NDArray[np.int32], gain: str, order: str,
    accumulation: str, epsilon_placement: str,
) -> trtp.TensorDesc:
    return _describe(_spec(epsilon, axes, gain, order, accumulation, epsilon_placement), x, None)


@trtp.impl(UNWEIGHTED)
def rmsnorm_noweight_impl(
    x: trtp.Tensor, epsilon: npt.NDArray[np.float32], axes: npt.NDArray[np.int32], gain: str, order: str,
    accumulation: str, epsilon_placement: str, outputs: Tuple[trtp.Tensor], stream: int,
) -> None:
    _plugin.run_jit(_spec(epsilon, axes, gain, order, accumulation, epsilon_placement), x, None, outputs[0], stream)


if AOT:

    @trtp.aot_impl(UNWEIGHTED)
    def rmsnorm_noweight_aot_impl(
        x: trtp.TensorDesc, epsilon: npt.NDArray[np.float32], axes: npt.NDArray[np.int32], gain: str, order: str,
        accumulation: str, epsilon_placement: str, outputs: Tuple[trtp.TensorDesc], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        return _compile(_spec(epsilon, axes, gain, order, accumulation, epsilon_placement), x, None)


def _check_fields(fn, inputs) -> None:
    """The attribute parameters must be the plugin's fields: the parser passes those node attributes only."""
    names = [p for p in inspect.signature(fn).parameters if p not in (*inputs, "outputs", "stream", "tactic")]
    if sorted(names) != sorted(_plugin.PLUGIN_FIELDS):
        raise RuntimeError(f"{fn.__name__} takes attributes {names}; the RMSNorm node carries {list(_plugin.PLUGIN_FIELDS)}")


for _fn in (rmsnorm_desc, rmsnorm_impl):
    _check_fields(_fn, ("x", "weight"))
for _fn in (rmsnorm_noweight_desc, rmsnorm_noweight_impl):
    _check_fields(_fn, ("x",))
