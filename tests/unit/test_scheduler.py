"""Scheduler: continuous batching, chunked prefill, max_num_seqs, and preemption by recompute, with exact ids."""
from warmstart.engine.block_manager import BlockManager
from warmstart.engine.scheduler import Scheduler, SchedulerLimits
from warmstart.engine.sequence import Sequence, Status
from warmstart.sampling_params import SamplingParams
from tests.stepping import run_step


def make(num_blocks=16, block_size=4, max_seqs=4, max_tokens=16, max_len=64, caching=True):
    bm = BlockManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerLimits(max_seqs, max_tokens, max_len), bm), bm


def seq(i, n):
    return Sequence(i, f"r{i}", list(range(1, n + 1)), SamplingParams())


def test_prefill_then_decode_batches_together():
    s, bm = make()
    a, b = seq(0, 5), seq(1, 3)
    s.add(a), s.add(b)
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 5), (1, 3)]
    assert a.block_table == [0, 1] and b.block_table == [2]
    c = seq(2, 2)
    s.add(c)
    out = run_step(s)                        # decodes first, then the newcomer's prefill, in one step
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 1), (1, 1), (2, 2)]
    assert b.block_table == [2] and c.block_table == [3]


def test_chunked_prefill_respects_token_budget():
    s, bm = make(max_tokens=8)
    a, b = seq(0, 20), seq(1, 3)
    s.add(a), s.add(b)
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 8)]
    assert a.block_table == [0, 1]
    batch = out.batch
    assert batch.items[0].token_ids == list(range(1, 9)) and not batch.items[0].sample
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 8)]
    out = run_step(s)                        # last 4 of a's prompt, then b fits in the remaining budget
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 4), (1, 3)]
    assert out.batch.items[0].sample and out.batch.items[0].start == 16
    assert a.block_table == [0, 1, 2, 3, 4] and b.block_table == [5]


def test_max_num_seqs_limits_admission():
    s, _ = make(max_seqs=2)
    seqs = [seq(i, 2) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = run_step(s)
    assert [x.seq.seq_id for x in out.scheduled] == [0, 1]
    assert seqs[2].status is Status.WAITING


def test_preemption_frees_latest_and_recomputes():
    # Without the prefix cache, so the recompute is whole (tests/unit/test_prefix_cache.py has the cached resume).
    s, bm = make(num_blocks=4, block_size=2, max_tokens=64, caching=False)
    a, b = seq(0, 4), seq(1, 4)              # 2 blocks each: the cache is full after admission
    s.add(a), s.add(b)
    run_step(s)
    assert a.block_table == [0, 1] and b.block_table == [2, 3] and bm.num_free == 0
    out = run_step(s)                        # a needs a 3rd block: b (admitted last) is preempted
    assert [x.seq_id for x in out.preempted] == [1]
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 1)]
    assert a.block_table == [0, 1, 3]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.token_ids == [1, 2, 3, 4, 7]    # its sampled token is kept and recomputed with the prompt
    assert s.waiting[0] is b
    s.finish(a, "stop")
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(1, 5)]


def test_finish_frees_blocks_from_either_queue():
    s, bm = make(num_blocks=4, block_size=4)
    a, b = seq(0, 4), seq(1, 4)
    s.add(a)
    run_step(s)
    s.add(b)
    s.finish(b, "abort")                      # still waiting
    s.finish(a, "abort")                      # running
    assert bm.num_free == 4 and not s.has_work
    assert a.finish_reason == b.finish_reason == "abort"


def test_forked_children_share_full_prompt_blocks():
    s, bm = make(num_blocks=16, block_size=4)
    parent, c1, c2 = seq(0, 10), seq(1, 10), seq(2, 10)
    s.add(parent, [c1, c2])
    s.release_forks()                         # parent has not computed its prompt yet: nothing happens
    assert list(s.waiting) == [parent] and s.forks
    run_step(s)
    assert parent.block_table == [0, 1, 2]
    s.release_forks()
    assert list(s.waiting) == [c1, c2] and not s.forks
    assert c1.block_table == c2.block_table == [0, 1] and c1.num_computed_tokens == 8
    assert [bm.ref_count(b) for b in (0, 1, 2)] == [3, 3, 1]
    out = run_step(s)                         # parent decodes; each child computes its last 2 prompt tokens
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 1), (1, 2), (2, 2)]
    assert c1.block_table == [0, 1, 3] and c2.block_table == [0, 1, 4]
    s.finish(parent, "stop")
    assert [bm.ref_count(b) for b in (0, 1, 2)] == [2, 2, 0]


def test_prompt_that_fills_whole_blocks_leaves_one_token_to_compute():
    s, bm = make(num_blocks=16, block_size=4)
    parent, child = seq(0, 8), seq(1, 8)
    s.add(parent, [child])
    run_step(s)
    s.release_forks()
    assert child.block_table == [0] and child.num_computed_tokens == 4   # not both blocks: 4 tokens left to run
