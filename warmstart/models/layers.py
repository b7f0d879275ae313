"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, gated MLP, and the attention seam."""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from warmstart import kernels
from warmstart.models.spec import RopeSpec


class PagedAttention(Protocol):
    """What a model needs from the runner's attention backend: write K/V of the new tokens into the paged cache,
    then attend each query over its sequence's whole context. q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    # Optional: `paged_step()` -> (kv, slots, block_tables, seq_idx, ctx_lens) when every row of this step reads the
    # paged cache (the compiled layer loop then writes and reads the cache itself, models/native.py), else None.


class DenseLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose few-row CPU calls, a decode step's, run warmstart's compiled
    GEMV (kernels.dense_linear): torch's GEMM read the weight at a third of the memory bandwidth there. The compiled
    layer loop (models/native.py) calls the same kernel, so both paths give the same bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.dense_linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like transformers does, so half-precision runs match it; one fused aten op.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), or (norm(x), x) without a residual: the pre-norm decoder's residual
        stream in one pass (kernels.add_rms_norm); `residual` may be updated in place."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE, as in transformers' Llama/Qwen. cos/sin are computed once per forward
    from the positions (not once per layer), so there is no max-length table to size or to key on."""

    def __init__(self, head_dim: int, spec: RopeSpec):
        super().__init__()
        self.head_dim, self.spec = head_dim, spec
        # Computed on CPU even when the model is built on meta: math on meta tensors imports torch._dynamo.
        with torch.device("cpu"):
            self.register_buffer("inv_freq", _inv_freq(head_dim, spec), persistent=False)

    def materialize(self, device) -> None:
        """Recompute the frequencies on device (a meta-built model has none)."""
        self.inv_freq = _inv_freq(self.head_dim, self.spec).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, D] in dtype, for every layer of this forward."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]          # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                   # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, Hkv, D]. May rotate them in place (kernels.rotary_): callers must
    not hold other uses of q and k, and must use the results."""
    return kernels.rotary_(q, cos, sin), kernels.rotary_(k, cos, sin)


def _inv_freq(head_dim: int, spec: RopeSpec) -> torch.Tensor:
    inv = 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if spec.rope_type == "linear":
        return inv / spec.factor
    if spec.rope_type == "llama3":
        low_wavelen = spec.original_max_position / spec.low_freq_factor
        high_wavelen = spec.original_max_position / spec.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
        smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, bias: bool):
        super().__init__()
        self.gate_proj = DenseLinear(hidden, inner, bias=bias)
        self.up_proj = DenseLinear(hidden, inner, bias=bias)
        self.down_proj = DenseLinear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):   # fused at load (weights/quantize.fuse)
            return self.down_proj(kernels.silu_mul(self.gate_up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
