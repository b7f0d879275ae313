"""Tensor parallel on CUDA with NCCL: 2 ranks, one GPU each; greedy ids equal TP=1. Skipped unless torch sees at
least two GPUs (NCCL cannot run two ranks on one GPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

ROOT = Path(__file__).resolve().parents[2]


def probe(cfg: dict) -> dict:
    r = subprocess.run([sys.executable, "-m", "tests.boot_probe", json.dumps(cfg), "3"], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_nccl_tp2_greedy_equals_tp1(tmp_path):
    from tests.checkpoints import write_checkpoint
    model = write_checkpoint(tmp_path / "m", "qwen2", layers=2)
    base = {"model": str(model), "cache_dir": str(tmp_path / "c"), "device": "cuda", "dtype": "float32",
            "max_model_len": 128, "kv_cache_memory": 64 * 2**20}
    one = probe(base)
    two = probe({**base, "world_size": 2})
    assert two["report"]["tensor_parallel"]["world_size"] == 2
    assert [o["output_token_ids"] for o in two["outputs"]] == [o["output_token_ids"] for o in one["outputs"]]
