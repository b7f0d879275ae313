"""Issue 9 item 7: the free-memory gate. CUDA keeps the seeds' rule (free now >= recorded - tolerance); CPU asks
whether what the plan still allocates fits in free memory with a margin, whatever free memory was recorded."""
from warmstart.startup.ledger import MemoryLedger
from warmstart.startup.plan import CPU_FIT_MARGIN, FreeGate, PlanKey, PlanStore

MiB, GiB = 2**20, 2**30
LED = MemoryLedger.size(budget=4 * GiB, weights=GiB, external=0, activation=256 * MiB, overhead=512 * MiB,
                        kv_block_bytes=MiB, block_size=16, device="x", total=16 * GiB, free=12 * GiB)
NEED = LED.weights_bytes + LED.activation_peak_bytes + LED.kv_cache_bytes       # what a boot still allocates


def test_cpu_gate_hits_while_free_memory_is_far_below_the_recorded_value_if_the_plan_fits():
    assert LED.free_bytes_at_boot - (NEED + CPU_FIT_MARGIN) > 5 * GiB           # the seeds' rule would miss
    assert FreeGate("cpu", NEED + CPU_FIT_MARGIN, 0).check(LED) is None
    assert FreeGate("cuda", NEED + CPU_FIT_MARGIN, 0).check(LED) is not None


def test_cpu_gate_refuses_a_plan_that_does_not_fit_and_says_why():
    reason = FreeGate("cpu", NEED + CPU_FIT_MARGIN - 1, 0).check(LED)
    assert reason and "what the plan still allocates" in reason and "margin" in reason


def test_cuda_gate_keeps_the_seeds_rule():
    assert FreeGate("cuda", 12 * GiB, 0).check(LED) is None
    assert "< recorded" in FreeGate("cuda", 12 * GiB - 1, 0).check(LED)
    assert FreeGate("cuda", 11 * GiB, GiB).check(LED) is None


def test_lookup_marks_an_unfit_cpu_plan(tmp_path):
    store, key = PlanStore(tmp_path), PlanKey({"a": 1})
    store.save(key, LED)
    assert store.lookup(key, NEED + CPU_FIT_MARGIN, 0, "cpu").plan is not None
    miss = store.lookup(key, NEED, 0, "cpu")
    assert miss.plan is None and miss.unfit
    cuda_miss = store.lookup(key, GiB, 0, "cuda")
    assert cuda_miss.plan is None and not cuda_miss.unfit
