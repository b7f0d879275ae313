"""A step's OpenMP team pinned one thread per CPU while the step runs (why: warmstart/threads.py and
kernels/csrc/affinity.h).

The workers of the calling thread's team are pinned once (libgomp keeps them for that thread), the calling thread
only for the duration of a step: a thread or process it starts between steps inherits its mask, and must not inherit
one CPU.

While the host is busy (runner/step_threads.py decides; `spread`), the team is not pinned: the workers may run on
any of the CPUs and the calling thread keeps its own mask, so the scheduler can put each thread wherever a CPU comes
free first; quiet again, they are pinned again. Why: pinning is for a quiet host (cache locality, and no thread
stacked on another's core), but with a busy process on every core a pinned thread can only wait for its own CPU.
Default model, batch 1, two busy loops on the 2-core Zen 4 EPYC, separate processes alternated under one load
(`benchmarks/decode.py`'s alternated_under_load), tok/s: pinned 120.1, 109.5, 124.3, 108.8, 101.8, 156.2 and
129.5, 122.9, 120.4, 98.5, 122.9, 127.3, 100.8, 132.0 (mean 119.7) vs not pinned 130.7, 127.7, 143.5, 112.2, 164.3,
135.8 and 153.1, 121.4, 128.0, 116.7, 152.2, 163.1, 117.7, 121.5 (mean 134.9), faster in 11 of the 14 rounds; quiet,
pinned ran 275-277 tok/s against 256-271, hence pinned while quiet. This switch against the build before it, the
same way: 10 rounds, mean 105.7 vs 97.0 tok/s, faster in 7. In one process, quiet and loaded alternated
(`decode.py`'s paired figure, 3 processes of 4 pairs each), the engine had 0.79 cores of the 2 loaded instead of 0.73,
but the loaded means were even (117.2 vs 117.3 tok/s; slowdown medians 2.21x vs 2.32x): the gain is within this
host's spread there.
Batch 32 under the same load was even (medians 349.5 tok/s both)."""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from warmstart import kernels


class StepPinning:
    def __init__(self, cpus: tuple[int, ...] | None):
        self.cpus = cpus
        self.spread_out = False                # the host is busy: the team is not pinned (see the module docstring)
        self._local = threading.local()        # per calling thread: (team size, whether its workers got pinned,
                                               # whether they were last spread out)

    def spread(self, on: bool) -> None:
        """From the calling thread's next step on: the team not pinned (on: while the host is busy), or pinned."""
        self.spread_out = bool(on)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        cpus = self.cpus
        if cpus is None:
            yield
            return
        # The workers are (re)set for a smaller team too: they are the full team's, which a trial runs next.
        state = getattr(self._local, "state", None)
        if state is None or state[0] != len(cpus) or state[2] != self.spread_out:
            apply = kernels.spread_workers if self.spread_out else kernels.pin_workers
            state = self._local.state = (len(cpus), apply(list(cpus)) == len(cpus) - 1, self.spread_out)
        if not state[1] or state[2] or torch.get_num_threads() != len(cpus):
            yield               # workers not pinned (no compiled glue: pinning the caller alone could only stack it
            return              # on a worker's core), spread out, or a smaller team (or a count changed since)
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpus[0]})
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)
