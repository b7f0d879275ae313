"""Startup plans with the weight daemon (issue 4, item 10): the external charge is part of the ledger, and an
attached boot reuses a plan made by a disk boot although the daemon's resident weights lower free memory."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import write_checkpoint
from tests.integration.test_weight_daemon import Daemon, short_dir

ROOT = Path(__file__).resolve().parents[2]


def boot(model, cache, *args):
    cfg = {"model": str(model), "cache_dir": str(cache), "max_model_len": 256, "memory_utilization": 0.1,
           "dtype": "float32", **dict(a.split("=", 1) for a in args)}
    r = subprocess.run([sys.executable, "-m", "tests.boot_probe", json.dumps(cfg), "2"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_attached_boot_hits_the_plan_a_disk_boot_made(tmp_path):
    # ~350 MB of float32 weights: more than the CPU free-memory tolerance (256 MiB), so without counting the
    # daemon's bytes as ours the attached boot would miss on the free-memory gate.
    model = write_checkpoint(tmp_path / "m", "llama", layers=8, hidden=1024, vocab_size=384)
    disk = boot(model, tmp_path / "c", "load_format=disk")
    assert disk["report"]["plan"]["status"] == "miss" and disk["report"]["plan"]["saved"]
    w = disk["report"]["memory"]["weights_bytes"]
    assert w > 280 * 2**20
    sock_dir = short_dir()
    daemon = Daemon(model, sock_dir, "--dtype", "float32").wait_ready()
    try:
        attached = boot(model, tmp_path / "c", "load_format=daemon", f"weight_socket={daemon.socket}")
        # `plan explain` reaches the same decision without booting, by asking the daemon for its charge.
        flags = ["--memory-utilization", "0.1", "--max-model-len", "256", "--dtype", "float32",
                 "--cache-dir", str(tmp_path / "c")]
        explain = subprocess.run([sys.executable, "-m", "warmstart", "plan", "explain", str(model), *flags,
                                  "--load-format", "daemon", "--weight-socket", str(daemon.socket)],
                                 capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert explain.returncode == 0, explain.stderr
        lines = explain.stdout.splitlines()
        assert "zero-copy" in lines[0] and lines[1].startswith("hit: "), explain.stdout
    finally:
        daemon.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    rep = attached["report"]
    assert rep["weights"]["source"] == "daemon-zero-copy"
    assert rep["plan"]["status"] == "hit", rep["plan"]
    assert (rep["memory"]["weights_bytes"], rep["memory"]["external_weights_bytes"]) == (0, w)
    assert rep["memory"]["num_kv_blocks"] == disk["report"]["memory"]["num_kv_blocks"]
    assert rep["memory"]["kv_cache_bytes"] == disk["report"]["memory"]["kv_cache_bytes"]
    assert attached["outputs"] == disk["outputs"]
