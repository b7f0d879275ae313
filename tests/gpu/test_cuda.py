"""CUDA checks, skipped where torch sees no GPU (CI never has one). Run on a lent GPU with `bash tests/gpu/run.sh`
(that machine's own torch; missing packages carried as wheels, see the script; the log goes to $OUT).
They cover what the CPU suite cannot: CUDA device facts and peak tracking, parity with transformers on the GPU,
a plan hit reproducing KV blocks and tokens, and the daemon's CUDA IPC path with the KV/token invariant."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.checkpoints import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("gpu") / "qwen3", "qwen3", layers=3)


def probe(cfg: dict, n: int = 3) -> dict:
    r = subprocess.run([sys.executable, "-m", "tests.boot_probe", json.dumps(cfg), str(n)], capture_output=True,
                       text=True, cwd=ROOT, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cuda_device_facts_and_peak():
    from warmstart.startup.device import CudaDevice
    d = CudaDevice(0)
    facts = d.facts()
    assert facts.kind == "cuda" and facts.total_bytes > 0 and facts.capability.startswith("sm_")
    assert 0 < d.free_bytes() <= facts.total_bytes
    with d.track_peak() as peak:
        x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        del x
    assert peak["peak_bytes"] >= 256 * 2**20


def test_parity_with_transformers_on_gpu(ckpt):
    import transformers
    from warmstart import LLM, SamplingParams
    llm = LLM(str(ckpt), device="cuda", dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256,
              startup_plan="off")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    prompts = [[5, 17, 33, 100, 7], list(range(3, 60))]
    outs = llm.generate_ids(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert o.output_token_ids == ref


def test_plan_hit_on_gpu_reproduces_blocks_and_tokens(ckpt, tmp_path):
    cfg = {"model": str(ckpt), "device": "cuda", "cache_dir": str(tmp_path), "memory_utilization": 0.05,
           "max_model_len": 256}
    a, b = probe(cfg), probe(cfg)
    assert a["report"]["plan"]["status"] == "miss" and b["report"]["plan"]["status"] == "hit", b["report"]["plan"]
    assert a["report"]["memory"]["num_kv_blocks"] == b["report"]["memory"]["num_kv_blocks"]
    assert a["outputs"] == b["outputs"]
    assert b["report"]["resident"]["ok"], b["report"]["resident"]
    c = probe({**cfg, "memory_utilization": 0.03})
    assert c["report"]["plan"]["status"] == "miss"
    assert c["report"]["memory"]["kv_cache_bytes"] < a["report"]["memory"]["kv_cache_bytes"]


def test_cuda_ipc_daemon_invariant(ckpt, tmp_path):
    from tests.integration.test_weight_daemon import short_dir
    sock_dir = short_dir()
    proc = subprocess.Popen([sys.executable, "-m", "warmstart", "-q", "weights", "serve", str(ckpt), "--socket-dir",
                             str(sock_dir), "--device", "cuda", "--dtype", "float32"], stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=ROOT)
    try:
        line = ""
        while not line.startswith("READY"):
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "daemon exited"
        sock = line.split("socket=")[1].split()[0]
        base = {"model": str(ckpt), "device": "cuda", "dtype": "float32", "memory_utilization": 0.05,
                "max_model_len": 256, "startup_plan": "off", "cache_dir": str(tmp_path)}
        runs = {"disk": probe({**base, "load_format": "disk"}),
                "zero_copy": probe({**base, "load_format": "daemon", "weight_socket": sock}),
                "copy": probe({**base, "load_format": "daemon", "weight_socket": sock, "weight_mode": "copy"})}
        ref = runs["disk"]
        for name, r in runs.items():
            assert r["report"]["memory"]["num_kv_blocks"] == ref["report"]["memory"]["num_kv_blocks"], name
            assert r["outputs"] == ref["outputs"], name
        assert runs["zero_copy"]["report"]["weights"]["source"] == "daemon-zero-copy"
    finally:
        proc.terminate()
        proc.wait(30)
