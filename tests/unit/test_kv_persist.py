"""The prefix cache file on its own: round trip of chosen blocks, both copy paths, and every rejection reason."""
import json

import pytest
import torch

from warmstart.runner import kv_persist

KEY = {"model": "m", "block_size": 4}


def cache(num_blocks=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, num_blocks, 4, 2, 8, generator=g).to(dtype)     # [2, layers, blocks, bs, heads, dim]


def entries(n):
    return [{"key": f"{i:02x}", "tokens": [i] * 4} for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_into_a_contiguous_run_and_scattered_blocks(tmp_path, dtype):
    kv = cache(dtype=dtype)
    path = tmp_path / "p.safetensors"
    size = kv_persist.write(path, kv, [4, 1, 2], KEY, entries(3))
    assert size == path.stat().st_size and not list(tmp_path.glob(".*.tmp"))
    fresh = torch.zeros_like(kv)
    snap = kv_persist.read(path, KEY, fresh)
    assert snap.entries == entries(3) and snap.nbytes == 3 * kv[:, :, 0].numel() * kv.element_size()
    snap.copy_into(fresh, [0, 1, 2], [0, 1, 2])                    # one run: a slice copy from the mapping
    assert torch.equal(fresh[:, :, 0], kv[:, :, 4]) and torch.equal(fresh[:, :, 2], kv[:, :, 2])
    scattered = torch.zeros_like(kv)
    snap.copy_into(scattered, [2, 0], [5, 3])                      # anything else: gather and scatter
    assert torch.equal(scattered[:, :, 5], kv[:, :, 2]) and torch.equal(scattered[:, :, 3], kv[:, :, 4])
    assert not scattered[:, :, :3].any()


def _reject(path, key=KEY, kv=None):
    with pytest.raises(kv_persist.Rejected) as e:
        kv_persist.read(path, key, cache() if kv is None else kv)
    return str(e.value)


def test_every_damage_is_rejected_with_its_reason(tmp_path):
    kv = cache()
    path = tmp_path / "p.safetensors"
    kv_persist.write(path, kv, [0, 1], KEY, entries(2))
    good = path.read_bytes()
    assert "model m -> other" in _reject(path, {**KEY, "model": "other"})
    assert "block_size 4 -> <absent>" in _reject(path, {"model": "m"})
    assert "does not fit" in _reject(path, kv=cache().to(torch.float16))
    assert "does not fit" in _reject(path, kv=torch.zeros(2, 3, 6, 4, 1, 8))
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert "SHA-256" in _reject(path)
    path.write_bytes(good[:-64])
    assert "truncated" in _reject(path)
    path.write_bytes(good[:5])
    assert "truncated" in _reject(path)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + good[24:])
    assert "bad header" in _reject(path)
    header = {"__metadata__": {"index": json.dumps({"format": "someone-else"})}, "kv": {}}
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    assert "format" in _reject(path)
    assert "unreadable" in _reject(tmp_path / "missing.safetensors")
