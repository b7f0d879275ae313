"""Block manager: exact block ids, append, free order, reference counts."""
import pytest

from warmstart.engine.block_manager import BlockManager
from warmstart.engine.sequence import Sequence
from warmstart.sampling_params import SamplingParams


def seq(i, n):
    return Sequence(i, f"r{i}", list(range(n)), SamplingParams())


def test_allocate_exact_ids_and_append():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(0, 5), seq(1, 4)
    bm.allocate(a, 5)
    assert a.block_table == [0, 1]
    bm.allocate(b, 4)
    assert b.block_table == [2]
    bm.allocate(a, 8)                      # still fits in two blocks
    assert a.block_table == [0, 1]
    bm.allocate(a, 9)                      # decode crosses a block boundary: append one
    assert a.block_table == [0, 1, 3]
    assert bm.num_free == 4 and bm.num_used == 4


def test_free_returns_blocks_fifo():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = seq(0, 4), seq(1, 2)
    bm.allocate(a, 4)
    bm.allocate(b, 2)
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 3
    c = seq(2, 6)
    bm.allocate(c, 6)
    assert c.block_table == [3, 1, 0]      # never-used block first, then a's blocks in the order they were freed


def test_can_allocate_and_out_of_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq(0, 9)
    assert bm.blocks_needed(a, 9) == 3 and not bm.can_allocate(a, 9)
    with pytest.raises(RuntimeError):
        bm.allocate(a, 9)
    assert a.block_table == [] and bm.num_free == 2


def test_fork_shares_full_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=6, block_size=4)
    parent, child = seq(0, 10), seq(1, 10)
    bm.allocate(parent, 10)                 # blocks 0, 1 full; 2 partial
    bm.fork(parent, child, 10)
    assert child.block_table == [0, 1]
    assert [bm.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]
    bm.free(parent)
    assert bm.num_free == 4                 # only the partial block came back
    bm.free(child)
    assert bm.num_free == 6 and all(bm.ref_count(b) == 0 for b in range(6))
