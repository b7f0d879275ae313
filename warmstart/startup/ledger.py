"""The memory ledger: every byte of the budget in a named category, and the KV size that follows from it.

budget = weights + external weights + activation peak + runtime overhead + KV cache + headroom
Headroom is what is left below one KV block (or what an explicit KV budget leaves unused)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

# Runtime overhead is read from RSS or cudaMemGetInfo, which drift by a few MiB between identical boots.
# Rounding up to this quantum keeps that noise out of num_kv_blocks.
OVERHEAD_QUANTUM = 64 * 2**20


def round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


@dataclass(frozen=True)
class MemoryLedger:
    device: str
    total_bytes: int
    free_bytes_at_boot: int
    budget_bytes: int
    weights_bytes: int
    external_weights_bytes: int
    activation_peak_bytes: int
    runtime_overhead_bytes: int
    kv_cache_bytes: int
    num_kv_blocks: int
    block_size: int
    kv_block_bytes: int
    # Speculative decoding with a draft model: the draft's share of weights (owned + external) and of the KV cache
    # (its cache mirrors the target's blocks, so kv_block_bytes covers both). Subsets of the lines above.
    draft_weights_bytes: int = 0
    draft_kv_cache_bytes: int = 0

    @property
    def non_kv_bytes(self) -> int:
        return self.weights_bytes + self.external_weights_bytes + self.activation_peak_bytes + \
            self.runtime_overhead_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.non_kv_bytes - self.kv_cache_bytes

    @property
    def token_capacity(self) -> int:
        return self.num_kv_blocks * self.block_size

    @classmethod
    def size(cls, *, budget: int, weights: int, external: int, activation: int, overhead: int,
             kv_block_bytes: int, block_size: int, device: str, total: int, free: int,
             explicit_kv: int | None = None) -> "MemoryLedger":
        """Size the KV cache: an explicit KV budget wins; else whatever the budget leaves after non-KV use.
        With an explicit KV budget the recorded budget is what the boot really uses (non-KV + KV)."""
        non_kv = weights + external + activation + overhead
        available = explicit_kv if explicit_kv is not None else budget - non_kv
        blocks = max(0, available // kv_block_bytes)
        if explicit_kv is not None:
            budget = non_kv + explicit_kv
        return cls(device=device, total_bytes=total, free_bytes_at_boot=free, budget_bytes=budget,
                   weights_bytes=weights, external_weights_bytes=external, activation_peak_bytes=activation,
                   runtime_overhead_bytes=overhead, kv_cache_bytes=blocks * kv_block_bytes, num_kv_blocks=blocks,
                   block_size=block_size, kv_block_bytes=kv_block_bytes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headroom_bytes"] = self.headroom_bytes
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryLedger":
        optional = {"draft_weights_bytes", "draft_kv_cache_bytes"}      # absent from plans written before them
        return cls(**{k: str(d[k]) if k == "device" else int(d.get(k, 0) if k in optional else d[k])
                      for k in cls.__dataclass_fields__})

    def table(self) -> str:
        """The one table the boot logs: bytes per category, then blocks, then token capacity."""
        from warmstart.config import format_bytes
        rows = [("budget", self.budget_bytes), ("weights", self.weights_bytes),
                ("external weights", self.external_weights_bytes), ("activation peak", self.activation_peak_bytes),
                ("runtime overhead", self.runtime_overhead_bytes), ("kv cache", self.kv_cache_bytes),
                ("headroom", self.headroom_bytes)]
        if self.draft_weights_bytes or self.draft_kv_cache_bytes:
            rows[3:3] = [("  draft weights", self.draft_weights_bytes)]
            rows[-1:-1] = [("  draft kv cache", self.draft_kv_cache_bytes)]
        lines = [f"memory on {self.device} (total {format_bytes(self.total_bytes)}, "
                 f"free at boot {format_bytes(self.free_bytes_at_boot)}):"]
        lines += [f"  {name:<17} {n:>15,d} B  {format_bytes(n):>11}" for name, n in rows]
        lines.append(f"  kv blocks         {self.num_kv_blocks:>15,d}    x {self.block_size} tokens x "
                     f"{self.kv_block_bytes:,d} B/block")
        lines.append(f"  token capacity    {self.token_capacity:>15,d}")
        return "\n".join(lines)
