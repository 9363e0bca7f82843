"""ONNX Runtime's int8 GEMM, exact on every x86-64 CPU: when our sessions ask for its U8U8 kernel.

``MatMulInteger`` (a per-channel quantized LM head, ``decoder.quantize.channel_head``) runs MLAS's u8 x s8
kernels. Without VNNI they sum each pair of products with ``vpmaddubsw`` in saturating int16, so a
pair like 255 x 127 + 255 x 127 is clipped: wrong sums. ONNX Runtime's session option
:data:`EXACT_INTEGER_MATMUL` rewrites the weights to u8 for its U8U8 kernel on every x86-64 CPU,
VNNI or not, and costs a VNNI CPU (whose ``vpdpbusd`` sums in int32, exact already) 1.6x the head's
time (measured on a [576, 49152] head). So every session we open sets it unless the CPU has VNNI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXACT_INTEGER_MATMUL = "session.x64quantprecision"
#: /proc/cpuinfo flags of the instructions ONNX Runtime's U8S8 VNNI kernels use (AVX512-VNNI, AVX-VNNI).
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


def cpu_has_vnni(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU's flags (Linux's /proc/cpuinfo) name a VNNI extension; False where they cannot be read
    (then the exact, slower int8 GEMM is asked for)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(flag in flags for flag in VNNI_FLAGS)


def exact_integer_matmuls(options: Any, *, vnni: bool | None = None) -> Any:
    """``options`` (a SessionOptions) with :data:`EXACT_INTEGER_MATMUL` set unless the CPU has VNNI."""
    if not (cpu_has_vnni() if vnni is None else vnni):
        options.add_session_config_entry(EXACT_INTEGER_MATMUL, "1")
    return options
