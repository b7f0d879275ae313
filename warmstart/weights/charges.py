"""External weight charges: bytes held by another process (a weight daemon) on this engine's behalf.

Recorded per (daemon socket, role), from the exact bytes the daemon reports — never inferred from "memory in use
at startup". One charge per distinct daemon even when two roles resolve to the same socket. A disk fallback removes
exactly its source's charge, once."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExternalCharges:
    _by_source: dict[tuple[str, str], int] = field(default_factory=dict)

    def charge(self, socket: str, role: str, nbytes: int) -> bool:
        """Record a daemon's bytes. Returns False (and records nothing) if this socket is already charged,
        under any role: the daemon's memory exists once however many roles map to it."""
        # Type first: comparing a str or None with 0 would raise TypeError instead of this ValueError.
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"charge must be a non-negative int, got {nbytes!r}")
        if any(s == socket for s, _ in self._by_source):
            return False
        self._by_source[(socket, role)] = nbytes
        return True

    def remove(self, socket: str, role: str) -> int:
        """Drop the charge of one source (after its disk fallback succeeded). Returns the bytes removed; a second
        removal of the same source removes nothing."""
        return self._by_source.pop((socket, role), 0)

    @property
    def total_bytes(self) -> int:
        return sum(self._by_source.values())

    def entries(self) -> list[dict]:
        return [{"socket": s, "role": r, "bytes": b} for (s, r), b in sorted(self._by_source.items())]
