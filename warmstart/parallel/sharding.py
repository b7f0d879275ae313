"""Megatron-style sharding of a decoder checkpoint across tensor-parallel ranks.

Per layer, rank r of N holds:
    q_proj             rows of its num_heads/N query heads (column-parallel: no communication)
    k_proj, v_proj     rows of its KV heads: num_kv_heads/N of them, or, when N > num_kv_heads, the one KV head its
                       query heads read (replicated on N/num_kv_heads ranks, as vLLM does)
    gate_proj, up_proj rows of its intermediate_size/N slice (column-parallel)
    o_proj, down_proj  the matching input columns (row-parallel): each rank's partial sum is all-reduced once, and
                       the bias (if any) is added after the reduce
    embed_tokens, lm_head, norms   replicated (every rank holds the whole tensor; the LM head runs on rank 0 only)
So a layer costs two all-reduces of [tokens, hidden]. The embedding and LM head are replicated rather than
vocab-parallel: for the small-vocab models warmstart serves this costs one extra copy of the embedding per rank and
saves two collectives per step.

Quantized weights are refused under TP (shard-then-quantize is not implemented): float TP only."""
from __future__ import annotations

import dataclasses
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from warmstart.errors import UserError
from warmstart.models.spec import ModelSpec


def check_divisible(spec: ModelSpec, world: int) -> None:
    """Refuse, naming the numbers, a model that cannot be split N ways."""
    problems = []
    if spec.num_heads % world:
        problems.append(f"num_attention_heads {spec.num_heads} is not divisible by {world}")
    if spec.intermediate_size % world:
        problems.append(f"intermediate_size {spec.intermediate_size} is not divisible by {world}")
    hkv = spec.num_kv_heads
    if hkv % world and world % hkv:
        problems.append(f"num_key_value_heads {hkv} neither divides nor is divisible by {world}")
    if problems:
        raise UserError(f"--tensor-parallel-size {world} cannot split this model: {'; '.join(problems)}. "
                        "Pick a size that divides the attention heads, the KV heads (or a multiple of them) and "
                        "the MLP width.")


def local_spec(spec: ModelSpec, world: int) -> ModelSpec:
    """The shape one rank builds: its heads, KV heads and MLP width."""
    return dataclasses.replace(spec, num_heads=spec.num_heads // world,
                               num_kv_heads=max(1, spec.num_kv_heads // world),
                               intermediate_size=spec.intermediate_size // world)


def kv_heads_of(spec: ModelSpec, rank: int, world: int) -> tuple[int, int]:
    """[first, last) KV heads rank holds."""
    hkv = spec.num_kv_heads
    if world <= hkv:
        per = hkv // world
        return rank * per, (rank + 1) * per
    head = rank // (world // hkv)
    return head, head + 1


def shard_tensors(tensors: dict[str, torch.Tensor], spec: ModelSpec, rank: int,
                  world: int) -> dict[str, torch.Tensor]:
    """The tensors rank binds. Split tensors are copied (so a full converted tensor is not kept alive by a view);
    replicated ones are passed through unchanged (mmap-backed where the loader left them so)."""
    if any(n.endswith(".qweight") for n in tensors):
        raise UserError("Tensor parallelism runs float weights only; this load is quantized. Pass "
                        "--quantization none (a GGUF is dequantized), or drop --tensor-parallel-size.")
    d = spec.head_dim
    q_per = spec.num_heads // world
    q_rows = slice(rank * q_per * d, (rank + 1) * q_per * d)
    k0, k1 = kv_heads_of(spec, rank, world)
    kv_rows = slice(k0 * d, k1 * d)
    i_per = spec.intermediate_size // world
    i_rows = slice(rank * i_per, (rank + 1) * i_per)
    out = {}
    for name, t in tensors.items():
        parts = name.split(".")
        leaf = ".".join(parts[-2:]) if len(parts) >= 2 else name
        if leaf in ("q_proj.weight", "q_proj.bias"):
            out[name] = t[q_rows].clone()
        elif leaf in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            out[name] = t[kv_rows].clone()
        elif leaf in ("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias"):
            out[name] = t[i_rows].clone()
        elif leaf == "o_proj.weight":
            out[name] = t[:, q_rows].contiguous().clone()
        elif leaf == "down_proj.weight":
            out[name] = t[:, i_rows].contiguous().clone()
        else:
            out[name] = t
    return out


# -- the collective ---------------------------------------------------------------------------------------------

class _Comm(threading.local):
    enabled = True          # False during the per-rank profiling forward: ranks profile independently (plan hits
                            # may differ per rank), and an in-place all-reduce allocates nothing to measure


COMM = _Comm()
STATS = {"calls": 0, "seconds": 0.0}     # all-reduce calls and wall time on this rank (the benchmark reads it)


class no_collectives:
    def __enter__(self):
        COMM.enabled = False

    def __exit__(self, *exc):
        COMM.enabled = True


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W_shard^T) + b. Same parameter names as nn.Linear, so weights bind unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if COMM.enabled:
            import torch.distributed as dist
            t0 = time.perf_counter()
            dist.all_reduce(y)
            STATS["seconds"] += time.perf_counter() - t0
            STATS["calls"] += 1
        return y + self.bias if self.bias is not None else y


def make_row_parallel(model: nn.Module) -> None:
    """Swap every o_proj and down_proj of a meta-built model for a RowParallelLinear (before binding)."""
    from warmstart.models.registry import _skip_init
    with _skip_init():
        _swap(model)


def _swap(model: nn.Module) -> None:
    for layer in model.model.layers:
        for parent, attr in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            old = getattr(parent, attr)
            setattr(parent, attr, RowParallelLinear(old.in_features, old.out_features, bias=old.bias is not None,
                                                    device="meta", dtype=old.weight.dtype))
