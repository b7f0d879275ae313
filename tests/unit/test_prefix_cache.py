"""Prefix caching in the block manager and the scheduler, with exact block ids: hits, partial hits, the last token
always recomputed, LRU eviction order, shared blocks never evicted, colliding keys never served, preemption."""
import pytest

from warmstart.engine.block_manager import BlockManager, CachedBlock, root_hash, sha256_block_hash
from warmstart.engine.scheduler import Scheduler, SchedulerLimits
from warmstart.engine.sequence import Sequence
from warmstart.sampling_params import SamplingParams
from tests.stepping import run_step


def make(num_blocks=16, block_size=4, max_seqs=4, max_tokens=64, max_len=64, **bm_args):
    bm = BlockManager(num_blocks, block_size, **bm_args)
    return Scheduler(SchedulerLimits(max_seqs, max_tokens, max_len), bm), bm


def seq(i, tokens, **params):
    return Sequence(i, f"r{i}", list(tokens), SamplingParams(**params))


def computed(bm, i, tokens):
    """A sequence that holds `tokens` in the cache (allocated and computed), not yet freed."""
    q = seq(i, tokens)
    bm.allocate(q, len(tokens))
    q.num_computed_tokens = len(tokens)
    return q


def test_hit_reuses_full_blocks_and_computes_the_rest():
    s, bm = make()
    a = seq(0, range(1, 11))
    s.add(a)
    run_step(s)
    assert a.block_table == [0, 1, 2]
    s.finish(a, "stop")                       # blocks 0, 1 are full and computed: cached; 2 (partial) is not
    assert bm.num_cached == 2 and bm.num_free == 16
    b = seq(1, range(1, 11))
    s.add(b)
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(1, 2)]
    item = out.batch.items[0]
    assert item.start == 8 and item.token_ids == [9, 10] and item.sample
    assert b.block_table == [0, 1, 3]         # the cached pair, then the first never-cached free block
    assert [bm.ref_count(x) for x in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert (s.prefix_stats.queried_tokens, s.prefix_stats.hit_tokens) == (20, 8)
    assert s.prefix_stats.hit_rate == pytest.approx(0.4)


def test_partial_hit_stops_at_the_first_different_block():
    s, bm = make()
    a = seq(0, range(1, 11))
    s.add(a)
    run_step(s)
    s.finish(a, "stop")
    b = seq(1, [1, 2, 3, 4, 5, 6, 99, 98, 97])
    s.add(b)
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(1, 5)]
    assert out.batch.items[0].start == 4
    assert b.block_table == [0, 3, 4]
    assert bm.ref_count(1) == 0 and bm.num_cached == 2   # block 1 stays cached for a later hit


def test_last_prompt_token_is_always_computed():
    s, bm = make()
    a = seq(0, range(1, 9))                   # exactly two full blocks
    s.add(a)
    run_step(s)
    s.finish(a, "stop")
    b = seq(1, range(1, 9))
    s.add(b)
    out = run_step(s)
    # Both blocks are cached, but the second holds the last token, whose logits are sampled: only block 0 is used.
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(1, 4)]
    assert out.batch.items[0].start == 4 and b.block_table == [0, 2]


def test_eviction_takes_never_cached_blocks_first_then_least_recently_freed():
    bm = BlockManager(6, 4)
    a, b = computed(bm, 0, range(1, 9)), computed(bm, 1, range(11, 19))
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.free(a)
    bm.free(b)                                # LRU, oldest first: 1, 0 (a's tail first), then 3, 2
    assert bm.num_free == 6 and bm.num_cached == 4
    d = seq(2, [*range(1, 9), 9])             # a's prompt plus one: hits a's blocks, which become in use again
    bm.take(d, bm.match(d))
    assert d.block_table == [0, 1] and d.num_computed_tokens == 8
    bm.free(d)                                # a's blocks are now the most recently freed: LRU 3, 2, 1, 0
    c = seq(3, range(100, 116))
    bm.allocate(c, 16)
    assert c.block_table == [4, 5, 3, 2]      # never-cached 4, 5 first; then b's blocks, tail first
    assert bm.match(seq(4, [*range(11, 19), 1])) == []
    assert bm.match(seq(5, [*range(1, 9), 1])) == [0, 1]
    assert bm.num_cached == 2


def test_block_shared_by_running_sequences_is_never_evicted():
    s, bm = make(num_blocks=4, block_size=4, max_tokens=64)
    a = seq(0, range(1, 10))
    s.add(a)
    run_step(s)
    s.finish(a, "stop")                       # blocks 0, 1 cached; 2 back on the free list
    b, c = seq(1, range(1, 10)), seq(2, [*range(1, 9), 50])
    s.add(b), s.add(c)
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(1, 1), (2, 1)]
    assert b.block_table == [0, 1, 3] and c.block_table == [0, 1, 2]
    assert [bm.ref_count(x) for x in range(4)] == [2, 2, 1, 1] and bm.num_free == 0
    d = seq(3, range(200, 209))
    s.add(d)
    run_step(s)                               # b and c decode; d must wait: the shared blocks are not up for grabs
    assert d.block_table == [] and bm.match(seq(9, range(1, 10))) == [0, 1]
    s.finish(b, "stop")
    assert [bm.ref_count(x) for x in range(4)] == [1, 1, 1, 0] and bm.num_free == 1
    out = run_step(s)                         # c decodes; d (3 blocks) still does not fit beside c's shared blocks
    assert [x.seq.seq_id for x in out.scheduled] == [2] and d.block_table == []
    s.finish(c, "stop")
    run_step(s)                               # now the LRU may be evicted: never-cached 3, 2 first, then 1 (a tail)
    assert d.block_table == [3, 2, 1] and bm.match(seq(9, range(1, 10))) == [0]


def test_colliding_keys_are_never_a_hit():
    bm = BlockManager(8, 4, hash_fn=lambda parent, tokens: b"same key for everything")
    a = computed(bm, 0, range(1, 9))
    bm.free(a)                                # block 0 registered; block 1 has the same key, so it is not
    assert bm.num_cached == 1
    other = seq(1, [9, 9, 9, 9, 9])           # same key as block 0, different tokens
    assert bm.match(other) == []
    longer = seq(2, [1, 2, 3, 4, 40, 41, 42, 43, 44])
    assert bm.match(longer) == [0]            # block 0 truly matches; block 1's key points at block 0: rejected
    b = computed(bm, 3, [9, 9, 9, 9, 9])
    bm.free(b)                                # its key is taken: never overwrites a's entry
    assert bm.match(seq(4, [*range(1, 5), 0])) == [0] and bm.num_cached == 1


def test_keys_chain_over_the_whole_prefix_and_the_extra_seam():
    bm = BlockManager(8, 4)
    q = seq(0, [1, 2, 3, 4, 1, 2, 3, 4, 5])
    k0, k1 = bm.keys(q, 2)
    assert k0 != k1                           # same tokens, different prefix
    assert k0 == sha256_block_hash(root_hash(b""), (1, 2, 3, 4)) and k1 == sha256_block_hash(k0, (1, 2, 3, 4))
    bm.free(computed(bm, 1, [1, 2, 3, 4, 1, 2, 3, 4]))
    lora = seq(2, [1, 2, 3, 4, 1, 2, 3, 4, 5])
    lora.cache_extra = b"lora:adapter-7"
    assert bm.match(lora) == [] and bm.match(q) == [0, 1]


def test_preempted_sequence_resumes_from_its_cached_blocks():
    s, bm = make(num_blocks=4, block_size=2)
    a, b = seq(0, [1, 2, 3, 4]), seq(1, [11, 12, 13, 14])
    s.add(a), s.add(b)
    run_step(s)
    out = run_step(s)                         # a needs a 3rd block: b is preempted, and its tail block evicted
    assert [x.seq_id for x in out.preempted] == [1] and a.block_table == [0, 1, 3]
    s.finish(a, "stop")
    out = run_step(s)
    # b's first block survived in the cache: it recomputes 3 tokens, not 5.
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(1, 3)]
    assert out.batch.items[0].start == 2 and b.block_table == [2, 3, 1]
    assert b.num_cached_tokens == 0           # usage counts what the request found at its first admission


def test_prompt_logprobs_skip_the_lookup():
    s, bm = make()
    a = seq(0, range(1, 11))
    s.add(a)
    run_step(s)
    s.finish(a, "stop")
    b = seq(1, range(1, 11), prompt_logprobs=0)
    s.add(b)
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(1, 10)] and out.batch.items[0].start == 0
    assert b.block_table == [3, 4, 5] and s.prefix_stats.queried_tokens == 10


def test_same_prompt_computed_twice_in_one_step_caches_one_copy():
    s, bm = make()
    a, b = seq(0, range(1, 9)), seq(1, range(1, 9))
    s.add(a), s.add(b)
    run_step(s)
    run_step(s)
    assert a.block_table == [0, 1, 4] and b.block_table == [2, 3, 5] and bm.num_cached == 2
    s.finish(b, "stop")                       # b's copies were never registered: plain free blocks
    s.finish(a, "stop")
    c = seq(2, range(1, 9))
    s.add(c)
    run_step(s)
    assert c.block_table == [0, 6]


def test_disabled_cache_never_hits():
    s, bm = make(enable_caching=False)
    a = seq(0, range(1, 11))
    s.add(a)
    run_step(s)
    s.finish(a, "stop")
    b = seq(1, range(1, 11))
    s.add(b)
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(1, 10)]
    assert bm.num_cached == 0 and s.prefix_stats.queried_tokens == 0


def test_cached_blocks_most_recent_first_and_adopt():
    bm = BlockManager(8, 4)
    a = computed(bm, 0, range(1, 9))
    bm.free(a)
    b = computed(bm, 1, range(11, 15))
    bm.commit(b)                              # b still owns block 2: in use counts as most recent
    got = bm.cached_blocks()
    assert [(m.block, m.depth) for m in got] == [(2, 0), (0, 0), (1, 1)]
    assert got[2].parent == got[1].key and got[1].parent == root_hash(b"")
    fresh = BlockManager(8, 4)
    head, tail = got[1], got[2]
    fresh.adopt([CachedBlock(6, tail.key, tail.parent, tail.token_ids, tail.depth),     # evicted first
                 CachedBlock(5, head.key, head.parent, head.token_ids, head.depth)])
    assert fresh.num_free == 8 and fresh.num_cached == 2
    assert fresh.match(seq(2, [*range(1, 9), 1])) == [5, 6]
    c = seq(3, range(100, 128))
    fresh.allocate(c, 28)                     # 7 blocks: the six never-cached ones, then the LRU's oldest
    assert c.block_table == [0, 1, 2, 3, 4, 7, 6]
    assert fresh.match(seq(4, [*range(1, 9), 1])) == [5]


def test_chunked_prefill_shares_the_chunks_already_computed():
    s, bm = make(max_tokens=12)
    a = seq(0, range(1, 21))
    s.add(a)
    run_step(s)                               # a's first chunk: 12 tokens, blocks 0-2 full
    b = seq(1, range(1, 21))
    s.add(b)
    out = run_step(s)                         # a's last 8 tokens; b takes a's 3 computed blocks, then a 4-token chunk
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 8), (1, 4)]
    assert a.block_table == [0, 1, 2, 3, 4] and b.block_table == [0, 1, 2, 5]
    assert out.batch.items[1].start == 12 and not out.batch.items[1].sample
    assert [bm.ref_count(x) for x in range(6)] == [2, 2, 2, 1, 1, 1] and b.num_cached_tokens == 12


def test_abort_mid_prefill_keeps_the_computed_full_blocks():
    s, bm = make(max_tokens=6)
    a = seq(0, range(1, 21))
    s.add(a)
    run_step(s)                               # 6 tokens computed: block 0 full, block 1 half
    s.finish(a, "abort")
    assert bm.num_cached == 1 and bm.num_free == 16
    b = seq(1, range(1, 21))
    s.add(b)
    out = run_step(s)
    assert out.batch.items[0].start == 4 and b.block_table == [0, 2, 3]   # block 1 (half full) was not kept
