"""The competing load of benchmarks/decode.py's under-load section, and the clock that says how much CPU each side
got: busy loops on every core, and CPU seconds per wall second of this process or of the loops."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


class Load:
    """Busy loops on every core: a neighbour that takes about half the CPU from a 2-thread engine on 2 cores."""

    def __init__(self, n: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]

    def __enter__(self):
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


class CpuClock:
    """CPU seconds per wall second (cores in use) since it was made: of this process (every thread), or of the
    processes `pids` (from /proc/<pid>/stat's utime and stime)."""

    def __init__(self, pids: list[int] | None = None):
        self.pids = pids
        self.t0, self.c0 = time.perf_counter(), self._cpu()

    def _cpu(self) -> float:
        if self.pids is None:
            t = os.times()
            return t.user + t.system
        tick = os.sysconf("SC_CLK_TCK")
        fields = (Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split() for p in self.pids)
        return sum(int(f[11]) + int(f[12]) for f in fields) / tick

    def cores(self) -> float:
        return (self._cpu() - self.c0) / (time.perf_counter() - self.t0)
