"""The fused RMSNorm kernel (Triton) and its launcher.

One pass over each row: the row is loaded once, its sum of squares accumulated in the
spec's accumulation dtype (float32, or float64), epsilon, the gain and the rounding back
to the input dtype applied in the spec's order, and the row written once. Every field of
the :class:`~rmsnorm_deploy.contract.spec.RMSNormSpec` reaches the kernel as a ``tl.constexpr``
(:func:`kernel_constants`), so each spec compiles to its own straight-line kernel.

The kernel follows the steps of ``formula.rms_norm`` (which Triton cannot trace) in the op
forms of ``reference.TorchOps``, with correctly rounded ``sqrt``, ``1/sqrt`` and ``/``
(``sqrt_rn``, ``div_rn``) so that it rounds where the torch reference on CPU rounds; the
only difference left is the order of the float32 sum.

Compiled or interpreted: Triton decides when ``triton`` is imported. Its own library
(``tl.sum``, ``tl.max``, ...) is made of ``@triton.jit`` functions, decorated for the
interpreter only if ``TRITON_INTERPRET=1`` was set before that import; a kernel that calls
them must run in the same mode. So ``rmsnorm_kernel`` is left undecorated, and
:func:`runtime_kernel` wraps it in the mode Triton's library was imported in, whatever the
environment says later; :func:`launch_rows` refuses CPU tensors in a compiling process, naming
the fix, and :func:`compile_aot` refuses to run in an interpreting one.

Layouts: rows of ``n_cols`` contiguous elements, ``x_row_stride``/``y_row_stride`` apart.
Small rows (hidden 128: per-head q/k norms) are normalized ``ROWS_PER_PROGRAM`` at a time,
large ones one per program (:func:`launch_config`). The parameters are ordered
``(inputs..., integer scalars..., output)``, the order TensorRT's AOT plugins launch with.
"""

import dataclasses
import functools
import math
import re
from typing import Any

import triton
import triton.language as tl

from rmsnorm_deploy.contract.dtypes import dtype_name
from rmsnorm_deploy.errors import InputError

#: Largest row the kernel holds in registers (elements). Larger rows are refused.
MAX_HIDDEN = 65536
#: Elements one program aims to handle when rows are small (rows are packed up to this).
_TARGET_ELEMENTS_PER_PROGRAM = 4096
_MAX_ROWS_PER_PROGRAM = 64

_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_ACCUMULATION = {"float32": tl.float32, "float64": tl.float64}


def rmsnorm_kernel(
    x_ptr,
    w_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    y_row_stride,
    y_ptr,
    EPSILON: tl.constexpr,
    GAIN: tl.constexpr,
    ORDER: tl.constexpr,
    EPSILON_INSIDE_SQRT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
):
    """``y = gain(x / sqrt(mean(x^2) + eps))`` over each row, rounded as the spec says.

    ``EMULATE_BF16_ROUNDING``: round to bfloat16 with integer arithmetic (round to nearest
    even, as the GPU's ``cvt.rn.bf16.f32``) instead of a cast: Triton's interpreter
    truncates float32 -> bfloat16 casts. Set for interpreted launches only.
    """
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    rows = pid * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    xa = x.to(ACC)
    # mean_square: sum in the accumulation dtype, then one correctly rounded division
    if ACC == tl.float64:
        mean_sq = tl.sum(xa * xa, axis=1) / tl.cast(n_cols, tl.float64)
    else:
        mean_sq = tl.math.div_rn(tl.sum(xa * xa, axis=1), tl.cast(n_cols, tl.float32))
    if EPSILON_INSIDE_SQRT:
        # x * rsqrt(ms + eps), the reciprocal square root as 1 / sqrt (both correctly rounded)
        if ACC == tl.float64:
            inv_rms = 1.0 / tl.sqrt(mean_sq + EPSILON)
        else:
            inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + EPSILON))
        y = xa * inv_rms[:, None]
    else:
        # x / (sqrt(ms) + eps), divided element by element
        if ACC == tl.float64:
            y = xa / (tl.sqrt(mean_sq) + EPSILON)[:, None]
        else:
            denom = tl.broadcast_to((tl.sqrt_rn(mean_sq) + EPSILON)[:, None], (ROWS_PER_PROGRAM, BLOCK_N))
            y = tl.math.div_rn(xa, denom)

    # Rounding to the input dtype goes through float32, as torch converts float64 to half
    # types (twice rounded); with float32 accumulation the first conversion is a no-op.
    if GAIN != "none":
        g = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(ACC)
        if GAIN == "offset":
            g = 1.0 + g
        if ORDER == "cast_then_scale":
            # both factors rounded to the input dtype, their product rounded once below
            if EMULATE_BF16_ROUNDING and OUT == tl.bfloat16:
                yb = y.to(tl.float32).to(tl.uint32, bitcast=True)
                yb = ((yb + 0x7FFF + ((yb >> 16) & 1)) >> 16) << 16
                y = tl.where(y != y, y, yb.to(tl.float32, bitcast=True).to(ACC))
                gb = g.to(tl.float32).to(tl.uint32, bitcast=True)
                gb = ((gb + 0x7FFF + ((gb >> 16) & 1)) >> 16) << 16
                g = tl.where(g != g, g, gb.to(tl.float32, bitcast=True).to(ACC))
            else:
                y = y.to(tl.float32).to(OUT).to(ACC)
                g = g.to(tl.float32).to(OUT).to(ACC)
        y = y * g[None, :]

    y = y.to(tl.float32)
    if EMULATE_BF16_ROUNDING and OUT == tl.bfloat16:
        yb = y.to(tl.uint32, bitcast=True)
        yb = ((yb + 0x7FFF + ((yb >> 16) & 1)) >> 16) << 16
        y = tl.where(y != y, y, yb.to(tl.float32, bitcast=True))
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(OUT), mask=mask)


# -- launch configuration -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How rows map to programs: ``block_n`` columns (a power of two >= hidden), rows per program, warps."""

    block_n: int
    rows_per_program: int
    num_warps: int

    def grid(self, n_rows: int) -> tuple[int]:
        return (max(1, triton.cdiv(n_rows, self.rows_per_program)),)


def launch_config(n_cols: int, *, rows_per_program: int | None = None, num_warps: int | None = None) -> LaunchConfig:
    """The launch configuration for rows of ``n_cols`` elements.

    Rows shorter than ``_TARGET_ELEMENTS_PER_PROGRAM`` are packed several to a program so
    that each program still moves a few KB; longer rows get one program each, with more
    warps as the row grows (a row lives in registers: up to 64 elements per thread).
    ``rows_per_program``/``num_warps`` override the heuristic (benchmark sweeps).
    """
    if rows_per_program is None and num_warps is None:
        return _default_config(n_cols)
    return _config(n_cols, rows_per_program, num_warps)


@functools.lru_cache(maxsize=1024)
def _default_config(n_cols: int) -> LaunchConfig:
    """The heuristic's configuration, made once per row length: a launch's host time is part of its cost."""
    return _config(n_cols, None, None)


def _config(n_cols: int, rows_per_program: int | None, num_warps: int | None) -> LaunchConfig:
    check_hidden(n_cols)
    block_n = triton.next_power_of_2(n_cols)
    if rows_per_program is None:
        rows_per_program = max(1, min(_MAX_ROWS_PER_PROGRAM, _TARGET_ELEMENTS_PER_PROGRAM // block_n))
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two >= 1, got {rows_per_program}")
    if num_warps is None:
        elements = block_n * rows_per_program
        num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16 if elements <= 32768 else 32
    return LaunchConfig(block_n, rows_per_program, num_warps)


def check_hidden(n_cols: int) -> None:

    if not 1 <= n_cols <= MAX_HIDDEN:
        raise InputError(
            f"the Triton RMSNorm kernel normalizes rows of 1 to {MAX_HIDDEN} elements (a row is held in registers); "
            f"got {n_cols}. Use the function lowering for larger rows"
        )


def kernel_constants(spec: Any, output_dtype: str, *, interpret: bool = False) -> dict[str, Any]:
    """The kernel's ``tl.constexpr`` arguments for ``spec`` (everything but the launch shape).

    ``output_dtype`` is the input (= output) dtype name; ``interpret``: the launch runs in
    Triton's interpreter (see ``EMULATE_BF16_ROUNDING``).
    """
    if output_dtype not in _TRITON_TYPES:
        raise ValueError(f"the kernel reads and writes {', '.join(_TRITON_TYPES)}; got {output_dtype}")
    return {
        "EPSILON": spec.epsilon_float32,
        "GAIN": spec.gain,
        # Without a gain the order changes nothing: one compiled kernel serves both.
        "ORDER": spec.order if spec.has_gain else "scale_then_cast",
        "EPSILON_INSIDE_SQRT": spec.epsilon_placement == "inside_sqrt",
        "ACC": _ACCUMULATION[spec.accumulation],
        "EMULATE_BF16_ROUNDING": bool(interpret and output_dtype == "bfloat16"),
    }


# -- the two ways to run it -------------------------------------------------------------------
def triton_interprets() -> bool:
    """Whether Triton was imported for its interpreter (``TRITON_INTERPRET=1`` before ``import triton``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


@functools.lru_cache(maxsize=None)
def compiled_kernel():
    """``rmsnorm_kernel`` for Triton's compiler (CUDA tensors, AOT compilation)."""
    from triton.runtime.jit import JITFunction

    return JITFunction(rmsnorm_kernel)


@functools.lru_cache(maxsize=None)
def interpreted_kernel():
    """``rmsnorm_kernel`` for Triton's interpreter (numpy on the CPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(rmsnorm_kernel)


def runtime_kernel():
    """The kernel in the mode this process's Triton runs: interpreted or compiled."""
    return interpreted_kernel() if triton_interprets() else compiled_kernel()


def launch_rows(spec: Any, x: Any, weight: Any, y: Any, n_rows: int, n_cols: int, x_row_stride: int,
                y_row_stride: int, config: LaunchConfig | None = None) -> None:
    """Normalize ``n_rows`` rows of ``n_cols`` contiguous elements of ``x`` into ``y``, rows ``*_row_stride`` apart.

    ``x`` and ``y`` are any tensors holding those rows (a contiguous ``[..., hidden]`` tensor
    as it is: no reshaping view is made per call). The caller (``functional.rms_norm``) has
    checked shapes, dtypes and devices. CUDA tensors run compiled; in a process whose Triton
    interprets, any tensors run in the interpreter; CPU tensors otherwise are an error, never
    a silent fallback.
    """
    config = config or launch_config(n_cols)
    interpret = triton_interprets()
    if not interpret and x.device.type != "cuda":
        raise InputError(
            f"the Triton RMSNorm kernel runs on CUDA tensors; x is on {x.device}. Without a GPU, run it in "
            "Triton's interpreter (slow: for tests): set TRITON_INTERPRET=1 before triton is first imported"
        )
    runtime_kernel()[config.grid(n_rows)](
        x, weight, n_rows, n_cols, x_row_stride, y_row_stride, y,
        **_launch_options(spec, dtype_name(x.dtype), interpret, config),
    )


@functools.lru_cache(maxsize=1024)
def _launch_options(spec: Any, output_dtype: str, interpret: bool, config: LaunchConfig) -> dict[str, Any]:
    """The keyword arguments of a launch, made once per spec, dtype and configuration (host time)."""
    return {
        "BLOCK_N": config.block_n,
        "ROWS_PER_PROGRAM": config.rows_per_program,
        "num_warps": config.num_warps,
        "enable_fp_fusion": False,  # x*x rounded before it is summed, as the reference does
        **kernel_constants(spec, output_dtype, interpret=interpret),
    }


# -- ahead-of-time compilation (TensorRT plugin) --------------------------------------------
@dataclasses.dataclass(frozen=True)
class AotKernel:
    """A kernel compiled ahead of time: PTX and what a launcher needs to run it.

    Launch: ``grid_x = ceil(n_rows / rows_per_program)``, ``block_x = num_warps * 32``,
    ``shared_mem`` bytes of dynamic shared memory; arguments ``x, [weight,] n_rows, n_cols,
    n_cols, n_cols, y`` (the row strides of contiguous rows are ``n_cols``).
    """

    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    rows_per_program: int
    block_n: int
    has_weight: bool
    target: str
    ptx_version: int | None

    @property
    def block_x(self) -> int:
        return self.num_warps * 32

    def grid_x(self, n_rows: int) -> int:
        return max(1, -(-n_rows // self.rows_per_program))


def triton_type(dtype: str) -> str:
    try:
        return _TRITON_TYPES[dtype]
    except KeyError:
        raise ValueError(f"the kernel reads and writes {', '.join(_TRITON_TYPES)}; got {dtype}") from None


def compile_aot(
    spec: Any,
    *,
    dtype: str,
    weight_dtype: str | None,
    n_cols: int,
    arch: int | None = None,
    ptx_version: int | None = None,
    max_ptx_version: int | None = None,
) -> AotKernel:
    """Compile the kernel for ``spec`` to PTX without launching it (no GPU needed with ``arch``).

    ``dtype``: input and output dtype name; ``weight_dtype``: the weight's (``None`` without
    a gain); ``n_cols``: the row length, fixed at build time (it sizes ``BLOCK_N``; the
    kernel still reads ``n_cols`` at run time). ``arch``: compute capability as an integer
    (90 for sm_90); ``None`` compiles for the GPU of this process. ``ptx_version``: the PTX
    ISA to emit (Triton's default: its bundled ptxas's). ``max_ptx_version``: recompile at
    that ISA if the default is newer, e.g. what the driver loads (:func:`driver_ptx_version`).

    The kernel must not need what an AOT launcher cannot provide: Triton's global or
    profiling scratch memory, thread-block clusters, cooperative or PDL launches. Each is
    checked, and a compiled kernel that needs one is refused.
    """
    from triton.compiler import ASTSource

    if triton_interprets():
        raise RuntimeError(
            "Triton was imported with TRITON_INTERPRET=1, which replaces its library (tl.sum, ...) with "
            "interpreted functions that cannot be compiled; compile ahead of time in a process without it"
        )
    if spec.has_gain != (weight_dtype is not None):
        raise ValueError(f"spec gain {spec.gain!r} {'needs' if spec.has_gain else 'takes no'} weight")
    config = launch_config(n_cols)
    signature: dict[str, str] = {"x_ptr": "*" + triton_type(dtype)}
    signature["w_ptr"] = "*" + triton_type(weight_dtype) if weight_dtype else "constexpr"
    signature.update(n_rows="i32", n_cols="i32", x_row_stride="i32", y_row_stride="i32", y_ptr="*" + triton_type(dtype))
    constants = kernel_constants(spec, dtype)
    constants.update(BLOCK_N=config.block_n, ROWS_PER_PROGRAM=config.rows_per_program)
    if not weight_dtype:
        constants["w_ptr"] = None
    signature.update({name: "constexpr" for name in constants if name not in signature})
    # Pointers from TensorRT are 256-byte aligned, and the strides equal n_cols, known here:
    # telling Triton how far they divide lets it vectorize loads and stores.
    position = {name: i for i, name in enumerate(signature)}
    divisibility = {name: 16 for name in ("x_ptr", "y_ptr", "w_ptr") if signature[name] != "constexpr"}
    row_divisor = math.gcd(n_cols, 16)
    if row_divisor > 1:
        divisibility.update(n_cols=row_divisor, x_row_stride=row_divisor, y_row_stride=row_divisor)
    attrs = {(position[name],): [["tt.divisibility", value]] for name, value in divisibility.items()}
    source = ASTSource(fn=compiled_kernel(), signature=signature, constexprs=constants, attrs=attrs)
    options: dict[str, Any] = {"num_warps": config.num_warps, "enable_fp_fusion": False}
    if ptx_version is not None:
        options["ptx_version"] = int(ptx_version)
    target = None
    if arch is not None:
        from triton.backends.compiler import GPUTarget

        target = GPUTarget("cuda", int(arch), 32)
    compiled = triton.compile(source, target=target, options=options)
    emitted = ptx_isa_version(compiled.asm["ptx"])
    if max_ptx_version is not None and emitted is not None and emitted > max_ptx_version:
        options["ptx_version"] = int(max_ptx_version)
        compiled = triton.compile(source, target=target, options=options)
    _check_aot_launchable(compiled.metadata)
    ptx = compiled.asm["ptx"]
    return AotKernel(
        name=compiled.metadata.name,
        ptx=ptx,
        num_warps=int(compiled.metadata.num_warps),
        shared_mem=int(compiled.metadata.shared),
        rows_per_program=config.rows_per_program,
        block_n=config.block_n,
        has_weight=weight_dtype is not None,
        target=str(compiled.metadata.target.arch),
        ptx_version=ptx_isa_version(ptx),
    )


def _check_aot_launchable(metadata: Any) -> None:
    """Refuse a compiled kernel that an AOT launcher (grid, block, shared memory, args) cannot run."""
    needs = {
        "global scratch memory": getattr(metadata, "global_scratch_size", 0),
        "profiling scratch memory": getattr(metadata, "profile_scratch_size", 0),
        "thread-block clusters": getattr(metadata, "num_ctas", 1) != 1,
        "a cooperative launch": getattr(metadata, "launch_cooperative_grid", False),
        "a programmatic dependent launch": getattr(metadata, "launch_pdl", False),
        "tensor memory": getattr(metadata, "tmem_size", 0),
    }
    wanted = [what for what, value in needs.items() if value]
    if wanted:
        raise RuntimeError(f"the compiled RMSNorm kernel needs {', '.join(wanted)}, which an AOT plugin cannot provide")


def ptx_isa_version(ptx: str) -> int | None:
    """``.version 8.7`` -> 87: the PTX ISA a module needs (Triton's ``ptx_version`` form)."""
    match = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", ptx, re.MULTILINE)
    return int(match.group(1)) * 10 + int(match.group(2)) if match else None


def driver_ptx_version() -> int | None:
    """The newest PTX ISA this machine's CUDA driver loads, or ``None`` without a driver.

    Triton emits the ISA of the ``ptxas`` it bundles, which can be newer than the driver:
    the driver would then refuse the PTX when TensorRT loads the engine.
    """
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    from triton.backends.nvidia.compiler import ptx_get_version

    return int(ptx_get_version(f"{version.value // 1000}.{(version.value % 1000) // 10}"))
