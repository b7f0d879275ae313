"""`--dtype auto` on CPU: bfloat16 only where this CPU runs it faster than float32, decided by measuring.

Rules, cheapest first:
- No avx512_bf16: float32, no measurement (bf16 matmuls are converted to fp32 and run 2-8x slower: measured on
  this project's AVX2 hosts, benchmarks/decode.py).
- avx512_bf16, with or without AMX: measure. The model's own linear shapes at batch 1, float32 vs bfloat16, best of
  several runs, on the kernel a decode step runs (kernels.dense_linear: warmstart's GEMV where it is built, else
  torch's); bfloat16 wins only if it is at least 10 % faster at batch 1, the decode case. On the 2-core AVX-512
  EPYC the GEMV gave the default model's float weights 69 tok/s in float32 and 86 in bfloat16 at batch 1 (torch's
  GEMM: 28 and 28), and 250 vs 577 at batch 32. The research host
  (AVX512-BF16, no AMX) measured warmstart bf16/fp32 = 1.77x at batch 1 (shared/research/peers.md, finding 5). AMX
  used to mean bfloat16 without a measurement; on the 2-core AMX Xeon that was wrong: batch-1 linears fp32 163 us
  vs bf16 219-264 us (oneDNN's AMX tiles pay off at many rows, not at one), and the served default decoded at
  54-59 tok/s instead of 111-121.
(Quantized linears on warmstart's integer kernels take float32 regardless: dtypes.resolve_dtype.)
The decision is cached per (CPU model, ISA flags, torch version, probe kernel) under <cache>/probes/, so a restart never
measures again and two boots of one machine always agree (the plan key records the requested dtype)."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from warmstart import kernels
from warmstart.paths import atomic_write_text

log = logging.getLogger("warmstart")
MARGIN = 1.10


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str                     # "float32" | "bfloat16"
    reason: str
    fp32_us: float | None = None   # best time of the probe at batch 1, microseconds
    bf16_us: float | None = None


def choose_cpu_dtype(cpu_name: str, capability: str, shapes: list[tuple[int, int]], cache_dir: Path) -> DtypeChoice:
    flags = set(capability.split(","))
    if "avx512_bf16" not in flags:
        return DtypeChoice("float32", "no avx512_bf16: bfloat16 matmuls are emulated")
    key = hashlib.sha256(json.dumps([cpu_name, capability, torch.__version__, shapes, _probe_kernel()]).encode()
                         ).hexdigest()[:16]
    path = cache_dir / "probes" / f"dtype-{key}.json"
    try:
        cached = DtypeChoice(**json.loads(path.read_text()))
        if cached.dtype in ("float32", "bfloat16"):
            return cached
    except (OSError, ValueError, TypeError):
        pass
    choice = _measure(shapes)
    _save(path, choice)
    return choice


def _probe_kernel() -> str:
    """What the probe times (part of its cache key: a verdict on torch's GEMM says nothing about the GEMV)."""
    return "dense_linear" if kernels.DENSE_GEMV_MAX_ROWS >= 1 else "F.linear"


def _measure(shapes: list[tuple[int, int]], repeats: int = 20) -> DtypeChoice:
    def best(dtype: torch.dtype) -> float:
        ws = [torch.randn(n, k).to(dtype) for n, k in shapes]
        x = [torch.randn(1, k).to(dtype) for _, k in shapes]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for xi, w in zip(x, ws):
                kernels.dense_linear(xi, w)
            times.append(time.perf_counter() - t0)
        return min(times) * 1e6

    fp32, bf16 = best(torch.float32), best(torch.bfloat16)
    dtype = "bfloat16" if fp32 >= bf16 * MARGIN else "float32"
    log.info("dtype auto: measured batch-1 linears fp32 %.0f us vs bf16 %.0f us -> %s", fp32, bf16, dtype)
    return DtypeChoice(dtype, "measured", round(fp32, 1), round(bf16, 1))


def _save(path: Path, choice: DtypeChoice) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(choice)), durable=False)
    except OSError as e:          # a read-only cache measures again next time; the choice is still right
        log.warning("could not cache the dtype probe at %s: %s", path, e)
