"""The prefix cache across a restart: save the most recently used cached KV blocks at a graceful shutdown, restore
them into free blocks at the next boot (the "prefix restore" step, right after KV allocation).

The file (runner/kv_persist.py) is keyed by everything that changes K/V content: the weights' identity, the model
spec (KV layout: layers, KV heads, head dim; RoPE), the resolved dtype and KV dtype, the block size, the device kind
and ISA, torch and warmstart versions, and every EngineConfig field not known to leave K/V unchanged (so a field
added later, a quantization mode say, invalidates old files by default). Budget knobs are not in it: a restart with
a different memory size still restores. It lives at <cache>/prefix/<model id>.safetensors, one per model and rank,
so a changed setup finds the old file, logs why it does not match, and overwrites it at its own shutdown.

Nothing here can produce a wrong token: a file is used only if its key matches, its bytes match their SHA-256, and
every block's key recomputes from its token ids and its parent's key (the block manager's own hash)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from warmstart import __version__
from warmstart.config import EngineConfig, format_bytes
from warmstart.engine.block_manager import BlockManager, CachedBlock, root_hash
from warmstart.models.spec import ModelSpec
from warmstart.runner import kv_persist
from warmstart.runner.runner import ModelRunner
from warmstart.startup.device import DeviceFacts
from warmstart.weights.loader import checkpoint_identity

log = logging.getLogger("warmstart")

# Config fields that never change what a block's K/V hold: where files live, budgets and scheduling limits, plan
# and weight-transport policy, sampling seed, and the prefix cache's own switches.
_NOT_IN_KEY = {"model", "cache_dir", "memory_utilization", "kv_cache_memory", "max_model_len", "max_num_seqs",
               "max_num_batched_tokens", "seed", "startup_plan", "plan_free_tolerance", "load_format",
               "weight_socket", "weight_mode", "weight_fallback", "draft_model", "enable_prefix_caching",
               "prefix_cache_persist", "device", "dtype", "kv_cache_dtype"}


@dataclass(frozen=True)
class PrefixOutcome:
    """What a restore or a save did. status: restored | saved | none | ignored | failed | off."""
    status: str
    reason: str | None = None
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    path: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class PrefixStore:
    def __init__(self, path: Path, key: dict, budget: int):
        self.path, self.key, self.budget = path, key, budget

    @classmethod
    def for_boot(cls, config: EngineConfig, model_dir: Path, spec: ModelSpec, facts: DeviceFacts,
                 dtype: torch.dtype, kv_dtype: torch.dtype) -> "PrefixStore | None":
        """None when nothing is saved or restored (prefix caching off, or --prefix-cache-persist 0)."""
        if not config.enable_prefix_caching or config.prefix_cache_persist == 0:
            return None
        weights = checkpoint_identity(model_dir)
        key = {
            "warmstart_version": __version__,
            "torch": torch.__version__,
            "model.weights": weights,
            "model.spec": dataclasses.asdict(spec),
            "dtype": str(dtype).removeprefix("torch."),
            "kv_dtype": str(kv_dtype).removeprefix("torch."),
            "block_size": config.block_size,
            "kv_layout": [spec.num_layers, spec.num_kv_heads, spec.head_dim],
            "device": [facts.kind, facts.name, facts.capability],
            "config": {k: v for k, v in config.to_dict().items() if k not in _NOT_IN_KEY},
        }
        key = json.loads(json.dumps(key, default=str))          # the form it takes in the file: lists, not tuples
        name = hashlib.sha256(json.dumps([weights, config.rank, config.world_size]).encode()).hexdigest()[:24]
        return cls(config.cache_dir / "prefix" / f"{name}.safetensors", key, config.prefix_cache_persist)

    # -- boot ---------------------------------------------------------------------------------------------------
    def restore(self, runner: ModelRunner, blocks: BlockManager) -> PrefixOutcome:
        """Load a matching file into never-used blocks and register them as cached (least recently used first,
        so the deepest blocks go before the chain heads). Anything wrong: a cold cache and a logged reason."""
        t0 = time.perf_counter()
        if not self.path.is_file():
            return PrefixOutcome("none", "no saved prefix cache", path=str(self.path))
        try:
            snap = kv_persist.read(self.path, self.key, runner.kv)
            rows, adopted = _verify(snap.entries, blocks)
        except kv_persist.Rejected as e:
            log.warning("prefix restore: ignoring %s: %s", self.path, e)
            return PrefixOutcome("ignored", str(e), path=str(self.path), seconds=time.perf_counter() - t0)
        if adopted:
            snap.copy_into(runner.kv, rows, [e.block for e in adopted])
            blocks.adopt(list(reversed(adopted)))
        nbytes = len(adopted) * runner.kv_block_bytes(blocks.block_size)
        out = PrefixOutcome("restored", None, len(adopted), nbytes, time.perf_counter() - t0, str(self.path))
        log.info("prefix restore: %d cached blocks (%s) of %d saved, from %s in %.3f s", out.blocks,
                 format_bytes(nbytes), len(snap.entries), self.path, out.seconds)
        return out

    # -- shutdown -----------------------------------------------------------------------------------------------
    def save(self, runner: ModelRunner, blocks: BlockManager) -> PrefixOutcome:
        """Write the most recently used cached blocks, up to the byte budget, parents before children. Call with
        the engine stopped (no step may run meanwhile)."""
        t0 = time.perf_counter()
        per_block = runner.kv_block_bytes(blocks.block_size)
        chosen = _closed(blocks.cached_blocks()[:self.budget // per_block])
        if not chosen:
            return PrefixOutcome("none", "no cached blocks to save", path=str(self.path))
        entries = [{"key": c.key.hex(), "parent": c.parent.hex(), "tokens": list(c.token_ids), "depth": c.depth,
                    "extra": c.extra.hex()} for c in chosen]
        try:
            size = kv_persist.write(self.path, runner.kv, [c.block for c in chosen], self.key, entries)
        except OSError as e:                 # a full disk must not turn a graceful shutdown into a crash
            log.warning("prefix cache: could not save to %s: %s", self.path, e)
            return PrefixOutcome("failed", str(e), path=str(self.path))
        out = PrefixOutcome("saved", None, len(chosen), size, time.perf_counter() - t0, str(self.path))
        log.info("prefix cache: saved %d blocks (%s) to %s in %.3f s", out.blocks, format_bytes(size), self.path,
                 out.seconds)
        return out


def _closed(mru: list[CachedBlock]) -> list[CachedBlock]:
    """Keep only blocks reachable from a chain head within the set (a lookup walks from the first block), parents
    first."""
    kept: dict[bytes, CachedBlock] = {}
    for c in sorted(mru, key=lambda c: c.depth):
        if c.depth == 0 or c.parent in kept:
            kept[c.key] = c
    return list(kept.values())


def _verify(entries: list[dict], blocks: BlockManager) -> tuple[list[int], list[CachedBlock]]:
    """Recompute every saved block's key from its token ids and its parent; choose a never-used block for each
    one that fits. Returns (file rows, blocks to adopt), parents first. Raises Rejected on any inconsistency."""
    free = blocks.free_block_ids(len(entries))
    rows: list[int] = []
    adopted: list[CachedBlock] = []
    known: set[bytes] = set()
    for row, e in enumerate(entries):
        try:
            tokens, extra = tuple(int(t) for t in e["tokens"]), bytes.fromhex(e["extra"])
            depth, key, parent = int(e["depth"]), bytes.fromhex(e["key"]), bytes.fromhex(e["parent"])
        except (KeyError, TypeError, ValueError) as err:
            raise kv_persist.Rejected(f"block entry {row} is malformed ({err})") from None
        if len(tokens) != blocks.block_size:
            raise kv_persist.Rejected(f"block entry {row} holds {len(tokens)} tokens, not {blocks.block_size}")
        if (depth == 0 and parent != root_hash(extra)) or (depth > 0 and parent not in known):
            raise kv_persist.Rejected(f"block entry {row} does not continue a saved chain")
        if blocks.hash_block(parent, tokens) != key:
            raise kv_persist.Rejected(f"block entry {row}: its key does not match its token ids (modified)")
        known.add(key)
        if len(adopted) < len(free) and not blocks.is_cached(key):
            rows.append(row)
            adopted.append(CachedBlock(free[len(adopted)], key, parent, tokens, depth, extra))
    return rows, adopted
