"""A request as the engine sees it: its tokens, how many are in the KV cache, and its blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from warmstart.runner.batch import TokenLogprobs
from warmstart.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)     # prompt + output; the KV cache holds a prefix of it
    num_computed_tokens: int = 0                           # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None                       # "stop" | "length" | "abort"
    output_text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_preemptions: int = 0
    # prefix cache
    cache_extra: bytes = b""                               # what else shapes K/V (LoRA id, image hashes): keys it
    num_cached_tokens: int = 0                             # prompt tokens found in the cache at first admission
    block_keys: list[bytes] = field(default_factory=list)  # chained keys of leading full blocks of token_ids
    num_committed_blocks: int = 0                          # leading blocks of block_table registered or skipped

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
