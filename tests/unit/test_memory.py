"""Ledger arithmetic, the CPU peak tracker, and plan keys — no boot needed."""
import torch

from warmstart.startup.device import CpuDevice
from warmstart.startup.ledger import MemoryLedger
from warmstart.startup.plan import PlanKey

MiB = 2**20


def size(**kw):
    base = dict(budget=1000 * MiB, weights=300 * MiB, external=0, activation=100 * MiB, overhead=256 * MiB,
                kv_block_bytes=3 * MiB, block_size=16, device="cpu", total=4000 * MiB, free=3000 * MiB)
    return MemoryLedger.size(**{**base, **kw})


def test_ledger_adds_up_and_headroom_is_below_one_block():
    led = size()
    assert led.num_kv_blocks == (1000 - 300 - 100 - 256) // 3
    assert led.budget_bytes == led.non_kv_bytes + led.kv_cache_bytes + led.headroom_bytes
    assert 0 <= led.headroom_bytes < led.kv_block_bytes
    assert led.token_capacity == led.num_kv_blocks * 16


def test_weights_owned_or_external_give_the_same_kv():
    assert size(weights=300 * MiB).num_kv_blocks == size(weights=0, external=300 * MiB).num_kv_blocks
    # Counting the same weights twice (the fallback bug) costs exactly their size in KV.
    double = size(weights=300 * MiB, external=300 * MiB)
    assert size().kv_cache_bytes - double.kv_cache_bytes >= 300 * MiB - 3 * MiB


def test_explicit_kv_budget_wins_and_sets_the_budget():
    led = size(explicit_kv=30 * MiB)
    assert led.kv_cache_bytes == 30 * MiB and led.num_kv_blocks == 10
    assert led.budget_bytes == led.non_kv_bytes + 30 * MiB


def test_ledger_round_trips_through_dict():
    led = size()
    assert MemoryLedger.from_dict(led.to_dict()) == led


def test_cpu_peak_tracker_counts_live_tensors():
    with CpuDevice().track_peak() as peak:
        a = torch.empty(1000, 1000)          # 4 MB
        b = a @ a                             # +4 MB
        c = b.relu()                          # +4 MB: peak 12 MB
        del a, b
        d = c * 2                             # 4 + 4 MB live
        c.add_(1)                             # in place: nothing new
        v = d.view(-1)                        # a view: nothing new
    assert peak["peak_bytes"] == 12_000_000
    assert v.numel() == 10**6


def test_plan_key_digest_and_diff():
    a = PlanKey({"memory_utilization": 0.3, "block_size": 16})
    b = PlanKey({"memory_utilization": 0.12, "block_size": 16})
    assert a.digest != b.digest and len(a.digest) == 32
    assert PlanKey(dict(reversed(list(a.components.items())))).digest == a.digest   # order-independent
    assert b.diff(a.components) == ["memory_utilization 0.3 -> 0.12"]


def test_plan_store_keeps_a_bounded_number_of_plans(tmp_path):
    from warmstart.startup.plan import PlanStore
    store = PlanStore(tmp_path, max_plans=5)
    led = MemoryLedger.size(budget=1000 * MiB, weights=0, external=0, activation=0, overhead=0,
                            kv_block_bytes=MiB, block_size=16, device="cpu", total=2000 * MiB, free=1000 * MiB)
    keys = [PlanKey({"i": i}) for i in range(8)]
    for k in keys:
        store.save(k, led)
    left = {p.stem for p in tmp_path.glob("*.json")}
    assert left == {k.digest for k in keys[3:]}          # the five most recently written
    assert store.lookup(keys[-1], free_now=1000 * MiB, tolerance=0).plan is not None
