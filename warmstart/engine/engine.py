"""Engine: add / abort / step. A step is: schedule -> execute -> postprocess."""
from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Protocol

from warmstart.engine.block_manager import BlockManager
from warmstart.engine.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from warmstart.engine.sequence import Sequence, Status
from warmstart.errors import UserError
from warmstart.runner.batch import Batch, ItemResult
from warmstart.sampling_params import SamplingParams
from warmstart.spec import SpecStats

log = logging.getLogger("warmstart.engine")

class Executor(Protocol):
    def execute(self, batch: Batch) -> list[ItemResult]: ...


@dataclass(frozen=True)
class RequestOutput:
    """What one step changed for one request. `seq` is the live sequence (full token ids, text, logprobs)."""
    request_id: str
    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    finished: bool
    error: str | None = None          # this request failed (finish_reason "error"); the message names why

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason


class Engine:
    def __init__(self, executor: Executor, limits: SchedulerLimits, num_blocks: int, block_size: int,
                 vocab_size: int, eos_token_ids: tuple[int, ...] = (),
                 decode: Callable[[list[int]], str] | None = None, enable_prefix_caching: bool = True,
                 proposer=None, num_speculative_tokens: int = 0,
                 step_threads: Callable[[], ContextManager] = contextlib.nullcontext):
        self.executor, self.limits, self.vocab_size = executor, limits, vocab_size
        self.step_threads = step_threads         # a step's team size and pinning (runner/step_threads.py); it may
        # yield a recorder of the step's shape (sequences, tokens)
        self.blocks = BlockManager(num_blocks, block_size, enable_caching=enable_prefix_caching)
        # Speculative decoding (warmstart/spec): the proposer drafts up to K tokens per decoding sequence, the
        # runner verifies them in the step's one target forward.
        self.proposer = proposer if num_speculative_tokens > 0 else None
        self.scheduler = Scheduler(limits, self.blocks, num_speculative_tokens if self.proposer else 0)
        self.spec_stats = SpecStats(self.proposer.method if self.proposer else "off",
                                    num_speculative_tokens if self.proposer else 0)
        self.eos_token_ids = set(eos_token_ids)
        self.decode = decode
        self._ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}
        self._finished_ids: list[int] = []
        self._sent: dict[int, int] = {}          # seq_id -> characters of output_text already emitted
        self.num_preemptions = 0                 # since boot, for metrics

    # -- requests -------------------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue one request; UserError for a bad prompt or a request id already in flight."""
        return self.add_group([request_id], prompt_token_ids, [params])[0]

    def add_group(self, request_ids: list[str], prompt_token_ids: list[int],
                  params: list[SamplingParams]) -> list[Sequence]:
        """Parallel samples of one prompt (OpenAI's n): the first computes the prompt, the others then share its
        full prompt blocks instead of computing and storing the same K/V again."""
        self.check_prompt(prompt_token_ids)
        # min_tokens bans the EOS ids too, which only the engine knows.
        params = [replace(p, min_tokens_banned=tuple(sorted(self.eos_token_ids | set(p.stop_token_ids))))
                  if p.min_tokens else p for p in params]
        dup = [r for r in request_ids if r in self._by_request] or \
            [r for i, r in enumerate(request_ids) if r in request_ids[:i]]
        if dup:
            raise UserError(f"request id {dup[0]!r} is already in flight.")
        seqs = [Sequence(next(self._ids), rid, list(prompt_token_ids), p) for rid, p in zip(request_ids, params)]
        for seq in seqs:
            self._by_request[seq.request_id] = seq
            self._sent[seq.seq_id] = 0
        self.scheduler.add(seqs[0], seqs[1:])
        return seqs

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        n, limit = len(prompt_token_ids), self.limits.max_model_len
        if n == 0:
            raise UserError("The prompt is empty; send at least one token.")
        if n >= limit:
            raise UserError(f"The prompt is {n} tokens but max_model_len is {limit}, which must also leave room "
                            f"for at least one generated token. Shorten the prompt or raise --max-model-len.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"Token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1}).")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now. Returns False if it was unknown or already done."""
        seq = self._by_request.pop(request_id, None)
        if seq is None or seq.finished:
            return False
        self._retire(seq, "abort")
        self._sent.pop(seq.seq_id, None)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self.step_threads() as record:
            return self._step(record)

    def _step(self, record: Callable[[tuple[int, int]], None] | None = None) -> list[RequestOutput]:
        self.scheduler.release_forks()
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        finished_ids, self._finished_ids = self._finished_ids, []
        if out.empty:
            if finished_ids:
                self.executor.execute(Batch([], finished_ids))
            return []
        batch = out.to_batch(finished_ids)
        if record is not None:                   # what the step was, for step_threads' comparisons of team sizes
            record((len(batch.items), batch.num_tokens))
        if self.proposer is not None:
            self.proposer.finished(finished_ids)
            batch = self._propose(out, batch)
        try:
            results = self.executor.execute(batch)
        except Exception:
            results = self._execute_alone(batch)
        return self._postprocess(out, results, batch)

    def _propose(self, out: SchedulerOutput, batch: Batch) -> Batch:
        """Ask the proposer for each decoding sequence's drafts and append them to its item. Every item goes to
        the proposer (a draft model mirrors prefill chunks into its own cache); a failure only turns speculation
        off for this step."""
        lookahead = [s.lookahead for s in out.scheduled]
        try:
            proposals = self.proposer.propose([s.seq for s in out.scheduled], batch.items, lookahead)
        except Exception:
            log.exception("speculative proposer failed; this step runs without proposals")
            return batch
        items = []
        for it, k, (drafts, probs) in zip(batch.items, lookahead, proposals):
            drafts = list(drafts)[:k]
            if drafts:
                it = replace(it, token_ids=it.token_ids + drafts, draft_token_ids=tuple(drafts),
                             draft_probs=None if probs is None else probs[:len(drafts)])
            items.append(it)
        return Batch(items, batch.finished_seq_ids)

    def _execute_alone(self, batch: Batch) -> list[ItemResult]:
        """The step raised for the batch as a whole: run each item by itself, so a failure one request's input
        causes fails only that request. Re-running is safe: an item writes the same K/V into its own slots, and
        sampling never raises (the runner isolates it), so no generator has drawn for a retried item."""
        results = []
        for item in batch.items:
            try:
                results.extend(self.executor.execute(Batch([item], batch.finished_seq_ids)))
            except Exception as e:
                log.exception("request step failed (sequence %d)", item.seq_id)
                results.append(ItemResult(None, error=f"{type(e).__name__}: {e}"))
        return results

    def _postprocess(self, out: SchedulerOutput, results: list[ItemResult], batch: Batch) -> list[RequestOutput]:
        outputs = []
        for sched, res, item in zip(out.scheduled, results, batch.items):
            seq = sched.seq
            error = res.error
            if error is None:
                try:                    # one request's stop check or detokenization failing fails it alone
                    output = self._apply(sched, seq, res, item)
                except Exception as e:
                    log.exception("postprocessing request %s failed", seq.request_id)
                    error = f"postprocessing failed: {type(e).__name__}: {e}"
                else:
                    if output is not None:
                        outputs.append(output)
                    continue
            self._retire(seq, "error")
            self._sent.pop(seq.seq_id, None)
            outputs.append(RequestOutput(seq.request_id, seq, [], "", True, error))
        return outputs

    def _apply(self, sched, seq: Sequence, res: ItemResult, item) -> RequestOutput | None:
        tokens = res.all_token_ids
        # Accepted proposals were fed to the target this step, so their K/V are in the cache; the rejected
        # ones' slots are released below (and would be rewritten before any read).
        accepted = max(0, len(tokens) - 1)
        seq.num_computed_tokens += sched.num_tokens + accepted
        if item.draft_token_ids:
            stats = self.spec_stats
            stats.proposals += len(item.draft_token_ids)
            stats.accepted += accepted
            stats.verify_steps += 1
            stats.committed += len(tokens)
        if res.prompt_logprobs and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
            seq.prompt_logprobs.extend(res.prompt_logprobs)   # a recompute after preemption adds nothing twice
        if not tokens:
            return None
        lps = res.token_logprobs if res.token_logprobs is not None else [res.logprobs]
        new = []
        for tok, lp in zip(tokens, lps):
            seq.token_ids.append(tok)
            new.append(tok)
            if lp is not None:
                seq.logprobs.append(lp)
            reason = self._stop_reason(seq, tok)
            if reason:                           # a stop or max_tokens mid-proposal: nothing after it is kept
                self._retire(seq, reason)
                break
        if sched.lookahead and not seq.finished:
            self.blocks.trim(seq, len(seq.token_ids))
        return RequestOutput(seq.request_id, seq, new, self._text_delta(seq), seq.finished)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self._update_text(seq, drop_last=True)
            return "stop"
        if self._update_text(seq) and p.stop and len(seq.output_token_ids) >= p.min_tokens:
            text = seq.output_text
            longest = max(len(s) for s in p.stop)
            since = max(0, self._sent[seq.seq_id] - longest)
            hits = [i for i in (text.find(s, since) for s in p.stop) if i >= 0]
            if hits:
                first = min(hits)
                if p.include_stop_str_in_output:
                    first += max(len(s) for s in p.stop if text.startswith(s, first))
                seq.output_text = text[:first]
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.limits.max_model_len:
            return "length"
        return None

    def _update_text(self, seq: Sequence, drop_last: bool = False) -> bool:
        if self.decode is None:
            return False
        ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
        seq.output_text = (self.decode(ids) if seq.params.skip_special_tokens
                           else self.decode(ids, skip_special_tokens=False))
        return True

    def _text_delta(self, seq: Sequence) -> str:
        """New text that is safe to show: not a half-decoded character, not a possible start of a stop string."""
        text = seq.output_text
        if not seq.finished:
            text = text.rstrip("\ufffd")
            if seq.params.stop:
                text = text[:max(0, len(text) - max(len(s) for s in seq.params.stop) + 1)]
        sent = self._sent.pop(seq.seq_id, 0) if seq.finished else self._sent.get(seq.seq_id, 0)
        if len(text) <= sent:
            return ""
        if not seq.finished:
            self._sent[seq.seq_id] = len(text)
        return text[sent:]

    def _retire(self, seq: Sequence, reason: str) -> None:
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, reason)
            self._finished_ids.append(seq.seq_id)
        self._by_request.pop(seq.request_id, None)

