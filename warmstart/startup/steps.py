"""Startup as an ordered list of named, timed steps that tile the wall clock from process start to ready.

Each step's duration runs from the end of the previous step to its own end, so the durations add up to the
measured wall time by construction; the first step ('imports') starts at the kernel's process start time."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field


def process_age_seconds() -> float:
    """Seconds since this process started, from /proc (includes interpreter start and imports)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class StepTimer:
    steps: list[tuple[str, float]] = field(default_factory=list)
    _origin: float = 0.0
    _last: float = 0.0

    @classmethod
    def from_process_start(cls) -> "StepTimer":
        now = time.perf_counter()
        timer = cls(_origin=now - process_age_seconds(), _last=now)
        timer.steps.append(("imports", now - timer._origin))
        return timer

    @classmethod
    def starting_now(cls) -> "StepTimer":
        """For a boot inside a process that started long ago (a library user): imports are already paid."""
        now = time.perf_counter()
        return cls(steps=[("imports", 0.0)], _origin=now, _last=now)

    @contextmanager
    def step(self, name: str):
        """Time a step; whatever ran since the previous step ended is charged to this one, never lost."""
        try:
            yield
        finally:
            now = time.perf_counter()
            self.steps.append((name, now - self._last))
            self._last = now

    @property
    def wall_seconds(self) -> float:
        return self._last - self._origin

    def table(self) -> str:
        lines = [f"  {name:<16} {secs:8.3f} s" for name, secs in self.steps]
        lines.append(f"  {'total':<16} {self.wall_seconds:8.3f} s")
        return "\n".join(lines)

    def to_list(self) -> list[dict]:
        return [{"name": n, "seconds": round(s, 6)} for n, s in self.steps]
