"""`warmstart generate` as a user runs it: the startup report, deterministic KV sizing, and clear errors."""
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checkpoints import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def run(*args, env=None, timeout=120):
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "warmstart", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ck"), "qwen3", layers=2)


def test_generate_writes_report_whose_steps_tile_the_wall_clock(ckpt, tmp_path):
    report = tmp_path / "r.json"
    t0 = time.monotonic()
    r = run("generate", ckpt, "--prompt", "Hello world", "--max-tokens", 6, "--temperature", 0,
            "--memory-utilization", "0.03", "--max-model-len", 256, "--startup-plan", "off",
            "--cache-dir", tmp_path / "cache", "--report", report)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    d = json.loads(report.read_text())
    names = [s["name"] for s in d["steps"]]
    assert names == ["imports", "config", "tokenizer", "weights", "memory profile", "kv allocation",
                     "prefix restore", "warm-up", "ready"]
    total = sum(s["seconds"] for s in d["steps"])
    assert abs(total - d["wall_seconds"]) <= 0.05 * d["wall_seconds"]
    assert d["steps"][0]["seconds"] > 0.1            # interpreter start and imports are counted, not lost
    assert d["wall_seconds"] < elapsed
    mem = d["memory"]
    assert mem["budget_bytes"] == int(0.03 * mem["total_bytes"])
    assert mem["budget_bytes"] == (mem["weights_bytes"] + mem["external_weights_bytes"] +
                                   mem["activation_peak_bytes"] + mem["runtime_overhead_bytes"] +
                                   mem["kv_cache_bytes"] + mem["headroom_bytes"])
    assert 0 <= mem["headroom_bytes"] < mem["kv_block_bytes"]
    assert mem["num_kv_blocks"] * mem["kv_block_bytes"] == mem["kv_cache_bytes"]
    assert d["plan"]["status"] == "off" and d["weights"]["source"] == "disk"
    # Invariant 7: the process's resident memory after boot agrees with the ledger within the stated margin.
    assert d["resident"]["ok"], d["resident"]
    assert abs(d["resident"]["measured_bytes"] - d["resident"]["expected_bytes"]) <= \
        d["resident"]["margin_bytes"] + mem["activation_peak_bytes"]
    out = d["outputs"][0]
    assert len(out["output_token_ids"]) == 6 and out["prompt_token_ids"]
    assert "kv cache" in r.stderr and "token capacity" in r.stderr      # the one memory table is logged


def test_two_boots_get_the_same_kv_blocks(ckpt, tmp_path):
    """Two unplanned boots measure the same inputs and so get the same KV blocks. The measured inputs on CPU are the
    activation peak and the runtime overhead (RSS before the weights, rounded up to 64 MiB): equal inputs must give
    equal blocks, and where a boot's RSS crossed a multiple of 64 MiB (seen once in a full run) its KV size must
    follow from its own ledger exactly, not differ by chance."""
    mem = []
    for i in range(2):
        report = tmp_path / f"r{i}.json"
        r = run("-q", "generate", ckpt, "--prompt", "Hi", "--max-tokens", 2, "--memory-utilization", "0.03",
                "--max-model-len", 256, "--startup-plan", "off", "--report", report)
        assert r.returncode == 0, r.stderr
        mem.append(json.loads(report.read_text())["memory"])
    for m in mem:
        non_kv = m["weights_bytes"] + m["external_weights_bytes"] + m["activation_peak_bytes"] + \
            m["runtime_overhead_bytes"]
        assert m["num_kv_blocks"] == (m["budget_bytes"] - non_kv) // m["kv_block_bytes"] > 0
        assert m["runtime_overhead_bytes"] % (64 * 2**20) == 0
    inputs = [(m["budget_bytes"], m["weights_bytes"], m["activation_peak_bytes"], m["runtime_overhead_bytes"])
              for m in mem]
    if inputs[0] == inputs[1]:
        assert mem[0]["num_kv_blocks"] == mem[1]["num_kv_blocks"]
    else:   # only the RSS quantum may differ between two boots of one config on one host
        assert inputs[0][:3] == inputs[1][:3], inputs


def assert_user_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


def test_missing_checkpoint(tmp_path):
    assert_user_error(run("generate", tmp_path / "nope", "--prompt", "x"), "was not found")


def test_corrupt_config(tmp_path, ckpt):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text("{not json")
    assert_user_error(run("generate", bad, "--prompt", "x"), "not valid JSON")


def test_truncated_weights(tmp_path, ckpt):
    bad = tmp_path / "trunc"
    bad.mkdir()
    for f in ckpt.iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[:len(data) // 2] if f.suffix == ".safetensors" else data)
    assert_user_error(run("generate", bad, "--prompt", "x", "--kv-cache-memory", "8MiB"), "safetensors")


def test_unsupported_architecture(tmp_path, ckpt):
    bad = tmp_path / "arch"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_user_error(run("generate", bad, "--prompt", "x"), "MambaForCausalLM", "Supported")


def test_prompt_longer_than_max_model_len(ckpt):
    assert_user_error(run("generate", ckpt, "--prompt", "Hello world " * 40, "--max-model-len", 32,
                          "--kv-cache-memory", "8MiB"), "max_model_len", "--max-model-len")


def test_kv_budget_too_small_for_one_sequence(ckpt):
    assert_user_error(run("generate", ckpt, "--prompt", "x", "--kv-cache-memory", "64KiB", "--max-model-len", 512),
                      "too small for one sequence", "--kv-cache-memory")


def test_bad_flag_values(ckpt):
    assert_user_error(run("generate", ckpt, "--prompt", "x", "--kv-cache-memory", "lots"), "byte size")
    assert_user_error(run("generate", ckpt, "--prompt", "x", "--memory-utilization", "1.5"), "memory-utilization")
