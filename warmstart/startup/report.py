"""The startup report: what a boot did, in the schema the CLI's --report and the server's /startup route share.
Keys may be added, never renamed."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from warmstart.startup.ledger import MemoryLedger


@dataclass(frozen=True)
class PlanOutcome:
    status: str                       # "off" | "miss" | "hit" | "bypassed"
    saved: bool = False
    reasons: tuple[str, ...] = ()
    path: str | None = None

    def to_dict(self) -> dict:
        return {"status": self.status, "saved": self.saved, "reasons": list(self.reasons), "path": self.path}


@dataclass(frozen=True)
class WeightsOutcome:
    source: str                       # "disk" | "daemon-zero-copy" | "daemon-copy"
    fallback_reason: str | None = None
    charges: tuple[dict, ...] = ()    # {"socket", "role", "bytes"}

    def to_dict(self) -> dict:
        return {"source": self.source, "fallback_reason": self.fallback_reason, "charges": list(self.charges)}


@dataclass(frozen=True)
class StartupReport:
    wall_seconds: float
    steps: list[dict]
    plan: PlanOutcome
    memory: MemoryLedger
    weights: WeightsOutcome
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"wall_seconds": round(self.wall_seconds, 6), "steps": self.steps, "plan": self.plan.to_dict(),
                "memory": self.memory.to_dict(), "weights": self.weights.to_dict(), **self.extra}

    def write(self, path: Path, outputs: list[dict] | None = None) -> None:
        d = self.to_dict()
        if outputs is not None:
            d["outputs"] = outputs
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(d, indent=2) + "\n")
