"""How many threads a step runs on when other processes take the host's CPUs (why below; settings: threads.py).

A step's parallel loops run on a team of threads (the kernels' pool, torch's OpenMP team), and the calling thread
drives every step: between loops, and for the Python between steps, only it runs. When another process keeps every
core busy, each of the team's threads gets about half a core, in turns the scheduler deals independently, so the
other threads are often off their cores while the caller runs and the caller is off its core while they wait for the
next loop: measured on the 2-core Zen 4 EPYC with the default model at batch 1, 2 threads decoded 244 tok/s quiet
and 104 under two busy loops (2.35x slower), while one thread decoded 178 quiet and 177 under the same two busy
loops. With one busy loop the caller kept its core (the loop sat beside the pool's worker) and two threads were as
fast as one (189 vs 184 tok/s).

So the step's team shrinks when the host is busy, and grows back when it is not. Shrinking: the time the calling
thread spent runnable but not running (the second field of /proc/thread-self/schedstat, the scheduler's own
accounting), as a share of its step time over a window of WINDOW_S of step time; at BUSY or more the team shrinks
to the threads the host gives it (threads x (1 - share), at least one). Growing cannot use that share: a thread
alone often gets a core to itself while the busy processes share the others (its share then reads near 0 though a
second thread would bring the contention back). So a smaller team grows back when the CPUs this process may use had
IDLE_PER_THREAD of a CPU idle per missing thread over the window (idle time in /proc/stat), and tries the full team
every PROBE_S of step time anyway (a window at full size decides again). Results do not depend on the team size
(kernels/csrc/pool.h: chunk boundaries never change a result). WARMSTART_ADAPTIVE_THREADS=0 keeps the team fixed."""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch

log = logging.getLogger("warmstart")

WINDOW_S = 0.1      # step time per decision
BUSY = 0.25         # run-queue wait share at which the team shrinks (two busy loops on 2 cores: 0.50 at 2 threads)
IDLE_PER_THREAD = 0.5  # idle CPU per missing thread at which a smaller team grows back
PROBE_S = 5.0       # step time between tries of the full team while smaller


def run_queue_wait_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU, or None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class IdleCpus:
    """Idle CPUs (a sum of fractions of a CPU) among `cpus` since the previous call, from /proc/stat; None where
    the kernel does not say, and on the first call."""

    def __init__(self, cpus: set[int]):
        self.names = {f"cpu{c}" for c in cpus}
        self._last: dict[str, tuple[int, int]] | None = None

    def __call__(self) -> float | None:
        try:
            with open("/proc/stat") as f:
                now = {}
                for line in f:
                    name, _, rest = line.partition(" ")
                    if name in self.names:
                        v = [int(x) for x in rest.split()[:8]]      # user nice system idle iowait irq softirq steal
                        now[name] = (v[3] + v[4], sum(v))
        except (OSError, ValueError, IndexError):
            return None
        last, self._last = self._last, now
        if not last or not now:
            return None
        return sum((now[c][0] - last[c][0]) / (now[c][1] - last[c][1])
                   for c in now if c in last and now[c][1] > last[c][1])


@dataclass(frozen=True)
class TeamChange:
    """One decision that changed the team size (kept for the metrics and the tests)."""
    at_s: float             # step time since the first step
    threads: int
    wait_share: float       # the calling thread's run-queue wait / step time over the window that decided it
    idle_cpus: float | None  # idle CPUs over that window (None: unknown)
    reason: str             # "busy" (shrink) | "quiet" (grow) | "probe" (try the full team)


class StepThreads:
    """The engine's per-step context: sets the step's team size, then enters `pinning` (runner/affinity.py; it pins
    only a full team). Decisions are per calling thread's measurements; one engine steps from one thread."""

    def __init__(self, threads: int, pinning: Callable[[], ContextManager[None]], adaptive: bool = True,
                 wait_s: Callable[[], float | None] = run_queue_wait_s,
                 idle_cpus: Callable[[], float | None] | None = None, clock: Callable[[], float] = time.perf_counter):
        self.full = max(1, threads)
        self.pinning = pinning
        self.wait_s, self.clock = wait_s, clock
        self.idle_cpus = idle_cpus if idle_cpus is not None else IdleCpus(os.sched_getaffinity(0))
        self.adaptive = adaptive and self.full > 1
        self.team = self.full
        self.changes: list[TeamChange] = []
        self._busy = 0.0            # step time in the current window
        self._total = 0.0           # step time since the first step
        self._since_full = 0.0      # step time since the team was last full
        self._w0: float | None = None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if not self.adaptive:
            with self.pinning():
                yield
            return
        if self._w0 is None:
            self._w0 = self.wait_s()
            if self._w0 is None:
                self.adaptive = False
                log.info("adaptive threads off: this kernel does not report run-queue waits "
                         "(/proc/thread-self/schedstat)")
        prev = torch.get_num_threads()
        shrunk = self.team < prev           # a full team leaves the count as it is (as a step did before)
        if shrunk:
            torch.set_num_threads(self.team)
        t0 = self.clock()
        try:
            with self.pinning():
                yield
        finally:
            dt = self.clock() - t0
            if shrunk:                      # the calling thread's count outside steps is its own business
                torch.set_num_threads(prev)
            self._busy += dt
            self._total += dt
            if self.adaptive and self._busy >= WINDOW_S:
                self._decide()

    def _decide(self) -> None:
        w, idle = self.wait_s(), self.idle_cpus()
        if w is None or self._w0 is None:
            return
        share = min(1.0, max(0.0, (w - self._w0) / self._busy))
        if self.team < self.full:
            self._since_full += self._busy
        self._w0, self._busy = w, 0.0
        if self.team == self.full:
            if share >= BUSY:
                self._set(max(1, min(self.team - 1, round(self.team * (1.0 - share)))), share, idle, "busy")
        elif idle is not None and idle >= IDLE_PER_THREAD * (self.full - self.team):
            self._set(self.full, share, idle, "quiet")
        elif self._since_full >= PROBE_S:
            self._set(self.full, share, idle, "probe")

    def _set(self, team: int, share: float, idle: float | None, reason: str) -> None:
        before, self.team = self.team, team
        after_probe = bool(self.changes) and self.changes[-1].reason == "probe"
        if team == self.full:
            self._since_full = 0.0
        self.changes.append(TeamChange(round(self._total, 3), team, round(share, 3),
                                       None if idle is None else round(idle, 2), reason))
        del self.changes[:-64]
        if reason == "busy" and not after_probe:  # a probe, and its answer while the host is still busy: routine
            log.info("step threads %d -> %d: the host is busy (this thread waited for a CPU %.0f%% of its step time)",
                     before, team, 100 * share)
        elif reason == "quiet":
            log.info("step threads %d -> %d: the host has idle CPUs again (%.1f)", before, team, idle)
