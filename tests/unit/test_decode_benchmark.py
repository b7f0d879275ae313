"""benchmarks/decode.py's own parts (issue 8's numbers come from them): the report's ratios and goal lines from a
results dict, the physical context bound, the busy loops and the CPU clock that say how much CPU each side had, and
one real worker run of the default model. The rates themselves are not asserted (this host's speed varies)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_report  # noqa: E402
from cpu_load import CpuClock, Load  # noqa: E402


def results() -> dict:
    """A results dict with every section, numbers chosen so each ratio is known."""
    return {
        "threads": 2, "cpus": 2, "new_tokens": 128, "rounds": 2, "bandwidth_gb_s": 50.0,
        "batch1": {"ws fp32": {"tok_s": 30.0, "weight_bytes": 538_060_032},
                   "ws gguf-native (int4+int8)": {"tok_s": 250.0, "weight_bytes": 96_576_768},
                   "hf fp32": {"tok_s": 25.0, "weight_bytes": None},
                   "llama.cpp Q4_1": {"tok_s": 200.0, "weight_bytes": None}},
        "batch32": {"ws fp32": 260.0, "ws gguf-native": 900.0, "hf fp32": 270.0, "hf bf16": 400.0},
        "context": {"int8": {128: 800.0, 2048: 480.0}},
        "context_paired": {"int8": [[800.0, 480.0], [700.0, 490.0], [750.0, 450.0]]},
        "kv_bytes_per_token": {"int8": 30 * 2 * 3 * 68},
        "under_load": {"default": {"quiet_tok_s": 300.0, "loaded_tok_s": 120.0, "loaded_samples": [110.0, 130.0],
                                   "quiet_boot_s": 1.5, "loaded_boot_s": 3.0}},
        "under_load_paired": [[300.0, 150.0], [320.0, 128.0], [280.0, 140.0]],
        "under_load_cpu": [{"quiet_engine": 1.9, "loaded_engine": 0.7, "loaded_loops": 1.3}] * 3,
        "quiet_one_thread_tok_s": 160.0,
        "under_load_adaptive_ab": {"adaptive": [120.0, 130.0], "fixed": [100.0, 140.0]},
    }


def printed(res: dict, capsys) -> str:
    decode_report.report(res)
    return capsys.readouterr().out


def test_report_prints_each_goal_ratio_from_the_rates(capsys):
    out = printed(results(), capsys)
    assert "best warmstart / llama.cpp = 1.25 (goal >= 1)" in out                 # 250 / 200
    assert "best warmstart / best transformers = 2.25 (goal >= 1.5)" in out       # 900 / 400: each side's best
    assert "ratio 0.60 (goal >= 0.7)" in out                                       # 480 / 800
    assert "median 0.60 (goal >= 0.7)" in out                                      # of 0.60, 0.70, 0.60
    assert "median 2.00x (goal <= 2)" in out                                       # of 2.00, 2.50, 2.00
    assert "would slow down 1.88x" in out                                          # median quiet 300 / 160
    assert "adaptive / fixed 1.04x" in out                                         # medians 125 / 120


def test_report_share_of_the_bandwidth_bound(capsys):
    out = printed(results(), capsys)
    row = next(line for line in out.splitlines() if line.startswith("| ws gguf-native"))
    bound = 50e9 / 96_576_768                                                      # tok/s if only weights were read
    assert f"| {bound:.1f} |" in row and f"{250 / bound:.0%}" in row


def test_cpu_share_table_sets_the_slowdown_against_the_cores_left(capsys):
    decode_report.cpu_share_table([[300.0, 150.0]], [{"quiet_engine": 1.8, "loaded_engine": 0.7,
                                                       "loaded_loops": 1.4}], 2)
    row = capsys.readouterr().out.splitlines()[-1]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2] == "2.00x"                    # 300 / 150
    assert cells[5] == "0.60"                     # 2 cores - 1.4 taken by the loops
    assert cells[6] == "3.00x"                    # 1.8 cores quiet / 0.6 left


def test_report_leaves_out_what_was_not_measured(capsys):
    res = results()
    res["batch1"]["llama.cpp Q4_1"]["tok_s"] = None
    for key in ("under_load", "under_load_paired", "context_paired"):
        del res[key]
    out = printed(res, capsys)
    assert "llama.cpp =" not in out and "goal <= 2" not in out and "paired in one process" not in out
    assert "best warmstart / best transformers" in out


def test_context_bound_is_the_extra_reads_at_the_measured_bandwidth():
    b = decode_report.context_bound(8, 800.0, 12_240, 50.0)
    step128 = 8 / 800.0                                     # 10 ms
    extra = 8 * (2048 - 128) * 12_240 / 50e9                # 3.76 ms of reads at 50 GB/s
    assert b["ratio"] == pytest.approx(step128 / (step128 + extra))
    assert b["extra_mb"] == pytest.approx(8 * 1920 * 12_240 / 1e6)
    assert decode_report.context_bound(8, 800.0, None, 50.0) is None


def test_busy_loops_take_a_core_each_and_the_clock_sees_it():
    with Load(1) as load:
        loops, own = CpuClock([p.pid for p in load.procs]), CpuClock()
        time.sleep(1.0)
        assert loops.cores() > 0.3                          # one loop on a shared 2-core host: most of a core
        assert own.cores() < 0.5                            # this process slept (other tests may leave threads)
        pids = [p.pid for p in load.procs]
    for pid in pids:                                        # the loops are gone afterwards
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_the_cpu_clock_counts_this_processes_threads():
    own = CpuClock()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        pass
    assert 0.3 < own.cores() <= 1.5


@pytest.mark.timeout(300)
def test_a_warmstart_worker_decodes_the_default_model_and_reports_its_rate(tmp_path):
    """The benchmark's own worker, as its driver spawns it: a JSON line with a positive rate and the weight bytes
    of the default mode (the GGUF's int4 + int8 codes, below the float32 model's 538 MB)."""
    args = {"batch": 2, "ctx": 16, "n": 6, "dtype": "float32", "quantization": "auto"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--worker", "ws", json.dumps(args)],
                       capture_output=True, text=True, timeout=280, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "WARMSTART_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tok_s"] > 0 and out["tn"] > out["t1"] > 0
    assert 50_000_000 < out["weight_bytes"] < 538_060_032
    assert out["threads"]["threads"] == out["threads"]["available_cpus"] >= 1   # the default: every core
