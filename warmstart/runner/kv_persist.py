"""Cached KV blocks on disk: one safetensors file. Its one tensor "kv" is the saved blocks' K/V in the cache's own
layout, [2, layers, blocks, block_size, kv_heads, head_dim]; its header metadata holds the JSON index (the key the
blocks were computed under, one entry per block, and the SHA-256 of the tensor bytes).

One file, so one atomic rename publishes data and index together (temp file, fsync, rename, fsync the folder). A
read maps the file and validates everything (header, size, key, layout, digest) before a byte reaches the KV cache;
any failure is a `Rejected` with the reason, and the caller carries on with a cold cache. The block entries are
opaque here: the engine's block manager verifies their keys. Only the copy into the KV tensor touches the data."""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from warmstart.paths import atomic_write

FORMAT = "warmstart.prefix-cache.v1"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8"}
_MAX_HEADER = 256 * 2**20          # the index of a few GiB of blocks is a few MiB; more is not a file we wrote


class Rejected(Exception):
    """The file cannot be used; str(e) says why (logged, then the boot continues without it)."""


@dataclass(frozen=True)
class Snapshot:
    """A validated file: its index and its data, mapped (not copied) until copy_into."""
    path: Path
    entries: list[dict]
    data: torch.Tensor                 # [2, layers, n, block_size, kv_heads, head_dim], backed by the mapping
    nbytes: int

    def copy_into(self, kv: torch.Tensor, rows: list[int], blocks: list[int]) -> None:
        """Write saved blocks `rows` into cache blocks `blocks`. At boot both are usually one contiguous run
        (the first free blocks, the file's first rows): then it is one copy straight from the mapping."""
        if _is_run(rows) and _is_run(blocks):
            kv[:, :, blocks[0]:blocks[0] + len(blocks)].copy_(self.data[:, :, rows[0]:rows[0] + len(rows)])
            return
        src = self.data.index_select(2, torch.tensor(rows, dtype=torch.long))
        kv.index_copy_(2, torch.tensor(blocks, dtype=torch.long, device=kv.device), src.to(kv.device))


def write(path: Path, kv: torch.Tensor, blocks: list[int], key: dict, entries: list[dict]) -> int:
    """Save cache blocks `blocks` (entries[i] describes blocks[i]) under key; returns the file's bytes."""
    data = kv.index_select(2, torch.tensor(blocks, dtype=torch.long, device=kv.device)).cpu().contiguous()
    digest = hashlib.sha256(_bytes_of(data)).hexdigest()
    index = {"format": FORMAT, "key": key, "entries": entries, "data_sha256": digest}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: save_file({"kv": data}, tmp,
                                             metadata={"index": json.dumps(index, separators=(",", ":"))}))
    return path.stat().st_size


def read(path: Path, key: dict, kv: torch.Tensor) -> Snapshot:
    """Map and validate the file for this key and this KV cache's layout; Rejected otherwise."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise Rejected(f"truncated: {size} bytes, shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(_MAX_HEADER, size - 8):
                raise Rejected(f"truncated or not a safetensors file: header of {n} bytes in a {size}-byte file")
            header = json.loads(f.read(n))
            index = json.loads(header["__metadata__"]["index"])
            spec = header["kv"]
            mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise Rejected(f"unreadable: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise Rejected(f"not a prefix cache file: bad header ({type(e).__name__}: {e})") from None
    if index.get("format") != FORMAT:
        raise Rejected(f"format {index.get('format')!r}, expected {FORMAT!r}")
    if index.get("key") != key:
        raise Rejected("written for another setup: " + "; ".join(_diff(index.get("key") or {}, key)))
    shape, dtype = spec.get("shape"), _DTYPES.get(kv.dtype)
    want = [kv.shape[0], kv.shape[1], len(index.get("entries", [])), *kv.shape[3:]]
    if spec.get("dtype") != dtype or shape != want:
        raise Rejected(f"tensor {spec.get('dtype')} {shape} does not fit a {dtype} cache of layout {want}")
    start, end = (8 + n + o for o in spec["data_offsets"])
    nbytes = end - start
    if end > size or nbytes != kv.element_size() * _numel(shape):
        raise Rejected(f"truncated: the index promises {end} bytes, the file has {size}")
    view = memoryview(mapping)[start:end]
    if hashlib.sha256(view).hexdigest() != index.get("data_sha256"):
        raise Rejected("the K/V bytes do not match their SHA-256 (corrupt or modified)")
    data = torch.frombuffer(mapping, dtype=kv.dtype, count=_numel(shape), offset=start).view(shape)
    return Snapshot(path, index["entries"], data, nbytes)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def _is_run(xs: list[int]) -> bool:
    return bool(xs) and xs[-1] - xs[0] == len(xs) - 1 and all(b - a == 1 for a, b in zip(xs, xs[1:]))


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _diff(old: dict, new: dict) -> list[str]:
    """'name saved -> now' for each key component that differs."""
    names = sorted(set(old) | set(new))
    return [f"{k} {_show(old.get(k, '<absent>'))} -> {_show(new.get(k, '<absent>'))}"
            for k in names if old.get(k, "<absent>") != new.get(k, "<absent>")]


def _show(v) -> str:
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return s if len(s) <= 60 else s[:28] + "…" + s[-28:]
