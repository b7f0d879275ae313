"""Time to first token for a chat whose ~1,000-token system prompt is (a) not cached, (b) cached in the running
server, (c) restored from disk after a restart (SIGTERM saves it, the next boot's "prefix restore" step loads it).

Everything runs against real `warmstart serve` processes in one run, so the ratios compare like with like. TTFT is
the latency of a non-streaming request with max_tokens 1 (prefill + one sampled token + HTTP), the median of
--samples requests, each with its own system prompt (so (a) never hits). Also reported: the restore step's seconds
and bytes at the second boot, and whether the restored server's first token equals the cold one.
Usage: python benchmarks/prefix_cache.py [--model DIR|default|tiny] [--system-tokens 1000] [--samples 3]
                                          [--out prefix_cache.json] [serve flags...]"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.server_process import ServerProcess  # noqa: E402

PARAGRAPH = ("You are the support assistant of a small bakery in Lyon. Answer in two sentences, be kind, never "
             "invent prices, and recommend the seasonal tart when asked for advice. Opening hours are 7 to 19, "
             "closed on Mondays; the shop sells bread, croissants, tarts and coffee; delivery is by bicycle. ")


def system_prompts(model_dir: Path, tokens: int, samples: int) -> list[str]:
    from warmstart.tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    body = PARAGRAPH
    while len(tok.encode(body)) < tokens:
        body += PARAGRAPH
    # A distinct first line per sample: different first block, so one sample never hits another's blocks.
    return [f"Session {i}: {body}" for i in range(samples)]


def ttft(srv: ServerProcess, model: str, system: str, user: str) -> tuple[float, dict, str]:
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    t0 = time.perf_counter()
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=300)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    d = r.json()
    return dt, d["usage"], d["choices"][0]["message"]["content"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="a model folder, 'default' (SmolLM2-135M) or 'tiny'")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--out", default="prefix_cache.json", help="where to write the JSON results")
    args, extra = ap.parse_known_args()
    if args.model == "tiny":
        from tests.checkpoints import write_checkpoint
        model_dir = write_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama", layers=4, hidden=256,
                                     max_position=4096)
    elif args.model == "default":
        from warmstart.weights.gguf import default_model_dir
        model_dir = default_model_dir()
    else:
        model_dir = Path(args.model)
    systems = system_prompts(model_dir, args.system_tokens, args.samples)
    work = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    # The persist budget must hold every sample's prompt: ~1,000 tokens of SmolLM2-135M KV are 44 MiB in float32.
    flags = ["--max-model-len", "4096", "--kv-cache-memory", "1GiB", "--prefix-cache-persist", "512MiB",
             "--startup-plan", "off", "--cache-dir", str(work / "cache"), *extra]

    first = ServerProcess(model_dir, *flags, log_path=work / "first.log")
    try:
        first.wait_ready(timeout=300)
        name = httpx.get(f"{first.base_url}/v1/models").json()["data"][0]["id"]
        cold = [ttft(first, name, s, "Do you deliver on Sundays?") for s in systems]
        warm = [ttft(first, name, s, "What do you recommend today?") for s in systems]
    finally:
        rc = first.terminate(timeout=60)
    assert rc == 0, first.log()[-3000:]

    t0 = time.perf_counter()
    second = ServerProcess(model_dir, *flags, log_path=work / "second.log")
    try:
        second.wait_ready(timeout=300)
        boot_seconds = time.perf_counter() - t0
        report = httpx.get(f"{second.base_url}/startup").json()
        restored = [ttft(second, name, s, "Can I order a birthday cake?") for s in systems]
        same = [ttft(second, name, s, "Do you deliver on Sundays?")[2] for s in systems]
    finally:
        second.terminate(timeout=60)

    restore = report["prefix_restore"]
    step = {s["name"]: s["seconds"] for s in report["steps"]}
    med = {k: statistics.median(x[0] for x in v) for k, v in (("a", cold), ("b", warm), ("c", restored))}
    rows = [("(a) not cached", cold), ("(b) cached, same server", warm), ("(c) restored after restart", restored)]
    print(f"model {model_dir} | system prompt {cold[0][1]['prompt_tokens']} prompt tokens | "
          f"{args.samples} samples, median TTFT (max_tokens 1, non-streaming, HTTP included)")
    print(f"{'case':<28} {'TTFT s':>8} {'cached tokens':>14} {'speed-up vs (a)':>16}")
    for (label, xs), key in zip(rows, "abc"):
        print(f"{label:<28} {med[key]:>8.3f} {xs[0][1]['prompt_tokens_details']['cached_tokens']:>14} "
              f"{med['a'] / med[key]:>15.1f}x")
    print(f"restart: ready in {boot_seconds:.2f} s (client view); 'prefix restore' step {step['prefix restore']:.3f}"
          f" s: {restore['blocks']} blocks, {restore['bytes'] / 2**20:.1f} MiB ({restore['status']})")
    print(f"first token after restart equals the cold server's: {[x[2] for x in cold] == same}")
    result = {"model": str(model_dir), "samples": args.samples, "prompt_tokens": cold[0][1]["prompt_tokens"],
              "ttft_seconds": {"not_cached": [x[0] for x in cold], "cached": [x[0] for x in warm],
                               "restored": [x[0] for x in restored]},
              "median_ttft_seconds": med, "speedup_cached": med["a"] / med["b"],
              "speedup_restored": med["a"] / med["c"],
              "cached_tokens": {"cached": warm[0][1]["prompt_tokens_details"]["cached_tokens"],
                                "restored": restored[0][1]["prompt_tokens_details"]["cached_tokens"]},
              "restore": {**restore, "step_seconds": step["prefix restore"]}, "restart_ready_seconds": boot_seconds,
              "same_first_token_after_restart": [x[2] for x in cold] == same, "flags": flags}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
