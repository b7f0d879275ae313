"""Tensor parallel vs one device on CPU (issue 11): boot time, decode tok/s at batch 1 and 32, all-reduce cost.

    python benchmarks/tensor_parallel.py [--new-tokens 16] [--out benchmarks/results/tensor_parallel.json]

The default model (SmolLM2-135M) has 9 attention heads and 3 KV heads, so it splits 3 ways but not 2: TP=2 on it
is refused (the refusal is recorded), and it runs at TP=1 and TP=3, both as float32 (quantization none) and as
served by default (quantization auto: the GGUF's int4 linears and int8 embedding, each rank cutting the canonical
codes before fusing; per-rank K of o_proj 192 and down_proj 512 are whole groups of 32). For a TP=2 figure
the same shape with 8 heads of 72 and 2 KV heads (same hidden size, MLP width, layers and vocab; random weights) runs
at TP=1 and TP=2. Every figure is a fresh process (rank 0; it launches its ranks), one run each, 1 thread per rank
(--threads-per-rank 1) so TP=N uses N cores; on a 2-core host no speedup is expected.
decode tok/s = B*(N-1)/(tN - t1) (prefill cancels out, as in benchmarks/decode.py). all-reduce per layer-step is
rank 0's wall time inside dist.all_reduce during the decode run, per layer and step (two all-reduces per layer):
it includes waiting for the slowest rank, so it bounds the pure communication cost from above."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(a: dict) -> dict:
    from warmstart import LLM, SamplingParams
    from warmstart.errors import UserError
    from warmstart.parallel import sharding
    from warmstart.startup.steps import StepTimer
    t0 = time.perf_counter()
    try:
        llm = LLM(a["model"], timer=StepTimer.starting_now(), quantization=a["quant"], dtype="float32",
                  tensor_parallel_size=a["tp"], threads_per_rank=1, kv_cache_memory=512 * 2**20,
                  max_model_len=128, startup_plan="off", max_num_seqs=64, cache_dir=a["cache"])
    except UserError as e:
        return {"refused": str(e)}
    boot = time.perf_counter() - t0
    layers = llm.booted.spec.num_layers
    out = {"boot_s": boot}
    import random
    rng = random.Random(0)
    for batch in (1, 32):
        prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(batch)]
        run = lambda n: llm.generate_ids(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        run(1)
        t1 = min(_timed(run, 1) for _ in range(2))
        s0, c0 = sharding.STATS["seconds"], sharding.STATS["calls"]
        n = a["n"]
        tn = _timed(run, n)
        ar_s, ar_calls = sharding.STATS["seconds"] - s0, sharding.STATS["calls"] - c0
        out[f"b{batch}"] = {"tok_s": batch * (n - 1) / max(tn - t1, 1e-9), "t1": t1, "tn": tn,
                            "allreduce_ms_per_layer_step": 1e3 * ar_s / max(1, ar_calls / 2) if ar_calls else 0.0,
                            "allreduce_share": ar_s / tn, "steps": ar_calls // (2 * layers) if ar_calls else n}
    llm.close()
    return out


def _timed(run, n):
    t0 = time.perf_counter()
    run(n)
    return time.perf_counter() - t0


def shaped_8h(cache: Path) -> Path:
    """SmolLM2-135M's shape with 8 heads of 72 and 2 KV heads (random weights), written once."""
    out = cache / "smollm2-shaped-8h"
    if not (out / "config.json").exists():
        import torch
        import transformers
        sys.path.insert(0, str(ROOT))
        from tests.checkpoints import build_tokenizer
        out.mkdir(parents=True, exist_ok=True)
        build_tokenizer(out, 49152 // 128)           # token ids only; the tokenizer is never used for text here
        cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                       num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=72, max_position_embeddings=2048, rms_norm_eps=1e-5,
                                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/tensor_parallel.json"))
    p.add_argument("--cache", default=None, help="cache dir (default: $WARMSTART_CACHE_DIR or ~/.cache/warmstart)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return
    from warmstart.paths import warmstart_cache_dir
    cache = Path(a.cache) if a.cache else warmstart_cache_dir()
    shaped = str(shaped_8h(cache))
    runs = [("default", "default", 1, "none"), ("default", "default", 2, "none"), ("default", "default", 3, "none"),
            ("default", "default", 1, "auto"), ("default", "default", 3, "auto"),
            ("smollm2-shaped-8h", shaped, 1, "none"), ("smollm2-shaped-8h", shaped, 2, "none")]
    results = []
    for name, model, tp, quant in runs:
        arg = json.dumps({"model": model, "tp": tp, "n": a.new_tokens, "cache": str(cache), "quant": quant})
        r = subprocess.run([sys.executable, __file__, "--worker", arg], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
        if r.returncode:
            res = {"error": r.stderr[-1500:]}
        else:
            res = json.loads(r.stdout.strip().splitlines()[-1])
        res.update(model=name, tp=tp, quantization=quant)
        results.append(res)
        print(json.dumps(res), flush=True)
    print(f"\n{'model':<20}{'quant':>6}{'TP':>3}{'boot s':>9}{'b1 tok/s':>10}{'b32 tok/s':>11}{'AR ms/layer b1':>16}"
          f"{'AR ms/layer b32':>17}")
    for r in results:
        if "refused" in r or "error" in r:
            print(f"{r['model']:<20}{r['quantization']:>6}{r['tp']:>3}   "
                  f"{('refused: ' + r['refused'][:90]) if 'refused' in r else 'error'}")
            continue
        print(f"{r['model']:<20}{r['quantization']:>6}{r['tp']:>3}{r['boot_s']:>9.2f}{r['b1']['tok_s']:>10.1f}{r['b32']['tok_s']:>11.1f}"
              f"{r['b1']['allreduce_ms_per_layer_step']:>16.3f}{r['b32']['allreduce_ms_per_layer_step']:>17.3f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"host_cpus": os.cpu_count(), "load": os.getloadavg(), "runs": results},
                                      indent=2) + "\n")


if __name__ == "__main__":
    main()
