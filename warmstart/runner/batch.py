"""The typed boundary between the engine (pure Python) and the runner (torch). No torch in this module."""
from __future__ import annotations

from dataclasses import dataclass, field

from warmstart.sampling_params import SamplingParams


@dataclass(frozen=True)
class BatchItem:
    """One sequence's slice of a step: feed token_ids at positions start..start+len-1 into its blocks."""
    seq_id: int
    token_ids: list[int]
    start: int                     # number of tokens already in the KV cache (= position of token_ids[0])
    block_table: list[int]
    sample: bool                   # the slice ends the sequence's known tokens, so a next token is sampled
    params: SamplingParams
    prompt_len: int                # for prompt logprobs: positions below prompt_len are prompt tokens
    next_prompt_token: int | None = None   # the prompt token after this slice, for prompt logprobs of its last row
    # The sequence's tokens so far (prompt, then output), for logits processors (penalties, min_tokens); only set
    # when params.processes_logits. It is the sequence's own list, read during execute, not a copy.
    history: list[int] | None = None
    # Speculative decoding: token_ids = [last token, *draft_token_ids]. The runner computes logits at every fed
    # row and verifies the drafts (runner/verify.py); the result carries 1..len(drafts)+1 tokens.
    draft_token_ids: tuple[int, ...] = ()
    draft_probs: object = None     # torch [K, V] float32: the draft's (processed) distributions; None: point mass


@dataclass(frozen=True)
class Batch:
    items: list[BatchItem]
    finished_seq_ids: list[int] = field(default_factory=list)   # per-request runner state to drop

    @property
    def num_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.items)


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float                              # of the chosen/actual token
    top: list[tuple[int, float]]                # the top N (token id, logprob), best first


@dataclass(frozen=True)
class ItemResult:
    token_id: int | None                        # None when the item did not sample (a mid-prompt chunk)
    logprobs: TokenLogprobs | None = None
    # For prompt_logprobs: one entry per fed token whose successor is a prompt token (the successor's logprob).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Set when preparing or sampling this item raised: this request fails alone, the rest of the batch goes on.
    error: str | None = None
    # Speculative decoding: every token this item committed (accepted drafts, then the target's own token), with
    # their logprobs. None for a plain item (token_id alone).
    token_ids: list[int] | None = None
    token_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        if self.token_ids is not None:
            return self.token_ids
        return [] if self.token_id is None else [self.token_id]
