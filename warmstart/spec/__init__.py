"""Speculative decoding: proposers beside the runner (a draft model, or n-gram prompt lookup), verified by the
target in one forward (runner/verify.py). The scheduler only learns that a decoding sequence may feed up to K
proposed tokens in a step (Scheduled.lookahead); the engine commits what the target accepted and trims the rest."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    """Counters since boot (the warm-up excluded)."""
    method: str = "off"
    num_speculative_tokens: int = 0
    proposals: int = 0              # proposed tokens sent to verification
    accepted: int = 0               # of those, accepted by the target
    verify_steps: int = 0           # sequence-steps that verified proposals (one target forward row group each)
    committed: int = 0              # tokens committed by those steps (accepted + the target's own token)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposals if self.proposals else 0.0

    @property
    def mean_tokens_per_forward(self) -> float:
        return self.committed / self.verify_steps if self.verify_steps else 0.0

    def to_dict(self) -> dict:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "proposals": self.proposals, "accepted_tokens": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 4), "verify_steps": self.verify_steps,
                "committed_tokens": self.committed,
                "mean_tokens_per_target_forward": round(self.mean_tokens_per_forward, 4)}
