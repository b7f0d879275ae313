"""Continuous batching with chunked prefill and preemption by recompute.

Every step has a token budget (max_num_batched_tokens). Running sequences go first, in arrival order: a decoding
sequence takes 1 token, a sequence mid-prefill takes the next chunk. Waiting sequences are admitted FCFS with what
is left, up to max_num_seqs running. When a running sequence needs a block and none is free, the most recently
admitted running sequence is preempted: its blocks are freed and it is re-queued at the front, to be recomputed."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from warmstart.engine.block_manager import BlockManager
from warmstart.engine.sequence import Sequence, Status
from warmstart.runner.batch import Batch, BatchItem


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class Scheduled:
    seq: Sequence
    num_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[Scheduled]
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.scheduled

    def to_batch(self, finished_seq_ids: list[int]) -> Batch:
        items = []
        for s in self.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            items.append(BatchItem(
                seq_id=seq.seq_id, token_ids=seq.token_ids[start:start + s.num_tokens], start=start,
                block_table=list(seq.block_table), sample=start + s.num_tokens == len(seq.token_ids),
                params=seq.params, prompt_len=seq.num_prompt_tokens,
                next_prompt_token=(seq.token_ids[start + s.num_tokens]
                                   if start + s.num_tokens < seq.num_prompt_tokens else None)))
        return Batch(items, finished_seq_ids)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager):
        self.limits, self.blocks = limits, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            # Free blocks by preempting from the back; never a sequence already scheduled this step (index < i).
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append(Scheduled(seq, n))
            budget -= n
            i += 1
        # Admit new work only in a step that did not have to preempt: memory is tight otherwise.
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs and not preempted:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(Scheduled(seq, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire seq (finished, stopped or aborted) from whichever queue holds it and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
