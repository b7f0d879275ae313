"""External weight charges (SEEDS.md §2): recorded per (socket, role), one per distinct daemon, removed exactly once,
and — through MemoryLedger.size — the same KV cache whichever way the weights arrived."""
from __future__ import annotations

import pytest

from warmstart.startup.ledger import MemoryLedger
from warmstart.weights.charges import ExternalCharges

W_TARGET = 1_234_567_936          # bytes of post-processed target weights
W_DRAFT = 98_765_312
SOCK_T = "/run/user/1000/warmstart/cpu-target.sock"
SOCK_D = "/run/user/1000/warmstart/cpu-draft.sock"


def kv(weights: int, external: int) -> tuple[int, int]:
    """KV bytes and blocks for a fixed budget, activation and overhead: only weights+external vary."""
    ledger = MemoryLedger.size(budget=8 * 2**30, weights=weights, external=external, activation=300 * 2**20,
                               overhead=512 * 2**20, kv_block_bytes=12_288, block_size=16, device="cpu:test",
                               total=32 * 2**30, free=30 * 2**30)
    return ledger.kv_cache_bytes, ledger.num_kv_blocks


def test_charge_is_recorded_per_socket_and_role():
    c = ExternalCharges()
    assert c.charge(SOCK_T, "target", W_TARGET)
    assert c.charge(SOCK_D, "draft", W_DRAFT)
    assert c.total_bytes == W_TARGET + W_DRAFT
    assert c.entries() == [{"socket": SOCK_D, "role": "draft", "bytes": W_DRAFT},
                           {"socket": SOCK_T, "role": "target", "bytes": W_TARGET}]


def test_one_charge_per_distinct_socket_even_with_two_roles():
    c = ExternalCharges()
    assert c.charge(SOCK_T, "target", W_TARGET)
    assert not c.charge(SOCK_T, "draft", W_TARGET)       # same daemon memory: never counted twice
    assert c.total_bytes == W_TARGET
    assert c.entries() == [{"socket": SOCK_T, "role": "target", "bytes": W_TARGET}]
    # the role that was not charged has nothing to remove; the charging role's entry survives
    assert c.remove(SOCK_T, "draft") == 0
    assert c.total_bytes == W_TARGET


def test_remove_happens_once():
    c = ExternalCharges()
    c.charge(SOCK_T, "target", W_TARGET)
    assert c.remove(SOCK_T, "target") == W_TARGET
    assert c.remove(SOCK_T, "target") == 0
    assert c.total_bytes == 0 and c.entries() == []


def test_fallback_removes_exactly_that_sources_charge():
    c = ExternalCharges()
    c.charge(SOCK_T, "target", W_TARGET)
    c.charge(SOCK_D, "draft", W_DRAFT)
    assert c.remove(SOCK_D, "draft") == W_DRAFT           # the draft fell back to disk
    assert c.entries() == [{"socket": SOCK_T, "role": "target", "bytes": W_TARGET}]
    assert c.remove(SOCK_D, "target") == 0                 # same role elsewhere, other socket same role: untouched
    assert c.total_bytes == W_TARGET


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10", None])
def test_charge_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError):
        ExternalCharges().charge(SOCK_T, "target", bad)


def test_every_weight_path_gives_the_same_kv_for_the_target():
    """disk: owned W; zero-copy: charged W; copy: owned W (charge removed after release); fallback: owned W
    (charge applied, then removed once after the disk load)."""
    disk = kv(W_TARGET, 0)
    zero = ExternalCharges()
    zero.charge(SOCK_T, "target", W_TARGET)
    copy = ExternalCharges()
    copy.charge(SOCK_T, "target", W_TARGET)
    copy.remove(SOCK_T, "target")
    fallback = ExternalCharges()
    fallback.charge(SOCK_T, "target", W_TARGET // 2)      # a bfloat16 daemon reports half of a float32 W
    before = kv(W_TARGET, fallback.total_bytes)           # the seed bug: own copy + stale charge
    fallback.remove(SOCK_T, "target")
    assert kv(0, zero.total_bytes) == disk
    assert kv(W_TARGET, copy.total_bytes) == disk
    assert kv(W_TARGET, fallback.total_bytes) == disk
    assert before[0] < disk[0]                            # what the removal prevents


def test_draft_role_accounting_same_kv_whichever_way():
    """Target and draft each by disk, zero-copy or fallback: weights+external is always W_T + W_D."""
    want = kv(W_TARGET + W_DRAFT, 0)
    for t_way in ("disk", "zero_copy", "fallback"):
        for d_way in ("disk", "zero_copy", "fallback"):
            c, owned = ExternalCharges(), 0
            for sock, role, w, way in ((SOCK_T, "target", W_TARGET, t_way), (SOCK_D, "draft", W_DRAFT, d_way)):
                if way == "disk":
                    owned += w
                    continue
                assert c.charge(sock, role, w)
                if way == "fallback":
                    owned += w
                    assert c.remove(sock, role) == w
            assert kv(owned, c.total_bytes) == want, (t_way, d_way)


def test_partial_fallback_target_from_daemon_draft_from_disk():
    c = ExternalCharges()
    c.charge(SOCK_T, "target", W_TARGET)                  # target attached zero-copy
    c.charge(SOCK_D, "draft", W_DRAFT)                    # draft daemon said hello, then mismatched
    c.remove(SOCK_D, "draft")                             # draft loaded from disk: owned
    assert c.entries() == [{"socket": SOCK_T, "role": "target", "bytes": W_TARGET}]
    assert kv(W_DRAFT, c.total_bytes) == kv(W_TARGET + W_DRAFT, 0)


def test_two_roles_on_one_socket_with_draft_fallback_keeps_the_target_charge():
    c = ExternalCharges()
    assert c.charge(SOCK_T, "target", W_TARGET)
    assert not c.charge(SOCK_T, "draft", W_TARGET)        # draft resolves to the same daemon
    c.remove(SOCK_T, "draft")                             # ...and then falls back: removes nothing of the target's
    assert c.total_bytes == W_TARGET
