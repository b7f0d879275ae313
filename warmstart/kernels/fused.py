"""The decode step's small ops on the compiled glue (csrc/fused.h), each with a pure-torch path of the same
semantics."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from warmstart.kernels.attention import quantize_kv_rows
from warmstart.kernels.loader import load_native

# ------------------------------------------------------------------------------------------------ fused glue
# The decode step's small ops, one call each (csrc/fused.h): at batch 1 their dispatch cost rivals the matmuls.
# Each function takes the compiled path for float32 or bfloat16 CPU tensors (all of one dtype; argmax float32 only)
# and a pure-torch path with the same semantics otherwise (float16 activations, CUDA, torch.compile tracing, no
# compiler at install time).
_fused, FUSED_UNAVAILABLE_REASON = load_native("_fused")


def has_fused() -> bool:
    return _fused is not None


def _use_fused(*tensors: torch.Tensor) -> bool:
    if _fused is None or torch.compiler.is_compiling():
        return False
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return False
    for t in tensors:                      # a plain loop: this check runs ~10 times per layer per step
        if t.dtype is not dtype or not t.is_cpu:
            return False
    return True


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(h) * weight, h) where h = x + residual, or h = x without a residual. x, residual [T, D]; the
    compiled path updates `residual` in place. Normalisation is in float32 (as transformers does), cast back."""
    if (_use_fused(x, weight) if residual is None else _use_fused(x, weight, residual)) and x.dim() == 2 \
            and x.stride(1) == 1 and (residual is None or residual.stride(1) == 1):
        return _fused.add_rms_norm(x, residual, weight, eps), (x if residual is None else residual)
    h = x if residual is None else x + residual
    return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype), h


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, n, D] by cos, sin [T, 1, D] (or [T, D]); the compiled path rotates x in place and
    returns it, the torch path returns a new tensor: use the result."""
    if _use_fused(x, cos, sin) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        _fused.rotary_(x, cos.reshape(x.shape[0], x.shape[2]), sin.reshape(x.shape[0], x.shape[2]))
        return x
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Slot s's rows of k_cache and v_cache (block s // block_size, offset s % block_size) = k, v, converted to the
    cache dtype (int8: quantized rows, see quantize_kv_rows). k, v [T, Hkv, D]; caches one layer's [blocks,
    block_size, Hkv, D] (D + 4 int8), any strides with contiguous rows."""
    if _use_fused(k, v) and k_cache.device.type == "cpu" and k.stride(2) == 1 and v.stride(2) == 1 \
            and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2] and slots.dtype == torch.long:
        _fused.write_kv(k, v, k_cache, v_cache, slots)
        return
    conv = quantize_kv_rows if k_cache.dtype is torch.int8 else (lambda t: t.to(k_cache.dtype))
    bs = k_cache.shape[1]
    blocks, offsets = slots // bs, slots % bs
    k_cache[blocks, offsets] = conv(k)
    v_cache[blocks, offsets] = conv(v)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] holding (gate | up) -> silu(gate) * up, [T, I]."""
    if _use_fused(x) and x.dim() == 2 and x.stride(1) == 1:
        return _fused.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> list[int]:
    """The index of each row's maximum of x [B, V], as torch.argmax picks it (the first maximum; a NaN counts as
    the maximum). The compiled path runs on this thread and the kernels' pool, not on the OpenMP team (csrc/fused.h
    says why)."""
    if _use_fused(x) and x.dtype is torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0:
        return _fused.argmax_rows(x).tolist()
    return x.max(dim=-1).indices.tolist()
