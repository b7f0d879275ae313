"""A step's OpenMP team pinned one thread per CPU while the step runs (why: warmstart/threads.py and
kernels/csrc/affinity.h).

The workers of the calling thread's team are pinned once (libgomp keeps them for that thread), the calling thread
only for the duration of a step: a thread or process it starts between steps inherits its mask, and must not inherit
one CPU."""
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
        self._local = threading.local()        # per calling thread: (team size, whether its workers got pinned)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        cpus = self.cpus
        if cpus is None or torch.get_num_threads() != len(cpus):  # not pinned, or someone changed the count since
            yield
            return
        state = getattr(self._local, "state", None)
        if state is None or state[0] != len(cpus):
            state = self._local.state = (len(cpus), kernels.pin_workers(list(cpus)) == len(cpus) - 1)
        if not state[1]:                      # workers not pinned (no compiled glue): pinning the caller alone
            yield                             # could only stack it on a worker's core
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpus[0]})
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)
