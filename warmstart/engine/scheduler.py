"""Continuous batching with chunked prefill and preemption by recompute.

Every step has a token budget (max_num_batched_tokens). Running sequences go first, in arrival order: a decoding
sequence takes 1 token, a sequence mid-prefill takes the next chunk. Waiting sequences are admitted FCFS with what
is left, up to max_num_seqs running. When a running sequence needs a block and none is free, the most recently
admitted running sequence is preempted: its blocks are freed and it is re-queued at the front, to be recomputed.

Prefix caching: at admission a sequence takes the longest run of cached blocks holding its leading tokens and
starts computing after them (BatchItem.start > 0, the same path as a later prefill chunk). A preempted sequence
finds its own freed blocks this way unless they were evicted meanwhile. A request that wants prompt logprobs skips
the lookup: every prompt row must be computed to produce them."""
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


@dataclass
class PrefixStats:
    """Prompt tokens looked up in the prefix cache at first admission, and how many were found (tokens)."""
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True)
class Scheduled:
    seq: Sequence
    num_tokens: int
    lookahead: int = 0        # speculative decoding: proposed tokens this decode step may verify (slots held)


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
                                   if start + s.num_tokens < seq.num_prompt_tokens else None),
                history=seq.token_ids if seq.params.processes_logits else None))
        return Batch(items, finished_seq_ids)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager, num_lookahead: int = 0):
        self.limits, self.blocks = limits, blocks
        # Speculative decoding: a decoding sequence may feed up to this many proposed tokens after its last one.
        # They take budget and KV slots for this step only; the engine trims what the target rejected.
        self.num_lookahead = num_lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Parallel samples of one prompt wait here until their parent has the prompt in the KV cache; then they
        # share its full prompt blocks (reference-counted) and compute only the rest.
        self.forks: dict[int, tuple[Sequence, list[Sequence]]] = {}
        self.prefix_stats = PrefixStats()

    def add(self, seq: Sequence, children: list[Sequence] | None = None) -> None:
        """Queue seq; `children` (same prompt) are admitted once seq's prompt is cached, sharing its blocks."""
        self.waiting.append(seq)
        if children:
            self.forks[seq.seq_id] = (seq, list(children))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.forks)

    def release_forks(self) -> None:
        """After a step: fork the children of parents whose prompt is now in the cache. Children of a parent that
        finished or was aborted before that are queued to compute their prompt themselves."""
        for pid, (parent, children) in list(self.forks.items()):
            if parent.status is Status.FINISHED:
                share = 0
            elif parent.num_computed_tokens >= parent.num_prompt_tokens:
                # Full blocks only, and never the whole prompt: a child must compute at least one token itself
                # to get the logits it samples from.
                share = (parent.num_prompt_tokens - 1) // self.blocks.block_size * self.blocks.block_size
            else:
                continue
            del self.forks[pid]
            for child in reversed(children):
                if child.status is Status.FINISHED:
                    continue
                if share and child.params.prompt_logprobs is None:     # prompt logprobs need every prompt row
                    self.blocks.fork(parent, child, share)
                    child.num_computed_tokens = child.num_cached_tokens = share
                self.waiting.appendleft(child)

    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        preempted: list[Sequence] = []
        for seq in self.running:                  # what the last step computed becomes findable in the cache
            self.blocks.commit(seq)
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
        # Speculative slots come after every running sequence has its own tokens' blocks, so they never cause a
        # preemption; they go before admissions (a proposal is cheaper than a new prefill's first chunk).
        for j, s in enumerate(scheduled if self.num_lookahead else ()):
            la = self._lookahead(s.seq, s.num_tokens, budget)
            if la:
                self.blocks.allocate(s.seq, s.seq.num_computed_tokens + s.num_tokens + la)
                scheduled[j] = Scheduled(s.seq, s.num_tokens, la)
                budget -= la
        # Admit new work only in a step that did not have to preempt: memory is tight otherwise.
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs and not preempted:
            seq = self.waiting[0]
            hits = self._match(seq)
            start = len(hits) * self.blocks.block_size if hits else seq.num_computed_tokens
            n = min(len(seq.token_ids) - start, budget)
            # Cached blocks nobody owns count as free until taken: taking them must leave enough for the rest.
            need = self.blocks.blocks_for(start + n) - (len(hits) or len(seq.block_table))
            if need > self.blocks.num_free - self.blocks.num_evictable(hits):
                break
            self.waiting.popleft()
            if not seq.block_table:               # not a forked child, which shares its parent's blocks
                self._count_lookup(seq, start)
            if hits:
                self.blocks.take(seq, hits)
            self.blocks.allocate(seq, start + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(Scheduled(seq, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

    def _lookahead(self, seq: Sequence, n: int, budget: int) -> int:
        """Proposed tokens a decoding sequence may verify this step: at most num_lookahead, never more than the
        budget and free blocks allow (speculation never preempts), and never so many that accepting them all
        would pass max_tokens or max_model_len. Requests with logits processors (penalties, logit_bias, min_tokens,
        a grammar) decode one token per step: their processors depend on every token before the one they shape,
        which verification of several rows at once does not apply."""
        if not self.num_lookahead or n != 1 or seq.num_uncomputed != 1 or \
                seq.num_computed_tokens < seq.num_prompt_tokens or seq.params.processes_logits:
            return 0
        left = min(seq.params.max_tokens - len(seq.output_token_ids),
                   self.limits.max_model_len - len(seq.token_ids)) - 1
        la = max(0, min(self.num_lookahead, budget, left))
        while la and not self.blocks.can_allocate(seq, seq.num_computed_tokens + n + la):
            la -= 1
        return la

    def _match(self, seq: Sequence) -> list[int]:
        if seq.block_table or seq.params.prompt_logprobs is not None:   # a forked child already shares blocks
            return []
        return self.blocks.match(seq)

    def _count_lookup(self, seq: Sequence, start: int) -> None:
        """Hit-rate bookkeeping, in prompt tokens, once per request: at its first admission, if it looked."""
        if seq.num_preemptions or not self.blocks.enable_caching or seq.params.prompt_logprobs is not None:
            return
        seq.num_cached_tokens = min(start, seq.num_prompt_tokens)
        self.prefix_stats.queried_tokens += seq.num_prompt_tokens
        self.prefix_stats.hit_tokens += seq.num_cached_tokens

    def _preempt(self, seq: Sequence) -> None:
        # A forked child keeps nothing: freeing drops its references to shared blocks (the parent keeps them).
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire seq (finished, stopped or aborted) from whichever queue holds it and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
