"""Attention that reads the paged KV cache in place.

`paged_attention` runs the compiled CPU kernel (warmstart.kernels._paged, built by `make venv` via setup.py) when it
is available and the inputs are on the CPU, and the pure-torch `paged_attention_torch` otherwise; both have the same
semantics. `has_native()` says which one runs, and `NATIVE_UNAVAILABLE_REASON` says why the kernel is not used
(None when it is).

Layout: k_cache/v_cache are one layer's [num_blocks, block_size, Hkv, D]; context position p of sequence s lives at
cache[block_tables[s, p // block_size], p % block_size]. Query t (of sequence seq_idx[t]) attends over positions
0..ctx_lens[t]-1, so a chunk of new tokens at positions c..c+n-1 passes ctx_lens c+1..c+n (causal). The kernels take
any strides with contiguous rows; the runner's cache is head-major in memory (`kv_blocks`)."""
from __future__ import annotations

import logging

import torch

from warmstart.kernels.loader import load_native

log = logging.getLogger(__name__)

_native, NATIVE_UNAVAILABLE_REASON = load_native("_paged")
if NATIVE_UNAVAILABLE_REASON is not None:
    log.info("paged attention: pure-torch fallback (%s)", NATIVE_UNAVAILABLE_REASON)


def has_native() -> bool:
    return _native is not None


# ------------------------------------------------------------------------------------------------ int8 KV rows
# An int8 cache row holds a (token, head)'s D codes, then its float32 scale in the next 4 bytes: x = code * scale,
# scale = max|x| / 127 (per token and head, as llama.cpp's q8_0 cache does per block of 32). 68 bytes per row of 64
# instead of 128 (float16): a long context's decode reads ~half the bytes, and a budget holds ~1.9x the blocks.
KV_SCALE_BYTES = 4


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, head) row of the KV cache: head_dim, and an int8 row's 4 scale bytes after it."""
    return head_dim + KV_SCALE_BYTES if dtype is torch.int8 else head_dim


def kv_blocks(storage: torch.Tensor, lead: tuple[int, ...], num_blocks: int, block_size: int, kv_heads: int,
              row: int) -> torch.Tensor:
    """`storage` (contiguous, numel = prod(lead) x num_blocks x block_size x kv_heads x row) as the cache's logical
    [*lead, num_blocks, block_size, kv_heads, row], laid out head-major: [*lead, num_blocks, kv_heads, block_size,
    row] in memory, so each head's rows of a block are block_size x row contiguous elements, as vLLM lays them out.
    Decode attention reads one head's rows position after position; with heads interleaved per position (the
    logical order in memory) that is a stride of kv_heads rows, and on Zen 2/3 EPYCs the hardware prefetcher then
    falls behind. Batch 8 x 2,048 positions, same kernel, bit-identical results (benchmarks/paged_attention.py
    --layouts head position): float16 1.39x (1 thread) and 1.20x (2) faster head-major on a Zen 3, 1.19x and 1.21x
    on a Zen 2; int8 1.06-1.11x (its arithmetic, not memory, limits it there)."""
    n = len(lead)
    return storage.view(*lead, num_blocks, kv_heads, block_size, row).transpose(n + 1, n + 2)


def head_major_copy(cache: torch.Tensor) -> torch.Tensor:
    """A copy of one layer's [blocks, block_size, Hkv, row] cache (any layout) laid out as the runner's: kv_blocks
    over new head-major storage. For tests and benchmarks that compare the layouts."""
    return kv_blocks(torch.empty(cache.numel(), dtype=cache.dtype), (), *cache.shape).copy_(cache)


def kv_slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows of `slots` (slot = block x block_size + offset) of one layer's cache [blocks, block_size, Hkv, row]:
    a new [len(slots), Hkv, row] tensor."""
    bs = cache.shape[1]
    return cache[slots // bs, slots % bs]


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """float [..., D] -> int8 [..., D + 4] rows (codes, then the float32 scale's bytes); the compiled write_kv writes
    the same bytes (csrc/fused.h write_rows_i8)."""
    x = x.float()
    d = x.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(d > 0, (x / d).round().clamp(-127, 127), torch.zeros_like(x)).to(torch.int8)
    return torch.cat([codes, d.contiguous().view(torch.int8)], dim=-1)


def kv_rows_as(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] read back as [..., D] values of `dtype` (int8 rows: codes * scale)."""
    if rows.dtype is not torch.int8:
        return rows.to(dtype)
    d = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-KV_SCALE_BYTES].float() * d).to(dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_idx: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (D + 4 for int8 rows); block_tables int32
    [S, max_blocks]; seq_idx, ctx_lens int32 [T]. Returns [T, H, D] in q's dtype, accumulated in fp32."""
    if _native is not None and q.device.type == "cpu" and k_cache.device.type == "cpu":
        if v_cache.dtype != k_cache.dtype:
            v_cache = v_cache.to(k_cache.dtype)
        out = _native.paged_attention(q, k_cache, v_cache, block_tables, seq_idx, ctx_lens, float(scale))
        return out if q.dtype == torch.float32 else out.to(q.dtype)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_idx, ctx_lens, scale)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_idx: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The same semantics in plain torch (any device): per sequence, gather its context blocks once, then attend all
    of that sequence's queries with a mask (position p visible to query t iff p < ctx_lens[t]). fp32 math."""
    T, H, D = q.shape
    _, bs, Hkv, row = k_cache.shape
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    if T == 0:
        return out.to(q.dtype)
    G = H // Hkv
    seq_cpu, ctx_cpu = seq_idx.tolist(), ctx_lens.tolist()
    by_seq: dict[int, list[int]] = {}
    for t, s in enumerate(seq_cpu):
        by_seq.setdefault(s, []).append(t)
    for s, rows in by_seq.items():
        length = max(ctx_cpu[t] for t in rows)
        if length == 0:
            continue
        nblk = -(-length // bs)
        ids = block_tables[s, :nblk].to(device=k_cache.device, dtype=torch.long)
        kk = kv_rows_as(k_cache.index_select(0, ids).reshape(nblk * bs, Hkv, row)[:length], torch.float32)
        vv = kv_rows_as(v_cache.index_select(0, ids).reshape(nblk * bs, Hkv, row)[:length], torch.float32)
        idx = torch.tensor(rows, device=q.device)
        qs = q.index_select(0, idx).float().view(len(rows), Hkv, G, D)                  # [n, Hkv, G, D]
        scores = torch.einsum("nkgd,lkd->nkgl", qs, kk) * scale                       # [n, Hkv, G, L]
        lens = torch.tensor([ctx_cpu[t] for t in rows], device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] < lens[:, None]        # [n, L]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)                                        # ctx_len 0 rows -> zeros
        o = torch.einsum("nkgl,lkd->nkgd", probs, vv).reshape(len(rows), H, D)
        out.index_copy_(0, idx, o)
    return out.to(q.dtype)


def paged_int8_lanes(head_dim: int) -> int | None:
    """8 or 16: the lanes of the paged-attention kernel's int8-cache tile step at this head_dim under the ISA in force
    (16 where the CPU has AVX-512 VNNI, set_qlinear_isa allows it and head_dim is a multiple of 32); None without
    the compiled kernel."""
    return _native.int8_lanes(head_dim) if _native is not None else None
