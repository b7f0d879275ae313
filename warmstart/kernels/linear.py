"""Quantized (int4/int8) and float linears on the compiled kernels (csrc/qlinear.h, csrc/dense_linear.h), with
the ISA in force; each falls back to torch where the kernel is not built."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from warmstart.kernels.loader import load_native

_qlinear, QLINEAR_UNAVAILABLE_REASON = load_native("_qlinear")


def has_qlinear() -> bool:
    """True when the compiled quantized-linear kernel (csrc/qlinear.h) runs on this CPU."""
    return _qlinear is not None


# Three routes by row count, measured with every kernel threaded (2 threads, AVX2; SmolLM2's q/k/v, gate_up, down and
# int8 LM-head shapes; GFLOPS in the closing note of issue 8):
# - below PANEL_MIN_ROWS (a decode step of a few sequences): activations quantized to int8 per block of 32, the
#   weight read directly (memory-bound; 1.3-4x faster than the others at 4 rows);
# - from PANEL_MIN_ROWS (decode batches): the weight expanded to float32 a panel of 48 rows at a time in L2 and
#   multiplied by a register-blocked kernel: 135-158 GFLOPS at 32-64 rows, 1.5-2x either alternative;
# - from DENSE_MIN_ROWS (long prefill chunks): expanded in 8 MiB tiles and multiplied by torch's float32 GEMM,
#   which wins (1.1-1.2x) once the rows no longer stay in cache.
# The two float32 routes are exact (full-precision activations); the int8-activation one rounds activations.
# On CPUs with AMX-BF16 tiles (qlinear_isa() "amx-bf16") the panel route runs on the tiles in bfloat16 and takes
# every row count from PANEL_MIN_ROWS (2.2-4x the float32 GEMM at 256-512 rows, ~3x the float32 panels at 32):
# weights and activations rounded to bfloat16, float32 sums, so outputs are within bfloat16 rounding, not exact.
# On AVX-512 VNNI without AMX (the AVX-512 EPYCs; an AMX Xeon held at "avx512-vnni") the int8-activation route
# (vpdpbusd, 64 weights an instruction, no expansion of the weight) beats the float32 panels further up: at 8-32
# rows 1.3-2.2x (int8 weights) and 1.0-1.7x (int4); at 48-128 rows still 1.04-1.3x for int8 weights, while int4's
# (its codes unpacked again for every 4 rows) fell to 0.8-1.0x (2 threads, SmolLM2's shapes incl. the LM head;
# issue 8's closing notes). So there int8 weights keep it up to DENSE_MIN_ROWS and int4 up to VNNI_INT4_PANEL_ROWS.
PANEL_MIN_ROWS = 8
DENSE_MIN_ROWS = 256
VNNI_INT4_PANEL_ROWS = 40


def panel_threshold(int4: bool) -> int:
    """The row count from which the panel route runs, for the kernels in force (qlinear_isa()) and weight kind."""
    if qlinear_isa() == "avx512-vnni":
        return VNNI_INT4_PANEL_ROWS if int4 else DENSE_MIN_ROWS
    return PANEL_MIN_ROWS

def qlinear_isa() -> str | None:
    """The kernels in force: "amx-bf16" (AVX-512 VNNI integer kernels, and the panel route on AMX-BF16 tiles, where
    the CPU and Linux give them), "avx512-vnni" (vpdpbusd, 64 weights per instruction; float32 panels), "avx2", or
    None without the compiled kernel. Chosen at run time; WARMSTART_KERNEL_ISA=avx512-vnni or avx2 holds it lower."""
    return _qlinear.isa() if _qlinear is not None else None


def set_qlinear_isa(name: str) -> str | None:
    """Holds the kernels at "avx2" or "avx512-vnni", or allows "amx-bf16" (at most what the CPU has), for A/B runs
    and tests; returns the level in force. One setting per process (all four modules share it; paged attention's
    int8-cache step follows it too)."""
    return _qlinear.set_isa(name) if _qlinear is not None else None


def qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
            dense_min_rows: int = DENSE_MIN_ROWS, panel_min_rows: int | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) times a quantized weight, float32 [M, N] out. int4: qweight uint8 [N, K/2],
    scales and mins float32 [N, K/32]; int8: qweight int8 [N, K], scales float32 [N, K/32]. Routes by M (see
    above; a threshold of 0 turns its route off): int8 activations below panel_min_rows, the float32 panel kernel
    from there, the float32 GEMM over expanded tiles from dense_min_rows. panel_min_rows None: panel_threshold()
    for the kernels in force and this weight's kind."""
    if panel_min_rows is None:
        panel_min_rows = panel_threshold(mins is not None)
    return _qlinear.qlinear(x, qweight, scales, mins, dense_min_rows, panel_min_rows)


# Float linears at a few rows (csrc/dense_linear.h): a decode step's float32 or bfloat16 matmuls stream their weight,
# and torch's CPU GEMM did so at about a third of the memory bandwidth: float32 2.5-2.9x slower at 1-4 rows and
# 1.2-1.6x at 8, bfloat16 1.3-1.7x and 1.1x (SmolLM2's shapes, 30 layers and the LM head cold from memory, 2 threads,
# AVX-512 EPYC: benchmarks/dense_linear.py).
DENSE_GEMV_MAX_ROWS = _qlinear.dense_max_rows if _qlinear is not None else 0


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); for [M, K] CPU rows (M <= DENSE_GEMV_MAX_ROWS) whose x, weight and bias are all
    float32 or all bfloat16, contiguous, on the compiled GEMV (float32 sums, one rounding to the dtype at the end).
    Anything else runs F.linear. Under torch.compile a CPU call is the opaque op warmstart::dense_linear, which
    makes the same choice at run time, so a compiled step multiplies exactly as the eager one."""
    if _qlinear is None:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.warmstart.dense_linear(x, weight, bias) if x.is_cpu else F.linear(x, weight, bias)
    if x.dim() == 2 and x.shape[0] <= DENSE_GEMV_MAX_ROWS and x.is_cpu:
        return _qlinear.dense_linear(x, weight, bias)
    return F.linear(x, weight, bias)


if _qlinear is not None:
    @torch.library.custom_op("warmstart::dense_linear", mutates_args=())
    def _dense_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _qlinear.dense_linear(x, weight, bias)

    @_dense_linear_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
