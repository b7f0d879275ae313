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
        self._local = threading.local()        # per calling thread: the team size its workers were pinned for

    @contextmanager
    def __call__(self) -> Iterator[None]:
        cpus = self.cpus
        if cpus is None or torch.get_num_threads() != len(cpus):  # not pinned, or someone changed the count since
            yield
            return
        if getattr(self._local, "team", None) != len(cpus):
            kernels.pin_workers(list(cpus))
            self._local.team = len(cpus)
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpus[0]})
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)
