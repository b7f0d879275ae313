"""Attention over the paged KV cache with torch SDPA (CPU, and CUDA through the same code).

Cache layout: kv[2, layers, blocks, block_size, kv_heads, head_dim]. A token at position p of a sequence lives in
slot block_table[p // block_size] * block_size + p % block_size. Each call writes the new tokens' K/V into their
slots, then attends each query over its sequence's context (cached prefix + new tokens) with a causal offset."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SeqSlice:
    q_start: int              # first row of this sequence in the packed batch
    q_len: int                # new tokens this step
    ctx_len: int              # tokens attended over: cached prefix + new
    slots: torch.Tensor       # [ctx_len] cache slots of the whole context, in position order


@dataclass
class AttentionMeta:
    slot_mapping: torch.Tensor                  # [T] where each new token's K/V goes
    seqs: list[SeqSlice]
    decode_slots: torch.Tensor | None = None    # [B, L] context slots (padded) when every sequence decodes 1 token
    decode_mask: torch.Tensor | None = None     # [B, 1, 1, L] True where a padded slot is real context; None if B=1


class PagedAttentionBackend:
    """The runner sets `meta` before each forward; the model calls the backend once per layer.
    With no cache (kv is None) it attends causally within the batch — the memory-profiling forward."""

    def __init__(self, kv: torch.Tensor | None, block_size: int):
        self.kv, self.block_size = kv, block_size
        self.meta: AttentionMeta | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        if self.kv is None:
            return torch.cat([_attend(q[s.q_start:s.q_start + s.q_len], k[s.q_start:s.q_start + s.q_len],
                                      v[s.q_start:s.q_start + s.q_len], s.q_len) for s in meta.seqs])
        kc = self.kv[0, layer].view(-1, k.shape[1], k.shape[2])     # [slots, Hkv, D]
        vc = self.kv[1, layer].view(-1, v.shape[1], v.shape[2])
        kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        if meta.decode_slots is not None:
            return self._decode(q, kc, vc, meta)
        outs = []
        for s in meta.seqs:
            kk, vv = kc[s.slots].to(q.dtype), vc[s.slots].to(q.dtype)
            outs.append(_attend(q[s.q_start:s.q_start + s.q_len], kk, vv, s.q_len))
        return torch.cat(outs)

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        # One query per sequence: gather every sequence's context into a padded [B, Hkv, L, D] and mask the padding.
        # The slot matrix is built once per step by the runner, not once per layer.
        b, length = meta.decode_slots.shape
        flat = meta.decode_slots.reshape(-1)
        kk = kc.index_select(0, flat).view(b, length, *kc.shape[1:]).transpose(1, 2).to(q.dtype)
        vv = vc.index_select(0, flat).view(b, length, *vc.shape[1:]).transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(q[:, :, None, :], kk, vv, attn_mask=meta.decode_mask, enable_gqa=True)
        return out[:, :, 0, :]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int) -> torch.Tensor:
    """q: [q_len, H, D] are the last q_len positions of a context k, v: [ctx, Hkv, D]."""
    ctx = k.shape[0]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_len == ctx:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    else:
        rows = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)
