"""Per-request logits processors, applied to the sampling rows before the sampler draws: logit_bias, penalties
(repetition, frequency, presence), min_tokens and structured-output grammar masks.

Only rows whose params ask for processing are touched, so unconstrained requests in the same batch pay nothing but
one flag check. Grammar parse state is per sequence and lives here, like the sampler's per-sequence generators: it is
created on a sequence's first sampled token and dropped with the sequence's other runner state. A preempted sequence
keeps its matcher: recomputing its KV cache replays tokens the matcher has already consumed."""
from __future__ import annotations

import logging

import torch

from warmstart.runner.batch import BatchItem

log = logging.getLogger("warmstart.runner")


def apply_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float, frequency: float,
                    repetition: float) -> None:
    """In place on one row [V], as vLLM defines them: repetition over prompt and output tokens, frequency and
    presence over output tokens only."""
    vocab = logits.shape[-1]
    out = torch.tensor(output, dtype=torch.long, device=logits.device)
    counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype) if output else None
    if repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        ids = torch.tensor(prompt + output, dtype=torch.long, device=logits.device)
        seen[ids[ids < vocab]] = True
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits))
    if counts is not None:
        if frequency:
            logits.sub_(frequency * counts)
        if presence:
            logits.sub_(presence * (counts > 0).to(logits.dtype))


def unpack_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask [B, ceil(V/32)] (bit j of word i allows token 32 i + j) -> bool [B, V]."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((mask[:, :, None] >> bits) & 1).bool().reshape(mask.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]


class LogitsProcessors:
    """Owned by the runner; one instance serves every request."""

    def __init__(self) -> None:
        self._matchers: dict[int, object] = {}        # seq_id -> llguidance.LLMatcher

    def drop(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def apply(self, logits: torch.Tensor, items: list[BatchItem]) -> torch.Tensor:
        """logits [B, V] for items (one sampling row each) -> processed logits (the input itself when no row needs
        processing; a copy otherwise, so raw logits stay available for logprobs)."""
        rows = [i for i, it in enumerate(items) if it.params.processes_logits]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        grammar_rows = []
        for i in rows:
            it, p = items[i], items[i].params
            row = logits[i]
            if p.logit_bias:
                ids = torch.tensor([t for t, _ in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
                vals = torch.tensor([b for t, b in p.logit_bias if 0 <= t < vocab], dtype=logits.dtype)
                row.index_add_(0, ids.to(row.device), vals.to(row.device))
            history = it.history or []
            prompt, output = history[:it.prompt_len], history[it.prompt_len:]
            if p.penalized:
                apply_penalties(row, prompt, output, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            if p.min_tokens and len(output) < p.min_tokens:
                banned = [t for t in p.min_tokens_banned if 0 <= t < vocab]
                if banned:
                    row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
            if p.grammar is not None:
                grammar_rows.append(i)
        if grammar_rows:
            self._mask(logits, [(i, items[i]) for i in grammar_rows])
        return logits

    def _mask(self, logits: torch.Tensor, rows: list[tuple[int, BatchItem]]) -> None:
        vocab = logits.shape[-1]
        mask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
        for j, (_, it) in enumerate(rows):
            m = self._matcher(it)
            v = mask[j]
            m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        allowed = unpack_bitmask(mask, vocab).to(logits.device)
        idx = torch.tensor([i for i, _ in rows], dtype=torch.long, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))

    def _matcher(self, it: BatchItem):
        m = self._matchers.get(it.seq_id)
        if m is None:
            m = self._matchers[it.seq_id] = it.params.grammar.new_matcher()
        return m

    def accept(self, items: list[BatchItem], tokens: list[int]) -> None:
        """Advance the grammar state of constrained sequences by their sampled tokens."""
        for it, tok in zip(items, tokens):
            if it.params.grammar is None:
                continue
            m = self._matcher(it)
            if not m.consume_token(tok) and not m.is_stopped():
                # Only reachable if a masked token was drawn (e.g. every allowed logit was -inf); say so once.
                log.warning("seq %d: token %d rejected by its grammar: %s", it.seq_id, tok, m.get_error())
