"""Issue 9 items 5 and 6: plan files are untrusted input, sampling does not depend on whether a profile ran, and a
model whose weights are only partly resident keeps its plan."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checkpoints import write_checkpoint
from tests.integration.test_plans import ROOT, boot, plan_files
from warmstart.startup.ledger import MemoryLedger
from warmstart.startup.plan import PLAN_SCHEMA, PlanKey, PlanStore, _checksum


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("m"), "qwen2", layers=2)


def test_a_re_checksummed_plan_cannot_grow_the_kv_cache_beyond_the_budget(model, tmp_path):
    """Anyone can recompute the checksum; the budget is re-derived from the key on every hit instead."""
    # float32, not auto: the first boot in a cache dir would also run the dtype probe before measuring its runtime
    # overhead, and the two profiled boots compared below must measure under the same conditions.
    first = boot(tmp_path, model, n=1, memory_utilization=0.05, dtype="float32")
    (path,) = (tmp_path / "plans").glob("*.json")
    doc = json.loads(path.read_text())
    led = MemoryLedger.from_dict(doc["ledger"])
    forged = MemoryLedger.size(budget=led.budget_bytes * 4, weights=led.weights_bytes, external=0,
                               activation=led.activation_peak_bytes, overhead=led.runtime_overhead_bytes,
                               kv_block_bytes=led.kv_block_bytes, block_size=led.block_size, device=led.device,
                               total=led.total_bytes, free=led.free_bytes_at_boot)
    PlanStore(tmp_path / "plans").save(PlanKey(doc["key"]), forged)      # a valid digest and checksum
    r = boot(tmp_path, model, n=1, memory_utilization=0.05, dtype="float32")
    plan = r["report"]["plan"]
    assert plan["status"] == "miss" and any(x.startswith("stored budget") for x in plan["reasons"]), plan
    assert r["report"]["memory"]["num_kv_blocks"] == first["report"]["memory"]["num_kv_blocks"]
    assert r["report"]["memory"]["budget_bytes"] == led.budget_bytes


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _plant(plans: Path, digest: str, outside: Path) -> None:
    """One hostile file per kind, the one at the boot's own digest being a FIFO (a blocking read would hang)."""
    target = plans / f"{digest}.json"
    target.unlink()
    os.mkfifo(target)
    (plans / ("a" * 32 + ".json")).write_bytes(_nested(200_000))
    wrong = {"schema": PLAN_SCHEMA, "digest": "b" * 32, "key": [], "ledger": {"num_kv_blocks": "many"},
             "created": "x"}
    (plans / ("b" * 32 + ".json")).write_text(json.dumps(wrong))
    doc = {"schema": PLAN_SCHEMA, "digest": "c" * 32, "key": {"x": 1}, "ledger": {k: 1.5 for k in
                                                                        MemoryLedger.__dataclass_fields__}}
    doc["checksum"] = _checksum(doc)
    (plans / ("c" * 32 + ".json")).write_text(json.dumps(doc))
    outside.write_text(json.dumps({"secret": "outside the cache"}))
    (plans / ("d" * 32 + ".json")).symlink_to(outside)
    (plans / ("e" * 32 + ".json")).mkdir()


def test_hostile_files_in_plans_never_crash_or_block_a_boot_or_the_plan_commands(model, tmp_path):
    boot(tmp_path, model, n=0, memory_utilization=0.05)
    (name,) = plan_files(tmp_path)
    digest = name.removesuffix(".json")
    _plant(tmp_path / "plans", digest, tmp_path / "secret.json")
    t0 = time.monotonic()
    r = boot(tmp_path, model, n=1, memory_utilization=0.05)
    assert time.monotonic() - t0 < 120
    plan = r["report"]["plan"]
    assert plan["status"] == "miss" and "not a regular file" in plan["reasons"][0], plan
    assert "ignoring bad startup plan" in r["stderr"]
    assert plan["saved"]                                   # the FIFO was replaced by a good plan
    _plant_again = tmp_path / "plans" / f"{digest}.json"
    _plant_again.unlink()
    os.mkfifo(_plant_again)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "warmstart", "plan", *args, "--cache-dir", str(tmp_path)],
                              capture_output=True, text=True, cwd=ROOT, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    ls = cli("list")
    assert ls.returncode == 0 and "Traceback" not in ls.stderr and "skipping" in ls.stderr, ls.stderr[-2000:]
    assert "outside the cache" not in ls.stdout
    for prefix in ("a", "b", "c", "d", digest[:8]):
        show = cli("show", prefix + "a" * 31 if prefix == "a" else prefix)
        assert show.returncode == 2 and "Traceback" not in show.stderr, show.stderr[-2000:]
        assert "outside the cache" not in show.stdout
    assert cli("show", "../secret").returncode == 2
    explain = cli("explain", str(model), "--memory-utilization", "0.05", "--max-model-len", "256")
    assert explain.returncode == 0 and explain.stdout.startswith("miss"), explain.stderr[-2000:]
    clear = cli("clear", "--all")
    assert clear.returncode == 0 and "Traceback" not in clear.stderr, clear.stderr[-2000:]
    assert (tmp_path / "secret.json").exists()             # the symlink went, not its target


SAMPLED = ("import json, sys; from warmstart import LLM, SamplingParams; "
           "llm = LLM(sys.argv[1], cache_dir=sys.argv[2], max_model_len=256, memory_utilization=0.05, seed=7); "
           "out = llm.generate_ids([[5, 6, 7], [9, 9]], SamplingParams(max_tokens=16, temperature=1.0, "
           "ignore_eos=True)); print(json.dumps({'status': llm.report.plan.status, "
           "'tokens': [o.output_token_ids for o in out]}))")


def test_unseeded_sampling_gives_the_same_tokens_on_a_hit_as_on_the_miss(model, tmp_path):
    def run():
        p = subprocess.run([sys.executable, "-c", SAMPLED, str(model), str(tmp_path)], capture_output=True,
                           text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])
    miss, hit = run(), run()
    assert (miss["status"], hit["status"]) == ("miss", "hit")
    assert hit["tokens"] == miss["tokens"]


@pytest.mark.slow
def test_untied_embedding_loaded_by_mmap_keeps_its_plan(tmp_path):
    """An untied 1.2M-row embedding (300 MiB) is resident only where tokens were seen. The hit boot must not call
    that drift, re-measure a lower overhead and hand the KV cache more blocks than the miss had."""
    model = write_checkpoint(tmp_path / "m", "qwen2", layers=1, hidden=64, vocab_size=1_200_000,
                             extra={"tie_word_embeddings": False})
    cfg = dict(memory_utilization=0.1, max_num_seqs=4, max_num_batched_tokens=256, dtype="float32")
    miss = boot(tmp_path / "c", model, n=1, **cfg)
    assert miss["report"]["plan"]["status"] == "miss"
    hit = boot(tmp_path / "c", model, n=1, **cfg)
    assert hit["report"]["plan"]["status"] == "hit" and not hit["report"]["plan"]["reasons"], hit["report"]
    again = boot(tmp_path / "c", model, n=1, **cfg)
    assert again["report"]["plan"]["status"] == "hit"
    blocks = [r["report"]["memory"]["num_kv_blocks"] for r in (miss, hit, again)]
    assert blocks[0] == blocks[1] == blocks[2], blocks
    assert hit["outputs"] == miss["outputs"]
