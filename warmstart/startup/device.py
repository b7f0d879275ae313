"""Device memory facts behind one small interface: total, free, name, capability, and peak measurement.

CPU: total is host RAM (or the cgroup limit when lower), free is MemAvailable, the process's own use is its RSS,
and the activation peak is measured by tracking every tensor torch functions return during the profiling forward
(exact and repeatable, unlike RSS, whose malloc arenas drift by megabytes between runs).
CUDA: total and free from cudaMemGetInfo, peak from the caching allocator's max_memory_allocated."""
from __future__ import annotations

import os
import weakref
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from warmstart.errors import UserError

CPU_FLAGS = ("avx", "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "neon", "sve")


@dataclass(frozen=True)
class DeviceFacts:
    kind: str                 # "cpu" | "cuda"
    name: str
    total_bytes: int
    capability: str           # CUDA "sm_90"; CPU the ISA flags that change kernels ("avx2,avx512f,...")
    index: int = 0

    @property
    def has_fast_bf16(self) -> bool:
        if self.kind == "cuda":
            return int(self.capability.removeprefix("sm_")) >= 80
        # AVX512-BF16's vdpbf16ps (kernels/csrc/dense_linear.h) or AMX tiles: bfloat16 products in hardware
        return bool({"amx_bf16", "avx512_bf16"} & set(self.capability.split(",")))


class Device(ABC):
    """The shared interface. `facts` never change during a process; `free_bytes` and `process_bytes` are live."""
    kind = "abstract"
    default_plan_tolerance = 0       # bytes of free-memory shortfall a plan tolerates by default

    @abstractmethod
    def facts(self) -> DeviceFacts: ...

    @abstractmethod
    def free_bytes(self) -> int: ...

    @abstractmethod
    def process_bytes(self) -> int:
        """Memory this process holds on the device (CPU: RSS; CUDA: the caching allocator's reservation)."""

    @abstractmethod
    def torch_device(self) -> torch.device: ...

    @abstractmethod
    def track_peak(self):
        """Context manager yielding a dict; on exit dict['peak_bytes'] is the peak allocated above the start."""


class CpuDevice(Device):
    kind = "cpu"
    # Back-to-back boots on a quiet host see MemAvailable move by tens of MiB (page cache, other daemons).
    # 256 MiB tolerates that; a process newly holding a GiB still fails the gate.
    default_plan_tolerance = 256 * 2**20

    def facts(self) -> DeviceFacts:
        info = _meminfo()
        total = min(info["MemTotal"], _cgroup_limit() or info["MemTotal"])
        name, flags = "cpu", set()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name") and name == "cpu":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
        except OSError:
            pass
        return DeviceFacts("cpu", name, total, ",".join(f for f in CPU_FLAGS if f in flags))

    def free_bytes(self) -> int:
        free = _meminfo()["MemAvailable"]
        limit = _cgroup_limit()
        if limit:
            used = _read_int("/sys/fs/cgroup/memory.current")
            if used is not None:
                free = min(free, limit - used)
        return free

    def process_bytes(self) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    @contextmanager
    def track_peak(self):
        result = {"peak_bytes": 0}
        with _AllocationTracker() as tracker:
            yield result
        result["peak_bytes"] = tracker.peak


class CudaDevice(Device):
    kind = "cuda"
    default_plan_tolerance = 0

    def __init__(self, index: int = 0):
        self.index = index

    def facts(self) -> DeviceFacts:
        p = torch.cuda.get_device_properties(self.index)
        return DeviceFacts("cuda", p.name, p.total_memory, f"sm_{p.major}{p.minor}", self.index)

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.index)[0]

    def process_bytes(self) -> int:
        # Everything this process holds on the GPU: the caching allocator's reservations plus non-torch memory
        # (CUDA context, cuBLAS workspaces) cannot be separated per process; reserved is the part we own.
        return torch.cuda.memory_reserved(self.index)

    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index)

    @contextmanager
    def track_peak(self):
        result = {"peak_bytes": 0}
        torch.cuda.synchronize(self.index)
        base = torch.cuda.memory_allocated(self.index)
        torch.cuda.reset_peak_memory_stats(self.index)
        yield result
        torch.cuda.synchronize(self.index)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(self.index) - base


def get_device(kind: str, index: int = 0) -> Device:
    if kind != "cuda":
        return CpuDevice()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        raise UserError(f"--device cuda:{index} asks for a GPU this machine does not have (torch sees "
                        f"{count} CUDA device{'s' if count != 1 else ''}). Use --device cpu, or a valid index.")
    return CudaDevice(index)


class _AllocationTracker(TorchFunctionMode):
    """Counts the bytes of every storage a torch function creates and subtracts them when the last tensor on it
    dies. A function mode, not a dispatch mode: entering a dispatch mode imports torch._dynamo (a second of boot)."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self._live: dict[int, list[int]] = {}       # storage data_ptr -> [nbytes, live tensor objects]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in inputs and ptr not in self._live:
                continue                               # an in-place op or a view of a pre-existing tensor
            entry = self._live.get(ptr)
            if entry is None:
                entry = self._live[ptr] = [t.untyped_storage().nbytes(), 0]
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(t, self._release, ptr)
        return out

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[ptr]


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def _cgroup_limit() -> int | None:
    value = _read_int("/sys/fs/cgroup/memory.max")
    return value if value and value < 1 << 60 else None


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None
