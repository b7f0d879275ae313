"""CPU threads that behave on a shared host: how many, and how idle OpenMP workers wait.

torch's CPU build uses GNU OpenMP (libgomp), which reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch's
shared library loads. So `configure` must run before the first `import torch` to choose the wait policy; the
thread count can still be set afterwards.

Why passive by default: libgomp's default spins for a while at the end of every parallel region. On a host where
other processes take a core, a spinning worker that lost its core makes every later region wait for it. Measured
on a 2-core host at load average ~5 (shared/research/peers.md, finding 1; `benchmarks/decode.py --under-load`
repeats it): a 2-thread 576x1536 fp32 linear took 7-25 ms with active waiting vs 0.2-1.3 ms passive, and a
plan-hit boot 17.2 s vs 4.3 s; on a quiet host the two policies are equal (1.64 vs 1.66 s). Passive costs nothing
when quiet and saves 3-4x when not. A user's own OMP_WAIT_POLICY in the environment wins.

Why OpenMP workers no longer spin (GOMP_SPINCOUNT=0, which libgomp honours under PASSIVE too): warmstart's own
kernels (paged attention, quantized linears, the fused glue and the decoder stack: nearly all of a decode step in
the default quantized mode) run their parallel loops on their own pool (kernels/csrc/pool.h), whose workers spin
briefly (WARMSTART_POOL_SPIN_US, 200 us) and whose loops do not wait for a worker that never got the CPU. What is
left on torch's OpenMP team is a few regions per step (the embedding, sampling) and torch's float matmuls. An
OpenMP worker spinning after those shares its CPU with the pool's worker there (both are pinned to it) and slows
the step it spins into. Measured on the 2-core host, the default model, both loop back-ends alternated round by
round in one process (4 rounds, medians): with OpenMP spinning 100,000 (the old default, about 1 ms) the pool was
no faster than OpenMP (batch 1 73 vs 79 tok/s, batch 32 241 vs 272, under busy loops 33 vs 31); with no spin the
pool ran batch 1 at 89 tok/s, batch 32 at 309 and 43 under load (OpenMP without spin: 84, 267 and 30). The float32
model (torch's matmuls on OpenMP; separate processes, 2 rounds) was within noise of the old setting: batch 1
10.1-10.8 tok/s with no spin vs 10.4-11.2 spinning 100,000, batch 32 117-129 vs 108-114. Against the old default
as a whole (the OpenMP team spinning 100,000), separate processes interleaved, 4 each: batch 1 under busy loops
slowed down 2.13x (median of 12 quiet/loaded pairs) vs 2.38x, loaded 34.6 vs 30.7 tok/s, quiet 75.4 vs 74.9, and
batch 32 290-334 tok/s (median 307) vs 279-375 (332), within this host's spread. A user's own GOMP_SPINCOUNT wins.

Why a step's team may shrink while the host is busy (runner/step_threads.py): with every core shared with a busy
process, the threads of a parallel step take turns on their cores independently and often wait for each other; at
batch 1 one thread decoded as fast as two or faster there, while at batch 32 two stayed faster, so the team size is
chosen by the rate the steps get.

No torch import here: this module runs before torch exists in the process."""
from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("warmstart")

DEFAULT_WAIT_POLICY = "PASSIVE"
DEFAULT_SPIN_COUNT = 0            # OpenMP workers sleep at once; the kernels' pool spins (see above)


@dataclass(frozen=True)
class ThreadSettings:
    """What the process runs with (reported in the startup report under `threads`)."""
    threads: int                  # intra-op threads torch uses
    available_cpus: int           # cores this process may use (affinity mask and cgroup quota)
    wait_policy: str              # OMP_WAIT_POLICY in force when torch's OpenMP runtime loaded
    policy_source: str            # "warmstart default" | "environment" | "set after torch loaded (no effect)"
    spin_count: str | None = None  # GOMP_SPINCOUNT in force when torch's OpenMP runtime loaded (None: libgomp's)
    pin_cpus: tuple[int, ...] | None = None   # team thread t runs on pin_cpus[t] during a step; None: not pinned
    pinning: str = ""             # why pin_cpus is what it is
    kernel_pool: bool = True      # the compiled kernels' loops run on their own pool (WARMSTART_THREAD_POOL=0: off)
    adaptive: bool = True         # a step's team is chosen by rate while the host is busy (runner/step_threads.py;
                                  # WARMSTART_ADAPTIVE_THREADS=0: off)

    def to_dict(self) -> dict:
        return {"threads": self.threads, "available_cpus": self.available_cpus, "wait_policy": self.wait_policy,
                "policy_source": self.policy_source, "spin_count": self.spin_count,
                "pin_cpus": list(self.pin_cpus) if self.pin_cpus else None, "pinning": self.pinning,
                "kernel_pool": self.kernel_pool, "adaptive": self.adaptive and self.threads > 1}


def available_cpus() -> int:
    """Cores this process may run on: its affinity mask, further limited by a cgroup CPU quota (containers)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(n, math.ceil(quota))) if quota else max(1, n)


def _cgroup_quota() -> float | None:
    """CPUs allowed by the cgroup (v2 cpu.max, or v1 cfs quota/period); None when unlimited or unknown."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


_settings: ThreadSettings | None = None


def configure(threads: int | None = None) -> ThreadSettings:
    """Choose the thread count (default: available_cpus()) and, if torch has not loaded yet, the OpenMP wait
    policy. Idempotent; a later call with another count only changes the count."""
    global _settings
    avail = available_cpus()
    n = threads if threads is not None else _env_threads() or avail
    torch_loaded = "torch" in sys.modules
    if _settings is not None:
        source, policy = _settings.policy_source, _settings.wait_policy
    elif "OMP_WAIT_POLICY" in os.environ:
        source = "warmstart default" if _policy_set_by_us else "environment"
        policy = os.environ["OMP_WAIT_POLICY"].upper()
    elif torch_loaded:
        source, policy = "set after torch loaded (no effect)", "ACTIVE (libgomp default)"
        log.warning("torch was imported before warmstart could choose the OpenMP wait policy; idle threads will "
                    "spin, which is slow on a busy host. Set OMP_WAIT_POLICY=PASSIVE before importing torch.")
    else:
        source, policy = "warmstart default", DEFAULT_WAIT_POLICY
        _set_defaults()
    if not torch_loaded:
        os.environ["OMP_NUM_THREADS"] = str(n)
    else:
        import torch
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    pin, why = _pin_cpus(n, avail)
    pool = _env_flag("WARMSTART_THREAD_POOL")
    _settings = ThreadSettings(n, avail, policy, source, os.environ.get("GOMP_SPINCOUNT"), pin, why, pool,
                               _env_flag(ADAPTIVE_ENV))
    return _settings


PIN_ENV = "WARMSTART_PIN_THREADS"
ADAPTIVE_ENV = "WARMSTART_ADAPTIVE_THREADS"
_USER_PLACEMENT = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")


def _pin_cpus(n: int, avail: int) -> tuple[tuple[int, ...] | None, str]:
    """The CPUs a team of n threads is pinned to (one each), or None, with the reason."""
    if os.environ.get(PIN_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None, f"off ({PIN_ENV}={os.environ[PIN_ENV]})"
    user = [k for k in _USER_PLACEMENT if k in os.environ]
    if user:
        return None, f"the environment's ({', '.join(user)})"
    if n < 2:
        return None, "off (one thread)"
    try:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return None, "off (no affinity mask on this platform)"
    if len(cpus) != n or avail != n:
        return None, f"off ({n} threads for {avail} CPUs: the scheduler places them)"
    return cpus, "one thread per CPU"


def _env_flag(name: str) -> bool:
    """An on-by-default integer switch, parsed as csrc/pool.h parses it: off only when it reads as the integer 0."""
    try:
        return int(os.environ.get(name, "").strip()) != 0
    except ValueError:
        return True


def _set_defaults() -> None:
    os.environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
    os.environ.setdefault("GOMP_SPINCOUNT", str(DEFAULT_SPIN_COUNT))


def _env_threads() -> int | None:
    """A thread count the user put in OMP_NUM_THREADS (honoured like an explicit --threads)."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return n if n > 0 else None


def prepare_env() -> None:
    """Choose the passive wait policy if torch has not loaded yet and the user did not choose one: called when
    warmstart's engine modules are imported, so an `LLM(...)` in a fresh process gets it too."""
    if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
        _set_defaults()
        global _policy_set_by_us
        _policy_set_by_us = True


_policy_set_by_us = False


def current() -> ThreadSettings:
    """The settings in force (configuring the defaults if nobody has yet)."""
    return _settings if _settings is not None else configure()
