"""GGUF quantized blocks -> warmstart's canonical quantized tensors (models/quant.py), without a float detour
where the format allows it.

    Q4_0, Q4_1, Q4_K   -> int4, group 32, exact: every GGUF weight keeps its 4-bit code, scale and min
                          (Q4_0: min = -8 d; Q4_1: its d and m; Q4_K: d * sub-scale and -dmin * sub-min).
    Q8_0               -> int8 with its own scale per block of 32, exact. The int8 kernel takes one scale per
                          row, so models/quant.prepare re-quantizes per row when it loads (lossy; --quantization
                          none dequantizes the exact values instead).
    Q5_0, Q5_1, Q5_K,
    Q6_K               -> int8 per output row, re-quantized from the exact dequantized values (8 bits per
                          weight: within 1.25x of Q6_K's 6.56 bits; Q5 formats grow to 1.45x).
    F32, F16, BF16     -> None: stays a float tensor.

Block layouts follow ggml (ggml-common.h); the decoders are checked against the gguf package's own dequantize in
tests/unit/test_quant.py."""
from __future__ import annotations

import gguf
import numpy as np

from warmstart.models.quant import GROUP_SIZE

Q = gguf.GGMLQuantizationType
INT4_EXACT = {Q.Q4_0, Q.Q4_1, Q.Q4_K}
INT8_REQUANT = {Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K}


def canonical(raw: np.ndarray, qtype, rows: int, cols: int) -> dict[str, np.ndarray] | None:
    """Canonical tensors for one [rows, cols] GGUF weight, or None when it is (or must become) a float tensor."""
    if qtype in INT4_EXACT and cols % GROUP_SIZE == 0:
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
        q, scale, lo = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k}[qtype](blocks, rows, cols)
        return {"qweight": (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8), "scales": scale, "mins": lo}
    if qtype == Q.Q8_0 and cols % 32 == 0:
        b = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // 32, 34)
        return {"qweight": b[..., 2:].copy().view(np.int8).reshape(rows, cols), "scales": _f16(b, 0)}
    if qtype in INT8_REQUANT or qtype in INT4_EXACT:
        w = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(rows, cols)
        scale = np.maximum(np.abs(w).max(axis=1) / 127, 1e-12).astype(np.float32)
        q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
        return {"qweight": q, "scales": scale}
    return None


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-element nibble layout: byte j holds element j (low nibble) and element j + 16 (high)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_0(blocks: np.ndarray, rows: int, cols: int):
    b = blocks.reshape(rows, cols // 32, 18)
    d = _f16(b, 0)
    q = _low_high(b[..., 2:18]).reshape(rows, cols)
    return q, d, -8 * d


def _q4_1(blocks: np.ndarray, rows: int, cols: int):
    b = blocks.reshape(rows, cols // 32, 20)
    q = _low_high(b[..., 4:20]).reshape(rows, cols)
    return q, _f16(b, 0), _f16(b, 2)


def _q4_k(blocks: np.ndarray, rows: int, cols: int):
    b = blocks.reshape(rows, cols // 256, 144)
    d, dmin = _f16(b, 0), _f16(b, 2)
    s = b[..., 4:16].astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = b[..., 16:144].reshape(rows, cols // 256, 4, 32)
    # Each 32-byte chunk j holds sub-block 2j in its low nibbles and sub-block 2j+1 in its high nibbles.
    q = np.stack((qs & 0x0F, qs >> 4), axis=3).reshape(rows, cols)
    scale = (d[..., None] * sc).reshape(rows, cols // 32).astype(np.float32)
    lo = (-dmin[..., None] * mn).reshape(rows, cols // 32).astype(np.float32)
    return q, scale, lo
