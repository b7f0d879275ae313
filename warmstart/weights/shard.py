"""Which part of a checkpoint one tensor-parallel rank holds (Megatron-style), float and quantized alike.

Per layer, rank r of N holds:
    q_proj             rows of its num_heads/N query heads (column-parallel: no communication)
    k_proj, v_proj     rows of its KV heads: num_kv_heads/N of them, or, when N > num_kv_heads, the one KV head its
                       query heads read (replicated on N/num_kv_heads ranks, as vLLM does)
    gate_proj, up_proj rows of its intermediate_size/N slice (column-parallel)
    o_proj, down_proj  the matching input columns (row-parallel): each rank's partial sum is all-reduced once
                       (parallel/sharding.py), the bias (if any) added after the reduce
    embed_tokens, lm_head, norms   replicated (the LM head runs on rank 0 only)

Quantized linears are cut in their canonical form (models/quant.py), after quantization and before the kernel's
preparation and the q/k/v and gate/up fusion (weights/quantize.postprocess), so every rank fuses its own shard:
    column-parallel  qweight, scales and mins split by rows (output channels), like a float weight
    row-parallel     qweight split along K (int4: K/2 packed bytes); grouped scales/mins [N, K/32] along K too,
                     so K/N must be a multiple of 32; per-row int8 scales [N] stay whole (a scale multiplies the
                     whole row's partial sums alike, so the reduced sum is the unsharded one)
Pure tensor code: imported by the engine's disk load and the weight daemon, which cut the same way."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from warmstart.errors import UserError
from warmstart.models.quant import GROUP_SIZE
from warmstart.models.spec import ModelSpec

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


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


@dataclass(frozen=True)
class ShardCut:
    """One rank's cut, as a callable on a tensor dict (what load_tensors and the daemon apply)."""
    spec: ModelSpec
    rank: int
    world: int

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_tensors(tensors, self.spec, self.rank, self.world)


def shard_tensors(tensors: dict[str, torch.Tensor], spec: ModelSpec, rank: int,
                  world: int) -> dict[str, torch.Tensor]:
    """The tensors rank binds. Split tensors are copied (so a full converted tensor is not kept alive by a view);
    replicated ones are passed through unchanged (mmap-backed where the loader left them so)."""
    if any(n.endswith(".scales_zeros") for n in tensors) or any(".qkv_proj." in n or ".gate_up_proj." in n
                                                                 for n in tensors):
        raise ValueError("shard_tensors takes canonical, unfused tensors (cut before quant.prepare and fuse)")
    d = spec.head_dim
    q_per = spec.num_heads // world
    k0, k1 = kv_heads_of(spec, rank, world)
    i_per = spec.intermediate_size // world
    rows = {"q_proj": (rank * q_per * d, (rank + 1) * q_per * d), "k_proj": (k0 * d, k1 * d),
            "v_proj": (k0 * d, k1 * d), "gate_proj": (rank * i_per, (rank + 1) * i_per),
            "up_proj": (rank * i_per, (rank + 1) * i_per)}
    cols = {"o_proj": rows["q_proj"], "down_proj": rows["gate_proj"]}
    out = {}
    for name, t in tensors.items():
        prefix, _, attr = name.rpartition(".")
        linear = prefix.rpartition(".")[2]
        if linear in rows:                               # column-parallel: every part (and the bias) by rows
            a, b = rows[linear]
            out[name] = t[a:b].clone()
        elif linear in cols and attr != "bias":          # row-parallel: along K; the bias is added once, after
            out[name] = _cut_k(name, t, attr, *cols[linear], tensors, world)
        else:
            out[name] = t
    return out


def _cut_k(name: str, t: torch.Tensor, attr: str, a: int, b: int, tensors: dict, world: int) -> torch.Tensor:
    prefix = name.rpartition(".")[0]
    if attr == "weight":
        return t[:, a:b].contiguous()
    int4 = f"{prefix}.mins" in tensors
    grouped = int4 or tensors[f"{prefix}.scales"].dim() == 2
    if attr == "scales" and t.dim() == 1:
        return t                                        # per-row int8 scales: whole on every rank
    if grouped and (a % GROUP_SIZE or b % GROUP_SIZE):
        raise UserError(f"--tensor-parallel-size {world} cannot split the quantized {prefix}: each rank's share "
                        f"of its input ({b - a} features) is not a multiple of the quantization group "
                        f"({GROUP_SIZE}). Use a tensor-parallel size that keeps whole groups, or "
                        "--quantization none (or int8 on a float checkpoint, which scales per row).")
    if attr == "qweight":
        if int4:                                        # two 4-bit values per byte along K
            return t[:, a // 2:b // 2].contiguous()
        return t[:, a:b].contiguous()
    if attr in ("scales", "mins"):                      # one per group of 32 along K
        return t[:, a // GROUP_SIZE:b // GROUP_SIZE].contiguous()
    raise ValueError(f"{name}: unknown quantized part {attr!r}")
