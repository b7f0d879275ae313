"""Weight-only quantized linears, and the formats they read.

Two kernels. Where warmstart's compiled kernel loads (kernels/csrc/qlinear.h: x86-64-v3 and up), it runs on the
canonical codes as they are stored (no repacking at load; scales and mins in float16, as GGUF stores them) with
activations quantized to int8 per block of 32, as llama.cpp does: on AVX2 hosts torch's int4 kernel is
compute-bound at M=1 and no faster than float32 (benchmarks/decode.py). Elsewhere, torch's own kernels on
bfloat16 activations, below.

Two formats, both produced either from a GGUF file's blocks (weights/gguf.py) or by round-to-nearest at load
(`--quantization int8|int4` on a float checkpoint):

- int8: symmetric. w[n, k] = q[n, k] * scale[n] (per output row), q in -127..127. Kernel:
  aten._weight_int8pack_mm. Canonical tensors may carry a scale per group of a row instead (GGUF's Q8_0, exact);
  `prepare` re-quantizes those per row, since the kernel takes one scale per row.
- int4: groups of GROUP_SIZE (32) consecutive input features per output row, affine. w = q * scale + min,
  q in 0..15. This is exactly GGUF's Q4_1 (and Q4_0 with min = -8 * scale, Q4_K with its 6-bit sub-block scales
  folded in). Kernel: aten._weight_int4pack_mm_for_cpu, which computes (q - 8) * s + z, so z = min + 8 * scale.

Canonical tensors (what a checkpoint folder stores; ISA-independent):
    <linear>.qweight  int8 [N, K]          |  uint8 [N, K/2], element 2i in the low nibble of byte i
    <linear>.scales   float32 [N] or [N,K/G]|  float32 [N, K/GROUP]
    <linear>.mins                          |  float32 [N, K/GROUP]
Kernel-ready tensors (what `prepare` returns and a weight daemon serves). warmstart's kernel:
    <linear>.qweight  int8 [N, K]          |  uint8 [N, K/2], as canonical
    <linear>.scales   float16 [N, K/GROUP] |  float16 [N, K/GROUP]
    <linear>.mins                          |  float16 [N, K/GROUP]
torch's (the int4 packing is ISA-specific):
    <linear>.qweight  int8 [N, K]          |  uint8, aten._convert_weight_to_int4pack_for_cpu's layout
    <linear>.scales   bfloat16 [N]         |  <linear>.scales_zeros bfloat16 [K/GROUP, N, 2]
The kernels take bfloat16 activations (their float32 paths are 10x slower), so a quantized linear casts its input
to bfloat16 and its output back. The scales are rounded to bfloat16 once, here: the dequantized reference that
parity tests compare against uses the same rounded scales, so it is the same math."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmstart.kernels import qlinear as _qlinear_kernel

GROUP_SIZE = 32
ACT_DTYPE = torch.bfloat16
INT4_ROWS = 16          # the int4 kernel packs output rows in multiples of 16


# ---------------------------------------------------------------- quantizers (round to nearest)

def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric per-row int8: scale = max|w| / 127."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q, "scales": scale}


def quantize_int4(w: torch.Tensor, group: int = GROUP_SIZE) -> dict[str, torch.Tensor]:
    """Affine int4 per group of `group` input features: scale = (max - min) / 15, q = round((w - min) / scale)."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs the input size ({k}) to be a multiple of the group size ({group})")
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return {"qweight": pack_nibbles(q), "scales": scale, "mins": lo}


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> [N, K/2], element 2i in the low nibble of byte i."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [N, K/2] -> uint8 [N, K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight a set of canonical tensors stands for (scales as stored)."""
    if "mins" in t:
        q = unpack_nibbles(t["qweight"]).float()
        group = q.shape[1] // t["scales"].shape[1]
        return q * t["scales"].float().repeat_interleave(group, 1) + t["mins"].float().repeat_interleave(group, 1)
    scales = t["scales"].float()
    if scales.dim() == 1:
        return t["qweight"].float() * scales[:, None]
    return t["qweight"].float() * scales.repeat_interleave(t["qweight"].shape[1] // scales.shape[1], 1)


def canonical_kind(names: set[str], prefix: str) -> str | None:
    """'int4', 'int8' or None for the linear `prefix`, from which tensors exist."""
    if f"{prefix}.qweight" not in names:
        return None
    return "int4" if f"{prefix}.mins" in names or f"{prefix}.scales_zeros" in names else "int8"


# ---------------------------------------------------------------- kernel-ready form

def native_kernel() -> bool:
    """Whether prepare() targets warmstart's compiled kernel (True) or torch's (False) on this machine."""
    from warmstart.kernels import has_qlinear
    return has_qlinear()


def prepare(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical tensors -> the kernel's. Native: codes as stored, scales and mins in float16 (GGUF's own, exact
    for Q4_0/Q4_1/Q8_0; a rounding of 2^-11 at most for round-to-nearest and K-quant scales, which the reference
    shares), int8 scales expanded to one per block of 32; torch: scales in bfloat16, int4 repacked into the
    kernel's ISA layout."""
    k = t["qweight"].shape[1] * (2 if "mins" in t else 1)
    if native_kernel() and k % GROUP_SIZE == 0:
        if "mins" in t:
            return {"qweight": t["qweight"], "scales": t["scales"].half(), "mins": t["mins"].half()}
        scales = t["scales"].half()
        if scales.dim() == 1:
            scales = scales[:, None].expand(-1, k // GROUP_SIZE).contiguous()
        return {"qweight": t["qweight"], "scales": scales}
    if "mins" not in t:
        if t["scales"].dim() == 2:
            t = quantize_int8(dequantize(t))
        return {"qweight": t["qweight"], "scales": t["scales"].to(ACT_DTYPE)}
    q, scale, lo = unpack_nibbles(t["qweight"]).to(torch.int32), t["scales"], t["mins"]
    pad = -q.shape[0] % INT4_ROWS
    if pad:   # zero rows (scale 0, zero 0) up to the kernel's row multiple; Int4Linear slices them off
        q = torch.cat((q, q.new_full((pad, q.shape[1]), 8)))
        scale, lo = (torch.cat((a, a.new_zeros(pad, a.shape[1]))) for a in (scale, lo))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zeros = lo + 8 * scale
    sz = torch.stack((scale.t(), zeros.t()), dim=-1).to(ACT_DTYPE).contiguous()   # [K/G, N + pad, 2]
    return {"qweight": packed, "scales_zeros": sz}


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T + b, on aten._weight_int8pack_mm."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.qweight, self.scales, self.bias = qweight, scales, bias
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(ACT_DTYPE), self.qweight, self.scales)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of the weight as an embedding table (a tied embedding shares this linear's tensors)."""
        return (self.qweight[ids].to(dtype) * self.scales[ids].to(dtype)[:, None])


class Int4Linear(nn.Module):
    """y = x @ ((q - 8) * s + z)^T + b per group, on aten._weight_int4pack_mm_for_cpu."""

    def __init__(self, qweight: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int):
        super().__init__()
        self.qweight, self.scales_zeros, self.bias = qweight, scales_zeros, bias
        self.in_features, self.out_features = in_features, out_features
        self.group = in_features // scales_zeros.shape[0]
        self.padded = scales_zeros.shape[1] != out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(ACT_DTYPE), self.qweight,
                                                       self.group, self.scales_zeros)
        if self.padded:
            y = y[:, :self.out_features]
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, unpacked through the kernel itself (x = identity, in float32 so
        that nothing is rounded on the way out)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group,
                                                          self.scales_zeros.float())[:, :self.out_features].t()


class QuantEmbedding(nn.Module):
    """An embedding whose table is an Int8Linear's weight (GGUF's quantized token_embd, tied to the LM head)."""

    def __init__(self, table: Int8Linear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.embed(ids, self.dtype)


class NativeQuantLinear(nn.Module):
    """y = x @ w^T + b on warmstart's compiled kernel; w is int4 (scales and mins) or int8 (scales), per block of 32."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None, in_features: int, out_features: int):
        super().__init__()
        self.qweight, self.scales, self.mins, self.bias = qweight, scales, mins, bias
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype is torch.float32:      # the decoder's packed [T, K] rows: no reshapes
            y = _qlinear_kernel(x, self.qweight, self.scales, self.mins)
        else:
            shape = x.shape
            y = _qlinear_kernel(x.reshape(-1, shape[-1]), self.qweight, self.scales, self.mins)
            y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        parts = {"qweight": self.qweight, "scales": self.scales}
        if self.mins is not None:
            parts["mins"] = self.mins
        return dequantize(parts)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        blocks = self.scales.shape[1]
        codes = self.qweight[ids].to(dtype).view(*ids.shape, blocks, self.in_features // blocks)
        return (codes * self.scales[ids].to(dtype)[..., None]).view(*ids.shape, self.in_features)


def make_linear(tensors: dict[str, torch.Tensor], prefix: str, in_features: int, out_features: int) -> nn.Module:
    """The quantized module for kernel-ready tensors under `prefix`."""
    bias = tensors.get(f"{prefix}.bias")
    scales = tensors.get(f"{prefix}.scales")
    if f"{prefix}.mins" in tensors or (scales is not None and scales.dim() == 2):
        return NativeQuantLinear(tensors[f"{prefix}.qweight"], scales, tensors.get(f"{prefix}.mins"), bias,
                                 in_features, out_features)
    if f"{prefix}.scales_zeros" in tensors:
        return Int4Linear(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.scales_zeros"], bias, in_features,
                          out_features)
    return Int8Linear(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.scales"], bias)


def reference_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The float reference for a quantized linear: its dequantized weight in float32 (tests)."""
    return F.linear(x.float(), module.dequantized(),
                    None if module.bias is None else module.bias.float())


def bind_quantized(model: nn.Module, tensors: dict[str, torch.Tensor], tied: dict[str, str]) -> set[str]:
    """Swap every module whose weight arrived quantized for its quantized form, in O(modules). Returns the tensor
    names used. A quantized tied embedding becomes a QuantEmbedding and the LM head its Int8Linear."""
    used: set[str] = set()
    prefixes = sorted({n[:-len(".qweight")] for n in tensors if n.endswith(".qweight")})
    for prefix in prefixes:
        if prefix.endswith(("qkv_proj", "gate_up_proj")):
            used |= _bind_fused(model, tensors, prefix)
            continue
        old = model.get_submodule(prefix)
        parts = {n for n in tensors if n.rpartition(".")[0] == prefix and not n.endswith(".bias")}
        if isinstance(old, nn.Embedding):
            if f"{prefix}.scales_zeros" in tensors or f"{prefix}.mins" in tensors:
                raise ValueError(f"{prefix}: an int4 embedding table is not supported")
            table = make_linear(tensors, prefix, old.embedding_dim, old.num_embeddings)
            _set_module(model, prefix, QuantEmbedding(table, _float_dtype(tensors)))
            for name, source in tied.items():
                if source == f"{prefix}.weight":
                    _set_module(model, name.rpartition(".")[0], table)
        else:
            if f"{prefix}.bias" in tensors:
                parts.add(f"{prefix}.bias")
            _set_module(model, prefix, make_linear(tensors, prefix, old.in_features, old.out_features))
        used |= parts
    return used


def _bind_fused(model: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> set[str]:
    """A fused linear (weights/quantize.fuse) replaces the modules it stacks; the parent's forward sees it."""
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name)
    parts = ("q_proj", "k_proj", "v_proj") if attr == "qkv_proj" else ("gate_proj", "up_proj")
    olds = [getattr(parent, p) for p in parts]
    setattr(parent, attr, make_linear(tensors, prefix, olds[0].in_features, sum(o.out_features for o in olds)))
    for p in parts:
        delattr(parent, p)
    return {n for n in tensors if n.rpartition(".")[0] == prefix}


def _float_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The model's dtype, as its float tensors (norms) carry it: what an embedding lookup must return."""
    return next((t.dtype for n, t in tensors.items() if n.endswith("norm.weight")), torch.float32)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
