"""Startup plans: the memory ledger of a profiled boot, saved under a key of everything it depends on, and reused
only when every component of the key matches and the device has at least the free memory the plan was made with.

A plan file is one JSON document, `<cache>/plans/<digest>.json`, that stores the key's components next to its
digest, so a miss can name the fields that differ (old -> new) and a tampered file can be detected."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmstart.config import format_bytes
from warmstart.startup.ledger import MemoryLedger

log = logging.getLogger("warmstart.plan")

PLAN_SCHEMA = 1
# Fields whose change is expected to re-profile; listed first in a miss reason because they explain most misses.
_STALE_TMP_SECONDS = 3600
MAX_PLANS = 64            # per cache root; the least recently written go first


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class PlanKey:
    """The inputs a KV allowance depends on, flattened to name -> JSON value. Built once from the user's config
    and device facts, before anything derived, and reused unchanged at save time."""
    components: dict[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(canonical(self.components).encode()).hexdigest()[:32]

    def diff(self, old: dict[str, Any]) -> list[str]:
        """'field old -> new' for every component that differs from an older key's components."""
        names = sorted(set(old) | set(self.components))
        return [f"{n} {_show(old.get(n, '<absent>'))} -> {_show(self.components.get(n, '<absent>'))}"
                for n in names if old.get(n, "<absent>") != self.components.get(n, "<absent>")]


def _checksum(doc: dict) -> str:
    return hashlib.sha256(canonical({k: v for k, v in doc.items() if k != "checksum"}).encode()).hexdigest()


def _show(v: Any) -> str:
    s = v if isinstance(v, str) else canonical(v)
    return s if len(s) <= 80 else s[:36] + "…" + s[-36:]


@dataclass(frozen=True)
class Plan:
    key: PlanKey
    ledger: MemoryLedger
    created: float
    path: Path


@dataclass(frozen=True)
class Lookup:
    """Outcome of a plan read: a usable plan, or why not (each reason one line, for the log and the report)."""
    plan: Plan | None
    reasons: tuple[str, ...]
    path: Path


class PlanStore:
    def __init__(self, root: Path, max_plans: int = MAX_PLANS):
        self.root, self.max_plans = root, max_plans

    def path_for(self, key: PlanKey) -> Path:
        return self.root / f"{key.digest}.json"

    # -- read ---------------------------------------------------------------------------------------------
    def lookup(self, key: PlanKey, free_now: int, tolerance: int) -> Lookup:
        """Never raises: an unreadable or foreign file is a miss with a reason (and a warning)."""
        path = self.path_for(key)
        try:
            plan = self._read(path)
        except FileNotFoundError:
            return Lookup(None, self._why_absent(key), path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring bad startup plan %s: %s", path, e)
            return Lookup(None, (f"plan file unreadable ({e}); re-profiling",), path)
        if plan.key.components != key.components:
            return Lookup(None, tuple(key.diff(plan.key.components)) or ("key digest collision",), path)
        need = plan.ledger.free_bytes_at_boot - tolerance
        if free_now < need:
            return Lookup(None, (f"free memory {format_bytes(free_now)} < recorded "
                                 f"{format_bytes(plan.ledger.free_bytes_at_boot)} - tolerance "
                                 f"{format_bytes(tolerance)}",), path)
        return Lookup(plan, (), path)

    def _read(self, path: Path) -> Plan:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("schema") != PLAN_SCHEMA:
            raise ValueError(f"schema {doc.get('schema') if isinstance(doc, dict) else '?'!r} is not "
                             f"{PLAN_SCHEMA}")
        key = PlanKey(doc["key"])
        if key.digest != doc["digest"] or path.stem != doc["digest"]:
            raise ValueError("digest does not match the stored key (edited or copied file)")
        if doc.get("checksum") != _checksum(doc):
            raise ValueError("checksum does not match the contents (edited file)")
        ledger = MemoryLedger.from_dict(doc["ledger"])
        if ledger.num_kv_blocks <= 0 or ledger.kv_cache_bytes != ledger.num_kv_blocks * ledger.kv_block_bytes:
            raise ValueError("ledger is inconsistent (KV bytes do not equal blocks x block bytes)")
        return Plan(key, ledger, float(doc.get("created", 0)), path)

    def _why_absent(self, key: PlanKey) -> tuple[str, ...]:
        """No plan under this digest: compare with the closest saved plan (fewest differing fields, newest on a
        tie) to say what changed."""
        best, best_n = None, None
        for doc in self._docs():
            n = len(key.diff(doc["key"]))
            if best is None or n < best_n or (n == best_n and doc.get("created", 0) > best.get("created", 0)):
                best, best_n = doc, n
        if best is None:
            return ("no saved plan yet",)
        return tuple(key.diff(best["key"]))

    def _docs(self) -> list[dict]:
        docs = []
        for p in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            try:
                doc = json.loads(p.read_text())
                if isinstance(doc, dict) and doc.get("schema") == PLAN_SCHEMA and isinstance(doc.get("key"), dict):
                    docs.append(doc)
            except (OSError, ValueError):
                continue
        return docs

    def list(self) -> list[dict]:
        return sorted(self._docs(), key=lambda d: d.get("created", 0))

    # -- write --------------------------------------------------------------------------------------------
    def save(self, key: PlanKey, ledger: MemoryLedger) -> Path:
        """Atomic and durable: temp file in the same folder, fsync, rename over, fsync the folder. Concurrent
        writers each rename a complete file; the last one wins and no reader ever sees a partial file."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_tmp()
        path = self.path_for(key)
        doc = {"schema": PLAN_SCHEMA, "digest": key.digest, "key": key.components, "ledger": ledger.to_dict(),
               "created": time.time()}
        doc["checksum"] = _checksum(doc)
        fd, tmp = tempfile.mkstemp(prefix=f".{key.digest}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dfd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._prune(keep=path)
        return path

    def _prune(self, keep: Path) -> None:
        """Bounded retention: beyond max_plans, delete the least recently written (never the one just saved)."""
        try:
            plans = sorted(self.root.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        except OSError:
            return
        for p in plans[self.max_plans:]:
            if p != keep:
                p.unlink(missing_ok=True)

    def remove(self, digest: str | None = None) -> int:
        """Delete one plan (by digest or digest prefix) or, with None, all of them. Returns how many."""
        n = 0
        for p in self.root.glob("*.json") if self.root.is_dir() else []:
            if digest is None or p.stem.startswith(digest):
                p.unlink(missing_ok=True)
                n += 1
        return n

    def _sweep_tmp(self) -> None:
        for p in self.root.glob(".*.tmp"):
            try:
                if time.time() - p.stat().st_mtime > _STALE_TMP_SECONDS:
                    p.unlink()
            except OSError:
                pass
