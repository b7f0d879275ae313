"""Paged KV-cache bookkeeping: which physical blocks each sequence owns. Block ids are deterministic: the free list
is FIFO, so tests can assert exact ids."""
from __future__ import annotations

from collections import deque

from warmstart.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so its table covers num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Append blocks to seq's table until it covers num_tokens tokens (the append path for decode too)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
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
        """Release seq's blocks; a block returns to the free list when its last owner lets go."""
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} freed twice"
            if self._refs[block] == 0:
                self._free.append(block)
        seq.block_table = []
