"""Memory planning for one boot: reuse a startup plan, or profile and (maybe) save one.

Modes (--startup-plan): auto = read + write; read; write (always profile, then save); require (a miss is an error);
off. An explicit --kv-cache-memory bypasses plans entirely: nothing is read and nothing is written."""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field

import torch

from warmstart.config import EngineConfig, format_bytes
from warmstart.errors import UserError
from warmstart.runner.runner import ModelRunner
from warmstart.startup.device import Device, DeviceFacts
from warmstart.startup.ledger import OVERHEAD_QUANTUM, MemoryLedger, round_up
from warmstart.startup.plan import PlanKey, PlanStore
from warmstart.startup.residency import unresident_weight_bytes
from warmstart.startup.report import PlanOutcome

log = logging.getLogger("warmstart.plan")

# A hit boot's measured resident memory may differ from the ledger's prediction by this much before the plan is
# considered stale: malloc arenas and page-cache residency move by tens of MiB between identical boots.
DRIFT_MARGIN = 256 * 2**20
DRIFT_FRACTION = 0.10


@dataclass
class MemoryPlanner:
    config: EngineConfig
    device: Device
    facts: DeviceFacts
    key: PlanKey
    store: PlanStore
    free_at_boot: int
    status: str = "off"
    reasons: list[str] = field(default_factory=list)
    saved: bool = False
    external: int = 0
    boot_overhead: int = 0          # the runtime overhead this boot measured (CPU: RSS before the weights)

    @property
    def effective_free(self) -> int:
        return self.free_at_boot + self.external

    @property
    def reads(self) -> bool:
        return self.config.kv_cache_memory is None and self.config.startup_plan in ("auto", "read", "require")

    @property
    def writes(self) -> bool:
        return self.config.kv_cache_memory is None and self.config.startup_plan in ("auto", "write")

    @property
    def tolerance(self) -> int:
        t = self.config.plan_free_tolerance
        return self.device.default_plan_tolerance if t is None else t

    def plan(self, runner: ModelRunner, weights: int, external: int, overhead: int, max_model_len: int) -> MemoryLedger:
        """The ledger for this boot: from a matching plan (no profiling forward) or from measurement.

        Free memory is compared as 'free + bytes a daemon holds for us': a daemon's resident weights lower the
        device's free memory by exactly what this boot then does not need to load, so an attached boot and a disk
        boot of the same configuration see the same number and reach the same plan decision."""
        self.external = external
        self.boot_overhead = overhead
        if self.config.kv_cache_memory is not None:
            self.status = "bypassed"
            kv, total = self.config.kv_cache_memory, self.facts.total_bytes
            if kv + weights + external > total:
                raise UserError(f"--kv-cache-memory {format_bytes(kv)} plus the weights "
                                f"({format_bytes(weights + external)}) exceeds all of this device's memory "
                                f"({format_bytes(total)} on "
                                f"{self.facts.kind}). Lower --kv-cache-memory, or leave it out to size the KV cache "
                                "from --memory-utilization.")
        elif self.reads:
            ledger = self._try_hit(runner, weights, external, overhead if self.device.kind == "cpu" else 0)
            if ledger is not None:
                return ledger
        elif self.writes:
            self.status = "miss"
            self.reasons.append(f"--startup-plan {self.config.startup_plan}: plans are not read")
        return self._profile(runner, weights, external, overhead, max_model_len)

    # Speculative decoding with a draft model: its KV cache mirrors the target's block tables, so one block costs
    # both models' bytes (set by the boot before planning).
    extra_kv_block_bytes: int = 0

    def _kv_block_bytes(self, runner: ModelRunner) -> int:
        return runner.kv_block_bytes(self.config.block_size) + self.extra_kv_block_bytes

    @property
    def budget(self) -> int:
        """The budget this configuration allows, derived from the key's inputs (never read from a plan)."""
        return int(self.config.utilization * self.facts.total_bytes)

    def hit_problem(self, old: MemoryLedger, runner: ModelRunner | None, overhead: int = 0) -> str | None:
        """Why a plan whose key matches still must not be used, or None. A plan file is untrusted input: its
        budget and the categories that follow from this configuration are re-derived here on every hit, so an
        edited (or re-checksummed) file can never size the KV cache beyond what the key allows."""
        if old.budget_bytes != self.budget:
            return (f"stored budget {old.budget_bytes} != memory utilization {self.config.utilization} x device "
                    f"total {self.facts.total_bytes} = {self.budget}")
        if old.total_bytes != self.facts.total_bytes or old.block_size != self.config.block_size:
            return (f"stored device total / block size {old.total_bytes} / {old.block_size} != "
                    f"{self.facts.total_bytes} / {self.config.block_size}")
        if runner is not None and old.kv_block_bytes != self._kv_block_bytes(runner):
            return f"stored KV block bytes {old.kv_block_bytes} != {self._kv_block_bytes(runner)}"
        if old.runtime_overhead_bytes < overhead:
            return (f"stored runtime overhead {old.runtime_overhead_bytes} < {overhead} measured by this boot")
        return None

    def _try_hit(self, runner: ModelRunner, weights: int, external: int, overhead: int) -> MemoryLedger | None:
        found = self.store.lookup(self.key, self.effective_free, self.tolerance, self.device.kind)
        self.status = "miss"
        if found.unfit:
            # CPU: the budget does not depend on free memory, so re-profiling would reproduce this very plan.
            raise UserError(f"This configuration's startup plan does not fit in free memory now: "
                            f"{found.reasons[0]}. Free memory, or lower --memory-utilization (or pass an explicit "
                            "--kv-cache-memory).")
        problem = self.hit_problem(found.plan.ledger, runner, overhead) if found.plan is not None else None
        if problem:
            log.warning("startup plan %s disagrees with this configuration: %s", found.path.name, problem)
            self.reasons.append(problem)
        elif found.plan is not None:
            old = found.plan.ledger
            ledger = self._size(runner, weights, external, old.activation_peak_bytes, old.runtime_overhead_bytes)
            if weights + external != old.weights_bytes + old.external_weights_bytes:
                self.reasons.append(f"weight bytes {old.weights_bytes + old.external_weights_bytes} -> "
                                    f"{weights + external}")
            elif ledger.num_kv_blocks != old.num_kv_blocks:
                self.reasons.append(f"num_kv_blocks {old.num_kv_blocks} -> {ledger.num_kv_blocks}")
            else:
                self.status = "hit"
                log.info("startup plan hit: %s (%d KV blocks, profiling skipped)", found.path, ledger.num_kv_blocks)
                return ledger
        else:
            self.reasons.extend(found.reasons)
        log.info("startup plan miss (%s): %s", found.path.name, "; ".join(self.reasons))
        if self.config.startup_plan == "require":
            raise UserError(f"--startup-plan require: no usable plan for this configuration "
                            f"({'; '.join(self.reasons)}). Boot once with --startup-plan auto or write to make "
                            "one, or drop require.")
        return None

    def _profile(self, runner, weights, external, overhead, max_model_len) -> MemoryLedger:
        activation = measure_activation_peak(runner, self.device, self.config, max_model_len)
        if self.device.kind == "cuda":
            overhead = cuda_overhead(self.device, self.facts, self.free_at_boot)
        return self._size(runner, weights, external, activation, overhead)

    def _size(self, runner, weights, external, activation, overhead, budget=None) -> MemoryLedger:
        return MemoryLedger.size(
            budget=budget if budget is not None else int(self.config.utilization * self.facts.total_bytes),
            weights=weights, external=external, activation=activation, overhead=overhead,
            kv_block_bytes=self._kv_block_bytes(runner), block_size=self.config.block_size,
            device=f"{self.facts.kind}:{self.facts.name}", total=self.facts.total_bytes, free=self.effective_free,
            explicit_kv=self.config.kv_cache_memory)

    def finish(self, runner: ModelRunner, ledger: MemoryLedger, max_model_len: int,
               resident: "ResidentCheck") -> PlanOutcome:
        """After KV allocation and warm-up: verify a hit against the measured resident memory (replacing a stale
        plan), or save a profiled boot's ledger. Plan I/O never fails a boot."""
        path = self.store.path_for(self.key)
        if self.status == "hit":
            drift = None if resident.ok else resident.describe()
            if drift and self.writes:
                self.reasons.append(f"ledger drift: {drift}; plan re-measured and replaced")
                log.warning("startup plan %s no longer matches this process: %s; re-measuring", path.name, drift)
                fresh = self._remeasure(runner, ledger, max_model_len)
                self._save(fresh)
            elif drift:
                self.reasons.append(f"ledger drift: {drift}")
                log.warning("startup plan %s no longer matches this process: %s", path.name, drift)
        elif self.writes:                  # a miss (auto) or write mode
            self._save(ledger)
        return PlanOutcome(self.status, self.saved, tuple(self.reasons),
                           str(path) if self.status != "bypassed" and self.config.startup_plan != "off" else None)

    def _save(self, ledger: MemoryLedger) -> None:
        try:
            path = self.store.save(self.key, ledger)
            self.saved = True
            log.info("startup plan saved: %s", path)
        except OSError as e:
            log.warning("could not save startup plan under %s: %s", self.store.root, e)

    def _remeasure(self, runner: ModelRunner, ledger: MemoryLedger, max_model_len: int) -> MemoryLedger:
        measured, expected = resident_bytes(self.device, ledger)
        activation = measure_activation_peak(runner, self.device, self.config, max_model_len)
        # expected - overhead = the weight (and, on CUDA, KV) bytes that are resident now, counted the same way
        # as measured; the rest of measured is runtime overhead. Never below what this boot measured before its
        # weights arrived: resident memory only grows from there, so a lower figure is a measurement artefact
        # (untouched weight pages, a reclaimed page cache) and would hand the KV cache bytes that are in use.
        counted = expected - ledger.runtime_overhead_bytes if self.device.kind == "cpu" else expected
        overhead = round_up(max(self.boot_overhead, measured - counted), OVERHEAD_QUANTUM)
        return self._size(runner, ledger.weights_bytes, ledger.external_weights_bytes, activation, overhead)


@dataclass(frozen=True)
class ResidentCheck:
    """The ledger against the process: what is resident after warm-up vs what the ledger says should be.
    It may exceed the expectation by the activation peak (allocator caches keep freed activations)."""
    measured_bytes: int
    expected_bytes: int
    margin_bytes: int
    activation_bytes: int

    @classmethod
    def measure(cls, device: Device, ledger: MemoryLedger) -> "ResidentCheck":
        measured, expected = resident_bytes(device, ledger)
        return cls(measured, expected, max(DRIFT_MARGIN, int(DRIFT_FRACTION * expected)),
                   ledger.activation_peak_bytes)

    @property
    def ok(self) -> bool:
        return self.expected_bytes - self.margin_bytes <= self.measured_bytes <= \
            self.expected_bytes + self.activation_bytes + self.margin_bytes

    def describe(self) -> str:
        return (f"resident {format_bytes(self.measured_bytes)} vs ledger {format_bytes(self.expected_bytes)} "
                f"(margin {format_bytes(self.margin_bytes)})")

    def to_dict(self) -> dict:
        return {"measured_bytes": self.measured_bytes, "expected_bytes": self.expected_bytes,
                "margin_bytes": self.margin_bytes, "ok": self.ok}


def resident_bytes(device: Device, ledger: MemoryLedger) -> tuple[int, int]:
    """(measured, expected) bytes resident in this process after warm-up. CPU: RSS, expected to hold the runtime
    overhead and the weight pages that are resident (daemon pages are mapped here too) but not the lazily
    zeroed KV. CUDA: the caching allocator's reservation, expected to hold weights and the whole KV."""
    if device.kind == "cpu":
        # Like with like: RSS holds only the touched pages of mmap'd weights (an untied embedding: the rows of
        # seen tokens), so the expectation leaves out the mapped-but-untouched weight pages too.
        weights = ledger.weights_bytes + ledger.external_weights_bytes
        return device.process_bytes(), (ledger.runtime_overhead_bytes +
                                         max(0, weights - unresident_weight_bytes()))
    return device.process_bytes(), ledger.weights_bytes + ledger.kv_cache_bytes


def measure_activation_peak(runner: ModelRunner, device: Device, config: EngineConfig, max_model_len: int) -> int:
    """Peak bytes a worst-case step allocates above the weights: one forward of max_num_batched_tokens."""
    gc.collect()
    with device.track_peak() as peak:
        # Speculative decoding verifies K+1 rows per sequence: logits for B x (K+1) rows.
        runner.profile_forward(config.max_num_batched_tokens, max_model_len,
                               config.max_num_seqs * (config.num_speculative_tokens + 1))
    gc.collect()
    return int(peak["peak_bytes"])


def cuda_overhead(device: Device, facts: DeviceFacts, free_at_boot: int) -> int:
    """Non-torch GPU memory this boot added (CUDA context, library workspaces), from cudaMemGetInfo."""
    used_since_boot = free_at_boot - device.free_bytes()
    return round_up(max(0, used_since_boot - torch.cuda.memory_reserved(facts.index)), OVERHEAD_QUANTUM)
