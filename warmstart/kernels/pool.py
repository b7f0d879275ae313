"""The kernels' own thread pool (csrc/pool.h), shared by every compiled module, and where its workers run."""
from __future__ import annotations

from warmstart.kernels.attention import _native
from warmstart.kernels.fused import _fused
from warmstart.kernels.linear import _qlinear
from warmstart.kernels.stack import _stack

def _pool_module():
    """Any loaded compiled module: they share one thread pool (csrc/pool.h), so one of them answers for all."""
    return next((m for m in (_native, _qlinear, _fused, _stack) if m is not None and hasattr(m, "pool_stats")), None)


def pool_stats() -> dict | None:
    """The kernels' thread pool so far (csrc/pool.h): loops it ran, chunks the calling thread ran, chunks its
    workers ran, and seconds the caller waited for a worker's chunk. None without compiled kernels."""
    m = _pool_module()
    if m is None:
        return None
    loops, caller, workers, wait_ns = m.pool_stats()
    return {"loops": loops, "caller_chunks": caller, "worker_chunks": workers, "caller_wait_s": wait_ns / 1e9}


def set_pool_enabled(on: bool) -> None:
    """Run the kernels' parallel loops on their own pool (the default) or on torch's OpenMP team from the next loop
    on (what WARMSTART_THREAD_POOL=0 chooses at start): for tests and A/B measurements."""
    m = _pool_module()
    if m is not None:
        m.set_pool_enabled(bool(on))


def pin_workers(cpus: list[int]) -> int:
    """Pin team thread t >= 1 of the calling thread's OpenMP pool to cpus[t] (csrc/affinity.h), and worker t of the
    kernels' own pool (csrc/pool.h) to the same CPU from its next loop on; the caller pins itself. Returns how many
    OpenMP workers were pinned: 0 without the compiled glue (nothing pinned, nothing breaks)."""
    pool = _pool_module()
    if pool is not None:
        pool.set_pool_cpus(list(cpus))
    return _fused.pin_workers(list(cpus)) if _fused is not None else 0


def spread_workers(cpus: list[int]) -> int:
    """Undo pin_workers(cpus) until it is called again: team threads t >= 1 of the calling thread's OpenMP pool, and
    the kernels' pool's workers from their next loop on, may run on any of `cpus` (runner/affinity.py: while the
    host is busy). Returns how many OpenMP workers were set: 0 without the compiled glue."""
    pool = _pool_module()
    if pool is not None:
        pool.set_pool_spread(True)
    return _fused.spread_workers(list(cpus)) if _fused is not None else 0
