"""Proposers: for each decoding sequence of a step, up to `lookahead` tokens the target then verifies.

A proposer sees the engine's sequences (their full token ids) and the step's batch items, and returns per item a
list of proposed tokens (maybe fewer than asked, maybe none) and, for sampled requests, the distributions they
were drawn from ([n, V] tensor, or None: a deterministic proposal, a point mass)."""
from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from warmstart.engine.sequence import Sequence
from warmstart.runner.batch import BatchItem

Proposal = tuple[list[int], "torch.Tensor | None"]


class Proposer(Protocol):
    method: str

    def propose(self, seqs: list[Sequence], items: list[BatchItem], lookahead: list[int]) -> list[Proposal]: ...

    def finished(self, seq_ids: list[int]) -> None: ...


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (n from max_n down
    to min_n) in its own prompt + output and propose what followed it. No model, no state."""
    method = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, window: int = 4096):
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, seqs: list[Sequence], items: list[BatchItem], lookahead: list[int]) -> list[Proposal]:
        return [(self.lookup(seq.token_ids, k), None) if k else ([], None) for seq, k in zip(seqs, lookahead)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        tokens = tokens[-self.window:]
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = tokens[size - n:]
            # the latest match that ends before the suffix itself
            for start in range(size - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow
        return []

    def finished(self, seq_ids: list[int]) -> None:
        pass


class DraftProposer:
    """A small model with its own runner and KV cache. Its cache mirrors the target's block tables (same block
    ids, same block size), so the engine's blocks cover both; it holds its own count of valid positions per
    sequence: whatever the target rolled back (rejected proposals) or forgot (preemption) is recomputed from the
    sequence's tokens before it proposes again. Its K/V only ever affect how often proposals are accepted, never
    which tokens the target emits."""
    method = "draft"

    def __init__(self, runner):
        from warmstart.runner.attention import PagedAttentionBackend
        self.runner = runner
        self._backend = PagedAttentionBackend
        self._computed: dict[int, int] = {}           # seq_id -> leading positions whose draft K/V are valid
        self._generators: dict[int, torch.Generator] = {}
        dev = runner.device
        self._unseeded = torch.Generator(device=dev).manual_seed((torch.initial_seed() + 0x5EED) % 2**63)
        self.forwards = 0

    def finished(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self._computed.pop(s, None)
            self._generators.pop(s, None)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        p = seq.params
        if p.greedy:
            return None
        if p.seed is None:
            return self._unseeded
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            # A stream of its own, derived from the request's seed: reproducible, and independent of the
            # target's generator (which draws the acceptance tests and resamples).
            gen = self._generators[seq.seq_id] = torch.Generator(device=self.runner.device).manual_seed(
                (p.seed * 0x9E3779B1 + 0x5EED) % 2**63)
        return gen

    def _forward(self, items: list[BatchItem]) -> torch.Tensor:
        r = self.runner
        input_ids, positions, meta = r._prepare(items)
        attn = self._backend(r.kv, r.block_size)
        attn.meta = meta
        self.forwards += 1
        return r.forward(input_ids, positions, attn)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, torch.Tensor | None]]:
        from warmstart.runner.verify import _draw, processed_probs
        out = []
        for row, seq in zip(logits, seqs):
            if seq.params.greedy:
                out.append((int(row.argmax()), None))
            else:
                q = processed_probs(row[None], seq.params)[0]
                out.append((_draw(q, self._generator(seq)), q))
        return out

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], items: list[BatchItem], lookahead: list[int]) -> list[Proposal]:
        # Forward 1: every item catches up to the tokens the target computes this step (prefill chunks mirrored,
        # rolled-back positions recomputed); decoding items with a lookahead then read logits for d_1.
        feed, ends = [], []
        for seq, it in zip(seqs, items):
            end = it.start + len(it.token_ids)
            valid = min(self._computed.get(seq.seq_id, it.start), it.start)
            feed.append(replace(it, token_ids=seq.token_ids[valid:end], start=valid, sample=False,
                                draft_token_ids=(), draft_probs=None))
            ends.append(end)
            self._computed[seq.seq_id] = end
        hidden = self._forward(feed)
        props: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        active = [i for i, k in enumerate(lookahead) if k > 0]
        if not active:
            return [([], None) for _ in items]
        last_rows, row = [], 0
        for i, f in enumerate(feed):
            row += len(f.token_ids)
            if i in active:
                last_rows.append(row - 1)
        logits = self.runner.model.compute_logits(hidden[torch.tensor(last_rows, device=hidden.device)])
        for i, (tok, q) in zip(active, self._draw(logits, [seqs[i] for i in active])):
            props[i].append(tok)
            if q is not None:
                probs[i].append(q)
        # Forwards 2..K: one token each for the sequences that still want more.
        for j in range(1, max(lookahead)):
            active = [i for i in active if lookahead[i] > j]
            if not active:
                break
            step = [replace(feed[i], token_ids=[props[i][-1]], start=ends[i] + j - 1) for i in active]
            hidden = self._forward(step)
            logits = self.runner.model.compute_logits(hidden)
            for i, (tok, q) in zip(active, self._draw(logits, [seqs[i] for i in active])):
                props[i].append(tok)
                if q is not None:
                    probs[i].append(q)
                self._computed[seqs[i].seq_id] = ends[i] + j
        return [(props[i], torch.stack(probs[i]) if probs[i] else None) for i in range(len(items))]
