"""SamplingParams: how one request is decoded. Public API; validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from warmstart.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 and top_p 1 and min_p 0 disable those filters.
    logprobs=N returns the sampled token's logprob plus the top N alternatives (N may be 0);
    prompt_logprobs=N does the same for every prompt token after the first."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    MAX_LOGPROBS = 20
    # What the engine can represent: top_k and token ids become int64 tensors, a seed seeds a torch.Generator
    # (which takes -2**63 .. 2**64-1). A value outside these would overflow on the engine thread, mid-batch.
    MAX_TOP_K = 2**31 - 1
    MAX_TOKENS = 2**31 - 1
    SEED_RANGE = (-2**63, 2**64 - 1)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        lo, hi = self.SEED_RANGE
        checks = [
            ("max_tokens", 1 <= self.max_tokens <= self.MAX_TOKENS,
             f"max_tokens must be between 1 and {self.MAX_TOKENS}, got {self.max_tokens}"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature}"),
            ("top_k", 0 <= self.top_k <= self.MAX_TOP_K,
             f"top_k must be between 0 (disabled) and {self.MAX_TOP_K}, got {self.top_k}"),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            ("seed", self.seed is None or lo <= self.seed <= hi,
             f"seed must be between {lo} and {hi}, got {self.seed}"),
            ("stop", all(s for s in self.stop), "stop strings must not be empty"),
            ("stop_token_ids", all(0 <= t < 2**63 for t in self.stop_token_ids),
             "stop_token_ids must be token ids between 0 and 2**63-1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
             f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
             f"prompt_logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.prompt_logprobs}"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise UserError(message + ".", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
