"""`--dtype auto` on CPU: bfloat16 only where this CPU runs it faster than float32, decided by measuring.

Rules, cheapest first:
- No avx512_bf16: float32, no measurement (bf16 matmuls are converted to fp32 and run 2-8x slower: measured on
  this project's AVX2 hosts, benchmarks/decode.py).
- avx512_bf16, with or without AMX: measure. The model's own linear shapes at batch 1, float32 vs bfloat16, on the
  kernel a decode step runs (kernels.dense_linear: warmstart's GEMV where it is built, else torch's), the median
  of 60 alternated passes (_measure); bfloat16 wins only if it is at least 25 % faster at batch 1, the decode case.
  It costs precision, so the win must be clear: SmolLM2's shapes measured 1.69-1.75x, a tiny test model's
  dispatch-bound ones 1.04-1.09x. On the 2-core AVX-512 EPYC the GEMV gave the default model's float weights
  65-73 tok/s in float32 and 144-169 in bfloat16 at batch 1 (torch's GEMM, and bfloat16 on the Python loop: 28
  and 28), and 248-262 vs 595-624 at batch 32 (benchmarks/decode.py workers). The research host
  (AVX512-BF16, no AMX) measured warmstart bf16/fp32 = 1.77x at batch 1 (shared/research/peers.md, finding 5). AMX
  used to mean bfloat16 without a measurement; on the 2-core AMX Xeon that was wrong: batch-1 linears fp32 163 us
  vs bf16 219-264 us (oneDNN's AMX tiles pay off at many rows, not at one), and the served default decoded at
  54-59 tok/s instead of 111-121.
(Quantized linears on warmstart's integer kernels take float32 regardless: dtypes.resolve_dtype.)
The decision is cached per (CPU model, ISA flags, torch version, probe kernel) under <cache>/probes/, so a restart
never measures again and two boots of one machine always agree (the plan key records the requested dtype)."""
from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from warmstart import kernels
from warmstart.paths import atomic_write_text

log = logging.getLogger("warmstart")
MARGIN = 1.25


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str                     # "float32" | "bfloat16"
    reason: str
    fp32_us: float | None = None   # median time of one probe pass at batch 1, microseconds
    bf16_us: float | None = None
    ratio: float | None = None     # median of the passes' fp32/bf16 time ratios: the verdict's measure


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


def _measure(shapes: list[tuple[int, int]], repeats: int = 60) -> DtypeChoice:
    """One pass over the shapes per dtype, the two dtypes alternated pass by pass after a few passes of warm-up, so
    a busy moment of the host or the kernels' pool waking from sleep hits both alike. The verdict is the median of
    the passes' fp32/bf16 ratios, which is steady where the best times are not: with 20 passes of one dtype and
    then 20 of the other, the bfloat16 best swung between 37 and 73 us on one host, and a tiny test model's linears
    (dispatch-bound, ratio ~1.05) came out either way across boots."""
    sets = {dt: ([torch.randn(n, k).to(dt) for n, k in shapes], [torch.randn(1, k).to(dt) for _, k in shapes])
            for dt in (torch.float32, torch.bfloat16)}

    def one_pass(dtype: torch.dtype) -> float:
        ws, x = sets[dtype]
        t0 = time.perf_counter()
        for xi, w in zip(x, ws):
            kernels.dense_linear(xi, w)
        return time.perf_counter() - t0

    times: dict[torch.dtype, list[float]] = {dt: [] for dt in sets}
    for i in range(repeats + 3):
        for dt in sets:
            t = one_pass(dt)
            if i >= 3:
                times[dt].append(t)
    ratio = statistics.median(a / b for a, b in zip(times[torch.float32], times[torch.bfloat16]))
    fp32, bf16 = (statistics.median(times[dt]) * 1e6 for dt in (torch.float32, torch.bfloat16))
    ratio = round(ratio, 3)                # the verdict is made on the recorded value
    dtype = "bfloat16" if ratio >= MARGIN else "float32"
    log.info("dtype auto: measured batch-1 linears fp32 %.0f us vs bf16 %.0f us (median ratio %.2f) -> %s", fp32,
             bf16, ratio, dtype)
    return DtypeChoice(dtype, "measured", round(fp32, 1), round(bf16, 1), ratio)


def _save(path: Path, choice: DtypeChoice) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(choice)), durable=False)
    except OSError as e:          # a read-only cache measures again next time; the choice is still right
        log.warning("could not cache the dtype probe at %s: %s", path, e)
