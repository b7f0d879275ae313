"""Quantization as a load-time post-processing step: checkpoint tensors -> the tensors the model binds.

`--quantization` (EngineConfig.quantization):
    auto  a quantized checkpoint (an imported GGUF) keeps its own formats; a float checkpoint stays float
    none  everything float in --dtype (a quantized checkpoint is dequantized: its exact values, in more bytes)
    int8  float checkpoint -> every linear, and the LM head, int8 per output row
    int4  float checkpoint -> every linear int4 in groups of 32 (models/quant.py); the LM head (and a tied
          embedding) int8, as llama.cpp keeps its output layer at higher precision
The output is always kernel-ready (models/quant.prepare), so a weight daemon serves exactly what a disk load binds.
A tied embedding is quantized once, under the embedding's name, and the LM head shares it."""
from __future__ import annotations

from typing import Callable

import torch

from warmstart.errors import UserError
from warmstart.models import quant

QUANTIZATIONS = ("auto", "none", "int8", "int4")
EMBED = "model.embed_tokens"


def checkpoint_kind(names) -> str:
    """'quantized' if the checkpoint stores canonical quantized tensors, else 'float'."""
    return "quantized" if any(n.endswith(".qweight") for n in names) else "float"


def resolve(requested: str, names) -> str:
    """The quantization a load applies: 'native' (keep the checkpoint's), 'none', 'int8' or 'int4'."""
    kind = checkpoint_kind(names)
    if requested == "auto":
        return "native" if kind == "quantized" else "none"
    if kind == "quantized" and requested in ("int8", "int4"):
        raise UserError(f"--quantization {requested} asks to quantize a checkpoint that is already quantized "
                        "(an imported GGUF). Use --quantization auto to serve its own formats, or none for float.")
    return requested


def postprocess(tensors: dict[str, torch.Tensor], dtype: torch.dtype, quantization: str,
                shard: Callable[[dict], dict] | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (floats already in dtype) -> the bound set, per resolve(quantization). `shard` (a
    tensor-parallel rank's cut, weights/shard.py) applies to the canonical tensors: after quantizing, before the
    kernel's preparation and the fusion, so each rank fuses its own shard."""
    mode = resolve(quantization, tensors.keys())
    out = canonical(tensors, dtype, mode)
    if shard is not None:
        out = shard(out)
    if mode == "none":
        return out
    for p in sorted({n[:-len(".qweight")] for n in out if n.endswith(".qweight")}):
        part = {k: out.pop(f"{p}.{k}") for k in ("qweight", "scales", "mins") if f"{p}.{k}" in out}
        out.update({f"{p}.{k}": v for k, v in quant.prepare(part).items()})
    return fuse(out)


def canonical(tensors: dict[str, torch.Tensor], dtype: torch.dtype, mode: str) -> dict[str, torch.Tensor]:
    """Floats in dtype and quantized linears in their canonical (ISA-independent, unfused) form, per mode."""
    prefixes = sorted({n[:-len(".qweight")] for n in tensors if n.endswith(".qweight")})
    out = {n: t for n, t in tensors.items() if not _is_quant_part(n, prefixes)}
    if mode == "none":
        for p in prefixes:
            part = {k: tensors[f"{p}.{k}"] for k in ("qweight", "scales", "mins") if f"{p}.{k}" in tensors}
            out[f"{p}.weight"] = quant.dequantize(part).to(dtype)
        return out
    if mode == "native":
        out.update({n: t for n, t in tensors.items() if _is_quant_part(n, prefixes)})
        return out
    for name in [n for n in out if _quantizable(n, out)]:
        w = out.pop(name)
        prefix = name[:-len(".weight")]
        int4 = mode == "int4" and prefix not in ("lm_head", EMBED) and w.shape[1] % quant.GROUP_SIZE == 0
        part = quant.quantize_int4(w) if int4 else quant.quantize_int8(w)
        out.update({f"{prefix}.{k}": v for k, v in part.items()})
    return out


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Linears that read the same input become one: q/k/v -> qkv_proj, gate/up -> gate_up_proj, by stacking their
    rows (output channels). Exact for the compiled kernel's per-row, per-block formats; it halves the quantized
    linear calls per layer (5 instead of 7 plus 2 activation quantizations saved). Only for the native kernel's
    tensors (torch's int4 layout interleaves rows)."""
    layers = sorted({n.split(".self_attn.")[0] for n in tensors if ".self_attn.q_proj.scales" in n})
    for layer in layers:
        for fused, parts in FUSED.items():
            names = [f"{layer}.{p}" for p in parts]
            attrs = [sorted(k.rpartition(".")[2] for k in tensors if k.rpartition(".")[0] == n) for n in names]
            if any(a != attrs[0] for a in attrs) or "qweight" not in attrs[0] or "scales_zeros" in attrs[0] \
                    or tensors[f"{names[0]}.scales"].dim() != 2:
                continue          # not all three quantized alike for the compiled kernel: leave them apart
            for attr in attrs[0]:
                tensors[f"{layer}.{fused}.{attr}"] = torch.cat([tensors.pop(f"{n}.{attr}") for n in names])
    return tensors


def _is_quant_part(name: str, prefixes: list[str]) -> bool:
    prefix, _, attr = name.rpartition(".")
    return attr in ("qweight", "scales", "mins") and prefix in prefixes


def _quantizable(name: str, tensors: dict[str, torch.Tensor]) -> bool:
    """Linear weights, the LM head, and an embedding that doubles as the LM head (tied)."""
    if name.endswith("_proj.weight") or name == "lm_head.weight":
        return True
    return name == f"{EMBED}.weight" and "lm_head.weight" not in tensors
