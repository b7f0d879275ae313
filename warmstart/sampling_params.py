"""SamplingParams: how one request is decoded. Public API; validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from warmstart.errors import UserError

if TYPE_CHECKING:
    from warmstart.runner.grammar import Grammar


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 and top_p 1 and min_p 0 disable those filters.
    logprobs=N returns the sampled token's logprob plus the top N alternatives (N may be 0);
    prompt_logprobs=N does the same for every prompt token after the first.

    Penalties follow vLLM's (and OpenAI's) definitions: presence_penalty subtracts once from the logit of every
    token already generated, frequency_penalty subtracts once per occurrence, repetition_penalty divides positive
    and multiplies negative logits of every token in the prompt or the output (1 disables it). logit_bias adds to
    the logits of the given token ids. min_tokens bans EOS and stop_token_ids (and ignores stop strings) until that
    many tokens exist. grammar constrains the output to a compiled grammar (structured outputs)."""

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    grammar: Grammar | None = None
    # EOS ids plus stop_token_ids, filled in by the engine when min_tokens needs them (it knows the EOS ids).
    min_tokens_banned: tuple[int, ...] = ()

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
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
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
        extra = [
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a finite number > 0 (1 disables it), got {self.repetition_penalty}"),
            ("presence_penalty", math.isfinite(self.presence_penalty) and abs(self.presence_penalty) <= 2,
             f"presence_penalty must be between -2 and 2, got {self.presence_penalty}"),
            ("frequency_penalty", math.isfinite(self.frequency_penalty) and abs(self.frequency_penalty) <= 2,
             f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty}"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"),
            ("logit_bias", all(0 <= t < 2**31 and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias keys must be token ids and values between -100 and 100"),
        ]
        for name, ok, message in extra:
            if not ok:
                raise UserError(message + ".", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor applies, so that plain requests skip them entirely."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None
