"""Attention over the paged KV cache (CPU, and CUDA through the same code).

Cache layout: kv[2, layers, blocks, block_size, kv_heads, head_dim] (head_dim + 4 int8 elements per row for an
int8 cache: the codes, then the row's float32 scale; kernels.kv_rows_as reads them back), a strided view of
head-major memory (kernels.kv_blocks). A token at position p of a sequence lives in slot
block_table[p // block_size] * block_size + p % block_size, at kv[:, layer, slot // block_size, slot % block_size].
Each call writes the new tokens' K/V into their slots, then attends each query over its sequence's context (cached
prefix + new tokens) with a causal offset.

Each sequence of a step takes one route, chosen once per step by the runner (not per layer):
- fresh: a prompt chunk with nothing cached before it attends over its own new K/V with causal SDPA (as the cache
  holds them: rounded to the cache dtype, so every route sees the same values);
- paged: decode and short chunks over a cached prefix (q_len <= PAGED_MAX_Q) go, all together, to
  kernels.paged_attention, which reads K/V blocks where they live through the block table: no gather, no padding,
  and per-step work that does not grow with context length;
- gather: a long chunk over a cached prefix gathers its context once and runs SDPA (compute-bound, SDPA's blocking
  wins there).
`reference=True` sends every sequence through gather: the first version's path, kept as the tests' reference."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from warmstart.kernels import kv_rows_as, kv_slot_rows, paged_attention, write_kv

PAGED_MAX_Q = 16


@dataclass
class SeqSlice:
    q_start: int              # first row of this sequence in the packed batch
    q_len: int                # new tokens this step
    ctx_len: int              # tokens attended over: cached prefix + new
    slots: torch.Tensor | None = None   # [ctx_len] cache slots of the whole context (gather route only)
    route: str = "fresh"      # "fresh" | "paged" | "gather"


@dataclass
class PagedRows:
    """The rows that go to the paged kernel, with what it needs; built once per step."""
    rows: torch.Tensor | None       # [R] row indices into the packed batch; None = every row
    block_tables: torch.Tensor      # int32 [S, max_blocks]
    seq_idx: torch.Tensor           # int32 [R]: row of block_tables for each paged row
    ctx_lens: torch.Tensor          # int32 [R]: positions each row attends over (its own position + 1)


@dataclass
class AttentionMeta:
    slot_mapping: torch.Tensor                  # [T] where each new token's K/V goes
    seqs: list[SeqSlice]
    paged: PagedRows | None = None


class PagedAttentionBackend:
    """The runner sets `meta` before each forward; the model calls the backend once per layer.
    With no cache (kv is None) it attends causally within the batch — the memory-profiling forward."""

    def __init__(self, kv: torch.Tensor | None, block_size: int):
        self.kv, self.block_size = kv, block_size
        self.meta: AttentionMeta | None = None
        self._views: list[tuple[torch.Tensor, ...] | None] = [None] * (0 if kv is None else kv.shape[1])

    def paged_step(self) -> tuple[torch.Tensor, ...] | None:
        """(kv, slot_mapping, block_tables, seq_idx, ctx_lens) when every row of this step takes the paged route
        (what the compiled decoder stack needs to write and read the cache itself), else None."""
        meta = self.meta
        if self.kv is None or meta is None or meta.paged is None or meta.paged.rows is not None \
                or meta.slot_mapping.dtype is not torch.long:
            return None
        p = meta.paged
        return self.kv, meta.slot_mapping, p.block_tables, p.seq_idx, p.ctx_lens

    def _layer_views(self, layer: int) -> tuple[torch.Tensor, ...]:
        """(k, v) of one layer as [blocks, block_size, Hkv, D]; made once per backend (the runner keeps one backend
        per cache), not twice per layer per step."""
        views = self._views[layer]
        if views is None:
            views = self._views[layer] = (self.kv[0, layer], self.kv[1, layer])
        return views

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        if self.kv is None:
            return torch.cat([_attend(q[s.q_start:s.q_start + s.q_len], k[s.q_start:s.q_start + s.q_len],
                                      v[s.q_start:s.q_start + s.q_len], s.q_len) for s in meta.seqs])
        kc, vc = self._layer_views(layer)                           # [blocks, block_size, Hkv, D]
        write_kv(k, v, kc, vc, meta.slot_mapping)
        if kc.dtype != k.dtype and any(s.route == "fresh" for s in meta.seqs):
            # A fresh prompt attends over the K/V values the cache now holds (float16- or int8-rounded), as every
            # later read of them does: a prompt's logits do not depend on whether its prefix came from the prefix
            # cache, an earlier chunk or this one.
            k = kv_rows_as(kv_slot_rows(kc, meta.slot_mapping), k.dtype)
            v = kv_rows_as(kv_slot_rows(vc, meta.slot_mapping), v.dtype)
        p = meta.paged
        if p is not None and p.rows is None:                        # the whole step is paged (e.g. all decode)
            return self._paged(layer, q, p)
        out = torch.empty_like(q)
        if p is not None:
            out.index_copy_(0, p.rows, self._paged(layer, q.index_select(0, p.rows), p))
        for s in meta.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            if s.route == "fresh":
                out[rows] = _attend(q[rows], k[rows], v[rows], s.q_len)
            elif s.route == "gather":
                out[rows] = _attend(q[rows], kv_rows_as(kv_slot_rows(kc, s.slots), q.dtype),
                                    kv_rows_as(kv_slot_rows(vc, s.slots), q.dtype), s.q_len)
        return out

    def _paged(self, layer: int, q: torch.Tensor, p: PagedRows) -> torch.Tensor:
        kb, vb = self._layer_views(layer)
        return paged_attention(q, kb, vb, p.block_tables, p.seq_idx, p.ctx_lens, q.shape[-1] ** -0.5)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int) -> torch.Tensor:
    """q: [q_len, H, D] are the last q_len positions of a context k, v: [ctx, Hkv, D].

    The inputs go in as 4-D [1, heads, positions, D]: on CPU, torch's SDPA takes its flash-attention kernel only
    for 4-D inputs and falls back to the math path (the whole [H, q_len, ctx] score matrix, a mask pass and its
    page faults) for 3-D ones. Measured on a 2,000-token prompt of the default model's shapes: 28 vs 231 ms a
    layer; 500 queries over a 2,000-token context with a mask: 13 vs 57 ms. Same results to float rounding."""
    ctx = k.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_len == ctx:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    else:
        rows = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)
