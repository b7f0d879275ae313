"""Paged KV-cache bookkeeping: which physical blocks each sequence owns, and which full blocks are cached by content.

Block ids are deterministic, so tests can assert exact ids. Blocks that were never cached (or whose content is not a
full block) sit on a FIFO free list. With prefix caching, a full block whose K/V are computed is registered under a
chained hash of its token ids; when its last owner frees it, it keeps its content and joins an LRU of cached free
blocks. Allocation takes a never-cached block first and only then evicts the least recently freed cached block, so
caching never costs a request a block. A block with owners (ref count > 0) is never on either list, so a block that
running sequences share is never evicted."""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from warmstart.engine.sequence import Sequence

# Block keys are SHA-256 digests chained over the whole prefix: key_i = sha256(key_{i-1} || token ids of block i),
# with key_{-1} = sha256(ROOT_TAG || extra). A collision would need a SHA-256 collision, so equal keys mean equal
# prefixes (and equal `extra`, the seam for LoRA ids or image hashes). Each hit also compares the block's own token
# ids and parent key as a cheap second check; the unit tests inject a colliding hash to show it holds.
ROOT_TAG = b"warmstart.prefix.v1\0"
HashFn = Callable[[bytes, tuple[int, ...]], bytes]


def sha256_block_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def root_hash(extra: bytes) -> bytes:
    return hashlib.sha256(ROOT_TAG + extra).digest()


@dataclass(frozen=True)
class CachedBlock:
    """A cached full block: its key, its parent's key (a root hash for the first block), its token ids, its
    position in the chain (0 = first block of a prompt) and the `extra` its chain was rooted in."""
    block: int
    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    depth: int
    extra: bytes = b""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_fn: HashFn = sha256_block_hash):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching, self._hash = enable_caching, hash_fn
        self._free: deque[int] = deque(range(num_blocks))       # never cached: FIFO
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, no owner: least recently freed first
        self._refs = [0] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._meta: dict[int, CachedBlock] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never-cached ones plus cached ones that nobody owns (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, owned or not."""
        return len(self._meta)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so its table covers num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Append blocks to seq's table until it covers num_tokens tokens (the append path for decode too)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free} free")
        for _ in range(need):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            self._refs[block] = 1
            seq.block_table.append(block)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Share parent's blocks that are full for the first num_tokens tokens (their contents never change
        again) with child, which has no blocks yet. Shared blocks are counted, and freed by their last owner."""
        assert not child.block_table, "fork into a sequence that already owns blocks"
        full = num_tokens // self.block_size
        for block in parent.block_table[:full]:
            self._refs[block] += 1
            child.block_table.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; a block returns to a free list when its last owner lets go. Its computed full
        blocks are cached first, tail first into the LRU, so a chain loses its tail before its head."""
        self.commit(seq)
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} freed twice"
            if self._refs[block] == 0:
                if block in self._meta:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release seq's trailing blocks beyond what num_tokens tokens need: speculative slots the target
        rejected. Such blocks hold no verified full block, so none is registered in the prefix cache."""
        keep = max(self.blocks_for(num_tokens), seq.num_committed_blocks)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self._refs[block] -= 1
            assert self._refs[block] == 0 and block not in self._meta, f"trimmed block {block} is shared or cached"
            self._free.appendleft(block)

    # -- prefix cache -----------------------------------------------------------------------------------------
    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained keys of seq's first num_blocks full blocks of tokens (computed once, kept on the seq)."""
        keys, bs = seq.block_keys, self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            keys.append(self._hash(keys[-1] if keys else root_hash(seq.cache_extra),
                                   tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return keys[:num_blocks]

    def match(self, seq: Sequence) -> list[int]:
        """The longest run of cached blocks that holds seq's leading full blocks. Never the block of seq's last
        token: that token is always computed, so the step that runs it yields the logits to sample from."""
        if not self.enable_caching:
            return []
        limit = (len(seq.token_ids) - 1) // self.block_size
        hits, bs, parent = [], self.block_size, root_hash(seq.cache_extra)
        for i, key in enumerate(self.keys(seq, limit)):
            block = self._by_key.get(key)
            if block is None:
                break
            meta = self._meta[block]
            if meta.parent != parent or meta.token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break                          # a colliding key: not this prefix
            hits.append(block)
            parent = key
        return hits

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of these blocks sit in the evictable LRU (taking them shrinks num_free)."""
        return sum(1 for b in blocks if b in self._evictable)

    def take(self, seq: Sequence, blocks: list[int]) -> None:
        """Give seq (which owns no blocks yet) the cached blocks `match` found; they count as computed."""
        assert not seq.block_table, "take into a sequence that already owns blocks"
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_committed_blocks = len(blocks)

    def commit(self, seq: Sequence) -> None:
        """Register seq's full blocks whose K/V are computed. A block already cached (a hit or a fork) is skipped;
        so is one whose content another block already caches (two sequences computed it in the same step)."""
        if not self.enable_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_committed_blocks:
            return
        keys, bs = self.keys(seq, full), self.block_size
        for i in range(seq.num_committed_blocks, full):
            block = seq.block_table[i]
            if block in self._meta or keys[i] in self._by_key:
                continue
            parent = keys[i - 1] if i else root_hash(seq.cache_extra)
            self._register(CachedBlock(block, keys[i], parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]), i,
                                       seq.cache_extra))
        seq.num_committed_blocks = full

    def cached_blocks(self) -> list[CachedBlock]:
        """Every cached block, most recently used first: owned ones, then the LRU from its newest end."""
        owned = [m for b, m in self._meta.items() if self._refs[b] > 0]
        return owned + [self._meta[b] for b in reversed(self._evictable)]

    def adopt(self, entries: list[CachedBlock]) -> None:
        """Register blocks whose K/V were just written from outside (a prefix restore at boot). Each entry's block
        must be on the never-cached free list; they join the LRU in order, so list the ones to evict first."""
        taken = {e.block for e in entries}
        assert all(self._refs[b] == 0 and b not in self._meta for b in taken), "adopt into a block in use"
        self._free = deque(b for b in self._free if b not in taken)
        for e in entries:
            self._register(e)
            self._evictable[e.block] = None

    def free_block_ids(self, count: int) -> list[int]:
        """The first count never-cached free blocks (where a restore may write), without taking them."""
        return list(self._free)[:count]

    def is_cached(self, key: bytes) -> bool:
        return key in self._by_key

    def hash_block(self, parent: bytes, token_ids: tuple[int, ...]) -> bytes:
        return self._hash(parent, token_ids)

    def _register(self, meta: CachedBlock) -> None:
        self._meta[meta.block] = meta
        self._by_key[meta.key] = meta.block

    def _forget(self, block: int) -> None:
        meta = self._meta.pop(block)
        del self._by_key[meta.key]
