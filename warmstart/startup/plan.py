"""Startup plans: the memory ledger of a profiled boot, saved under a key of everything it depends on, and reused
only when every component of the key matches and the device has at least the free memory the plan was made with.

A plan file is one JSON document, `<cache>/plans/<digest>.json`, that stores the key's components next to its
digest, so a miss can name the fields that differ (old -> new) and an accidentally edited file is detected.

Plan files are untrusted input. The checksum is not a trust boundary: anyone who can write the file can recompute
it. What protects a boot is that (1) every file is opened without blocking and without following a symlink, must
be a small regular file, and is validated field by field before use (anything else is skipped with a warning), and
(2) the planner re-derives the budget from the current key on every hit and refuses a ledger that disagrees
(planning.py), so a plan can never size the KV cache beyond what this configuration allows."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmstart.config import format_bytes
from warmstart.paths import atomic_write_text
from warmstart.startup.ledger import MemoryLedger

log = logging.getLogger("warmstart.plan")

# 2: kv_cache_dtype auto became float16 for float32 models on CPU; 3: dtype auto became float32 for quantized linears
# on warmstart's kernels and is measured on AMX CPUs too (the key holds the requested dtype, not the resolved one)
PLAN_SCHEMA = 3
# Fields whose change is expected to re-profile; listed first in a miss reason because they explain most misses.
_STALE_TMP_SECONDS = 3600
MAX_PLANS = 64            # per cache root; the least recently written go first
MAX_PLAN_BYTES = 1 << 20  # a real plan is ~2 KiB; anything larger is not one of ours
# CPU gate: the plan's remaining allocation must leave this much free memory (see FreeGate).
CPU_FIT_MARGIN = 256 * 2**20


class BadPlanFile(ValueError):
    """A file in plans/ that is not a usable plan, for whatever reason; callers skip it with a warning."""


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
    """Outcome of a plan read: a usable plan, or why not (each reason one line, for the log and the report).
    `unfit`: the plan matches but its remaining allocation does not fit in free memory (CPU gate); re-profiling
    would only reproduce it, so the boot fails instead."""
    plan: Plan | None
    reasons: tuple[str, ...]
    path: Path
    unfit: bool = False


@dataclass(frozen=True)
class FreeGate:
    """The free-memory rule a matching plan must pass, measured before the weights arrived.

    CUDA (the seeds' rule): free memory now >= the free memory the plan was made with - tolerance. The budget is
    a fraction of the device and other processes' memory is the risk, so less free memory than recorded misses.
    CPU: host free memory moves by gigabytes as neighbours come and go, and the budget does not depend on it, so
    a re-profile would produce the very same ledger. What matters is whether what the plan still has to allocate
    (weights, the activation peak, the whole KV cache) fits in free memory with CPU_FIT_MARGIN to spare."""
    kind: str
    free_now: int
    tolerance: int

    def check(self, led: MemoryLedger) -> str | None:
        if self.kind == "cpu":
            need = led.weights_bytes + led.activation_peak_bytes + led.kv_cache_bytes + CPU_FIT_MARGIN
            if self.free_now < need:
                return (f"free memory {format_bytes(self.free_now)} < what the plan still allocates "
                        f"{format_bytes(need - CPU_FIT_MARGIN)} (weights, activations, KV) + margin "
                        f"{format_bytes(CPU_FIT_MARGIN)}")
            return None
        if self.free_now < led.free_bytes_at_boot - self.tolerance:
            return (f"free memory {format_bytes(self.free_now)} < recorded {format_bytes(led.free_bytes_at_boot)}"
                    f" - tolerance {format_bytes(self.tolerance)}")
        return None


_LEDGER_INTS = tuple(k for k in MemoryLedger.__dataclass_fields__ if k != "device")


def read_plan_file(path: Path) -> dict:
    """One plan file, validated; BadPlanFile for anything else. Opened with O_NONBLOCK (a FIFO must not hang the
    boot) and O_NOFOLLOW (a symlink must not lead out of the cache), and only a small regular file is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise BadPlanFile(f"cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadPlanFile("not a regular file")
        if st.st_size > MAX_PLAN_BYTES:
            raise BadPlanFile(f"{st.st_size} bytes is too large for a plan")
        raw = os.read(fd, MAX_PLAN_BYTES + 1)
    except OSError as e:
        raise BadPlanFile(f"cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
    try:
        return _validated(json.loads(raw), path)
    except BadPlanFile:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        raise BadPlanFile(f"{type(e).__name__}: {str(e)[:200]}") from None


def _validated(doc: Any, path: Path) -> dict:
    if not isinstance(doc, dict):
        raise BadPlanFile(f"a JSON {type(doc).__name__}, not an object")
    if doc.get("schema") != PLAN_SCHEMA:
        raise BadPlanFile(f"schema {str(doc.get('schema'))[:20]!r} is not {PLAN_SCHEMA}")
    key, ledger, created = doc.get("key"), doc.get("ledger"), doc.get("created", 0)
    if not isinstance(key, dict) or not isinstance(ledger, dict) or not isinstance(doc.get("digest"), str):
        raise BadPlanFile("key, ledger or digest has the wrong type")
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise BadPlanFile("created is not a number")
    for name in _LEDGER_INTS:
        v = ledger.get(name)
        if type(v) is not int or not 0 <= v < 2**62:
            raise BadPlanFile(f"ledger.{name} is {str(v)[:40]!r}, not a byte or block count")
    if not isinstance(ledger.get("device"), str):
        raise BadPlanFile("ledger.device is not a string")
    if PlanKey(key).digest != doc["digest"] or path.stem != doc["digest"]:
        raise BadPlanFile("digest does not match the stored key (edited or copied file)")
    if doc.get("checksum") != _checksum(doc):
        raise BadPlanFile("checksum does not match the contents (edited file)")
    return doc


_DIGEST = re.compile(r"[0-9a-f]{1,32}")


class PlanStore:
    def __init__(self, root: Path, max_plans: int = MAX_PLANS):
        self.root, self.max_plans = root, max_plans

    def path_for(self, key: PlanKey) -> Path:
        return self.root / f"{key.digest}.json"

    # -- read ---------------------------------------------------------------------------------------------
    def lookup(self, key: PlanKey, free_now: int, tolerance: int, kind: str = "cuda") -> Lookup:
        """Never raises: an unreadable or foreign file is a miss with a reason (and a warning)."""
        path = self.path_for(key)
        try:
            plan = self._read(path)
        except FileNotFoundError:
            return Lookup(None, self._why_absent(key), path)
        except BadPlanFile as e:
            log.warning("ignoring bad startup plan %s: %s", path, e)
            return Lookup(None, (f"plan file unreadable ({e}); re-profiling",), path)
        if plan.key.components != key.components:
            return Lookup(None, tuple(key.diff(plan.key.components)) or ("key digest collision",), path)
        reason = FreeGate(kind, free_now, tolerance).check(plan.ledger)
        if reason:
            return Lookup(None, (reason,), path, unfit=kind == "cpu")
        return Lookup(plan, (), path)

    def _read(self, path: Path) -> Plan:
        doc = read_plan_file(path)
        ledger = MemoryLedger.from_dict(doc["ledger"])
        if ledger.num_kv_blocks <= 0 or ledger.kv_cache_bytes != ledger.num_kv_blocks * ledger.kv_block_bytes:
            raise BadPlanFile("ledger is inconsistent (KV bytes do not equal blocks x block bytes)")
        return Plan(PlanKey(doc["key"]), ledger, float(doc.get("created", 0)), path)

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

    def files(self) -> list[Path]:
        try:
            return sorted(self.root.glob("*.json")) if self.root.is_dir() else []
        except OSError:
            return []

    def _docs(self) -> list[dict]:
        docs = []
        for p in self.files():
            try:
                docs.append(read_plan_file(p))
            except FileNotFoundError:
                continue
            except BadPlanFile as e:
                log.warning("skipping %s: %s", p, e)
        return docs

    def list(self) -> list[dict]:
        return sorted(self._docs(), key=lambda d: d.get("created", 0))

    def find(self, prefix: str) -> list[Path]:
        """Plan files whose digest starts with prefix (hex only: a prefix is never a path or a glob)."""
        if not _DIGEST.fullmatch(prefix):
            return []
        return [p for p in self.files() if p.stem.startswith(prefix)]

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
        atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
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
        for p in self.files():
            if digest is None or p.stem.startswith(digest):
                try:
                    p.unlink(missing_ok=True)       # never follows a symlink: removes the link itself
                    n += 1
                except OSError as e:
                    log.warning("could not remove %s: %s", p, e)
        return n

    def _sweep_tmp(self) -> None:
        for p in self.root.glob(".*.tmp"):
            try:
                if time.time() - p.stat().st_mtime > _STALE_TMP_SECONDS:
                    p.unlink()
            except OSError:
                pass
