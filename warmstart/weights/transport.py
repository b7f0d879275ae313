"""Moving tensor bytes between a daemon and engines without copying them.

CPU: the daemon packs tensors into a few memfd regions, then seals them (no shrink, no grow, no write, no further
seals) and passes the fds with SCM_RIGHTS. Engines map them PROT_READ/MAP_SHARED and view tensors in place. The
kernel refuses any writable mapping of a write-sealed memfd, so an in-place write to a weight dies with SIGSEGV
instead of corrupting every engine's weights; and the mapping keeps the memory alive after the daemon dies.

CUDA (legacy IPC): the daemon packs tensors into one caching-allocator block per region and exports
`cudaIpcMemHandle`s through torch's `_share_cuda_`. The handle fields travel as plain bytes and ints (never a
pickle); the engine opens them with `_new_shared_cuda` on its own device index. These mappings are writable and
die with the daemon, hence the engine-side watchdog in client.py."""
from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from dataclasses import dataclass

import torch

from warmstart.weights.manifest import ALIGN, DTYPE_NAMES, TensorEntry, bytes_digest, dtype_name

REGION_MAX = 4 * 2**30          # bytes per region; larger tensors get a region of their own
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_WRITE_CHUNK = 1 << 30          # pwrite moves at most ~2 GiB per call on Linux


@dataclass(frozen=True)
class Slot:
    name: str
    region: int
    offset: int
    nbytes: int


def plan_layout(tensors: dict[str, torch.Tensor], align: int) -> tuple[list[Slot], list[int]]:
    """Pack tensors in order into regions of at most REGION_MAX bytes, each start aligned to `align`."""
    slots, sizes = [], [0]
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        start = -(-sizes[-1] // align) * align
        if start + n > REGION_MAX and sizes[-1] > 0:
            sizes.append(0)
            start = 0
        slots.append(Slot(name, len(sizes) - 1, start, n))
        sizes[-1] = start + n
    # mmap refuses zero-length maps; an empty region still gets one aligned unit
    return slots, [max(align, -(-s // align) * align) for s in sizes]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor, row-major (a copy only if t is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _entries(tensors: dict[str, torch.Tensor], slots: list[Slot], digests: list[str]) -> list[TensorEntry]:
    out = []
    for slot, digest in zip(slots, digests):
        t = tensors[slot.name]
        stride = torch.empty(tuple(t.shape), device="meta").stride()   # served tensors are contiguous
        out.append(TensorEntry(slot.name, dtype_name(t.dtype), tuple(t.shape), tuple(stride), slot.region,
                               slot.offset, slot.nbytes, digest))
    return out


# ------------------------------------------------------------------------------------------------ memfd (CPU)
def build_memfd_regions(tensors: dict[str, torch.Tensor], label: str) -> tuple[list[int], list[int],
                                                                               list[TensorEntry]]:
    """Write tensors into sealed memfds. Returns (fds, region sizes, entries with digests of the sealed bytes)."""
    slots, sizes = plan_layout(tensors, ALIGN["cpu"])
    fds = []
    try:
        for size in sizes:
            fd = os.memfd_create(f"warmstart-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            fds.append(fd)
            os.ftruncate(fd, size)
        for slot in slots:
            # pwrite from the tensor's own buffer: no intermediate bytes object, no writable mapping to undo
            data = memoryview(_raw(tensors[slot.name]).numpy()) if slot.nbytes else b""
            done = 0
            while done < slot.nbytes:
                done += os.pwrite(fds[slot.region], data[done:done + _WRITE_CHUNK], slot.offset + done)
        for fd in fds:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        # Digest what engines will map, not what we meant to write.
        maps = [map_readonly(fd, size) for fd, size in zip(fds, sizes)]
        try:
            digests = [bytes_digest(memoryview(maps[s.region])[s.offset:s.offset + s.nbytes]) for s in slots]
        finally:
            for m in maps:
                m.close()
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, sizes, _entries(tensors, slots, digests)


def check_sealed(fd: int, size: int) -> str | None:
    """None if fd is a fully sealed memfd of at least `size` bytes; else what is wrong (the daemon could still
    write or shrink it under our mapping: a shrink would turn reads into SIGBUS)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return "is not a sealable memfd"
    if seals & SEALS != SEALS:
        return f"is not fully sealed (seals 0x{seals:x})"
    if os.fstat(fd).st_size < size:
        return "is smaller than the manifest says"
    return None


def map_readonly(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


def region_tensor(m: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over a read-only mapping; it keeps the mapping alive for as long as any view of it lives."""
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable and writes are undefined. Here they are defined: the page
        # is PROT_READ and the memfd write-sealed, so a write faults (SIGSEGV) and can corrupt nothing.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(m, dtype=torch.uint8)


def view_entries(bases: list[torch.Tensor], entries: tuple[TensorEntry, ...]) -> dict[str, torch.Tensor]:
    """One view per manifest entry over its region: O(tensors), no bytes touched."""
    out = {}
    for e in entries:
        raw = bases[e.region].narrow(0, e.offset, e.nbytes)
        out[e.name] = raw.view(DTYPE_NAMES[e.dtype]).as_strided(e.shape, e.stride)
    return out


def verify_digests(tensors: dict[str, torch.Tensor], entries: tuple[TensorEntry, ...]) -> list[str]:
    """Names whose bytes do not hash to their manifest digest (reads every byte: for checks, not for boots)."""
    from warmstart.weights.manifest import tensor_digest
    return [e.name for e in entries if tensor_digest(tensors[e.name]) != e.digest]


# ------------------------------------------------------------------------------------------------ CUDA IPC
def build_cuda_regions(tensors: dict[str, torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor],
                                                                                       list[int],
                                                                                       list[TensorEntry]]:
    """Pack tensors into one allocation per region on device. Returns (region tensors, sizes, entries)."""
    slots, sizes = plan_layout(tensors, ALIGN["cuda"])
    regions = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
    for slot in slots:
        if slot.nbytes:
            regions[slot.region].narrow(0, slot.offset, slot.nbytes).copy_(_raw(tensors[slot.name]))
    torch.cuda.synchronize(device)
    digests = [bytes_digest(memoryview(regions[s.region].narrow(0, s.offset, s.nbytes).cpu().numpy()))
               for s in slots]
    return regions, sizes, _entries(tensors, slots, digests)


def export_cuda(region: torch.Tensor) -> dict:
    """IPC handle fields for one region, as msgpack-able values. Exported per delivery, as torch's own reducer
    does: each export reserves a ref-counter slot that the importer releases when its mapping dies."""
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = region.untyped_storage()._share_cuda_()
    return {"device": int(device), "handle": bytes(handle), "size": int(size), "offset": int(offset),
            "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle else None, "event_sync": bool(event_sync)}


def import_cuda(fields: dict, local_index: int, nbytes: int) -> torch.Tensor:
    """Open an exported region on our own device index (CUDA_VISIBLE_DEVICES may order GPUs differently from
    the daemon's; the caller matched them by UUID) and view it as nbytes of uint8."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        local_index, fields["handle"], fields["size"], fields["offset"], fields["ref_handle"],
        fields["ref_offset"], fields["event_handle"], fields["event_sync"])
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", local_index))
    return t.set_(storage, 0, (nbytes,), (1,))


def device_id(device: torch.device | str) -> str:
    """Names the memory a daemon serves into: "cpu" (one host), or the GPU's UUID, which stays the same when
    CUDA_VISIBLE_DEVICES numbers the GPUs differently in the daemon and the engine."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    return f"GPU-{torch.cuda.get_device_properties(device.index or 0).uuid}"


def local_cuda_index(uuid: str) -> int | None:
    """This process's index for the GPU with that device_id, or None if it cannot see it."""
    for i in range(torch.cuda.device_count()):
        if device_id(torch.device("cuda", i)) == uuid:
            return i
    return None
