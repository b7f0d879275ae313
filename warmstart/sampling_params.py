"""SamplingParams: how one request is decoded. Public API; validated on construction."""
from __future__ import annotations

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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
             f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
             f"prompt_logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message + ".")
        if self.repetition_penalty <= 0:
            raise UserError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}.")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise UserError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got "
                            f"{self.min_tokens}.")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise UserError("logit_bias values must be between -100 and 100.")

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
