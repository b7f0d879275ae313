"""Decode speed on CPU against peers, every ratio measured in one run (issue 8). Prints tables, writes JSON.

    python benchmarks/decode.py [--new-tokens 128] [--rounds 2] [--threads N] [--out benchmarks/results/decode.json]
                                [--only batch1 breakdown batch32 context load]

The whole run takes about 50 minutes on a 2-core host; `--only` runs some sections (the tables of the others are
left out).

Every figure is a fresh process (the worker mode of this file), and systems run interleaved, round by round, so a
noisy neighbour hits all of them alike; ratios are per round, then the median. decode tok/s = B*(N-1)/(tN - t1),
where t1 is the best of two 1-token runs and tN one N-token run: prefill cancels out (peers.md's method).

Sections: batch 1 (warmstart fp32 / bf16 / the GGUF's own quantization, llama.cpp on the same GGUF through
llama-cpp-python in a separate venv `.venv-peers`, HF transformers fp32), and where a batch-1 step's time goes
(quantized matmuls, paged attention, the rest = glue; timed in the Python layer loop, beside the compiled decoder
stack's step) at 40 and 2,048 tokens of context; batch 32 (warmstart vs transformers, each in its fastest dtype);
context scaling (batch 8 at 128 vs 2,048 tokens of context, KV cache auto = fp16, fp32 and int8; and, for auto and
int8, both contexts alternated in one process, so each ratio's two sides see the same host); under load (batch 1 and
a plan-hit boot while busy loops hold every core, vs quiet; warmstart's default: the kernels' own pool, OpenMP
passive without spin, one pinned thread per CPU, a step's team chosen by rate while the host is busy; vs a fixed
team, not pinned, the OpenMP team spinning 100,000 (the old default), active wait; the default's quiet and loaded
decode alternated in one process, as is llama.cpp's for reference, with the cores each side used per round (the
slowdown in proportion to the CPU the busy loops left), beside one quiet thread's rate: the proportional reference
for one core's worth of CPU; and the adaptive team against a fixed one, separate processes alternated under one
load, at batch 1 and at batch 32 (there with one thread beside them)); the physical limits (measured read bandwidth,
the batch-1 bound for each weight format, and the best 2048/128 ratio the extra K/V reads allow for each cache
dtype).
The tables and the limits are printed by decode_report.py; this file runs the workers and the driver.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_load import CpuClock, Load

ROOT = Path(__file__).resolve().parents[1]
PEERS_PY = ROOT / ".venv-peers" / "bin" / "python"


# ------------------------------------------------------------------------------------------------ workers
def _prompts(batch: int, ctx: int, vocab: int = 49152) -> list[list[int]]:
    import random
    rng = random.Random(batch * 100003 + ctx)
    return [[rng.randrange(100, vocab - 100) for _ in range(ctx)] for _ in range(batch)]


def _rate(run, batch: int, n: int) -> dict:
    run(1)                                                 # warm-up
    t1 = min(_timed(run, 1) for _ in range(2))
    tn = _timed(run, n)
    return {"tok_s": batch * (n - 1) / max(tn - t1, 1e-9), "t1": t1, "tn": tn}


def _timed(run, n: int) -> float:
    t0 = time.perf_counter()
    run(n)
    return time.perf_counter() - t0


def _ws_engine(a: dict, max_ctx: int):
    """The default model as the workers run it, sized for prompts of up to max_ctx tokens; and run(ctx), which gives
    a function that decodes n greedy tokens for the batch's prompts of ctx tokens."""
    from warmstart import LLM, SamplingParams
    llm = LLM("default", dtype=a["dtype"], quantization=a["quantization"], kv_cache_memory=2**30,
              max_model_len=max_ctx + a["n"] + 16, startup_plan="off", max_num_seqs=max(64, a["batch"]),
              max_num_batched_tokens=max(512, max_ctx), kv_cache_dtype=a.get("kv_cache_dtype", "auto"),
              threads=a.get("threads"))

    def run(ctx: int):
        prompts = _prompts(a["batch"], ctx)
        return lambda n: llm.generate_ids(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return llm, run


def worker_ws(a: dict) -> dict:
    llm, runner = _ws_engine(a, a["ctx"])
    run = runner(a["ctx"])
    spent = _time_kernels() if a.get("breakdown") else None
    out = _rate(run, a["batch"], a["n"])
    if spent is not None:
        # Kernel seconds of the decode steps alone: one N-token run minus one 1-token run, as for tok/s.
        before = dict(spent)
        run(1)
        one = {k: spent[k] - before[k] for k in spent}
        before = dict(spent)
        t0 = time.perf_counter()
        run(a["n"])
        total = time.perf_counter() - t0
        steps = a["n"] - 1
        decode_s = total - out["t1"]
        out["breakdown_ms_per_step"] = {k: 1e3 * (spent[k] - before[k] - one[k]) / steps for k in spent}
        out["breakdown_ms_per_step"]["step"] = 1e3 * decode_s / steps
    out["weight_bytes"] = llm.booted.ledger.weights_bytes
    out["threads"] = llm.booted.report.to_dict()["threads"]
    return out


def worker_ws_paired(a: dict) -> dict:
    """Two conditions of one booted engine, alternated round by round in this process, so the host's drift (often
    20-30 % between processes minutes apart) hits both sides of each ratio alike. kind "context": batch 8 at 128
    vs 2,048 tokens of context (one engine sized for the longer; the prompts' prefill is cached after the first
    round, and the rate's t1 cancels it either way). kind "load": batch 1 quiet vs with busy loops on every core."""
    from warmstart.threads import available_cpus
    ctxs = (128, 2048) if a["kind"] == "context" else (a["ctx"],)
    llm, runner = _ws_engine(a, max(ctxs))
    if a["kind"] == "load":
        pairs, cpu = _load_pairs(runner(a["ctx"]), a, available_cpus())
        return {"pairs": pairs, "cpu": cpu}
    ledger = llm.booted.ledger                              # K and V of every layer, one token: the bytes a decode
    return {"pairs": [[_rate(runner(c), a["batch"], a["n"])["tok_s"] for c in ctxs] for _ in range(a["rounds"])],
            "kv_bytes_per_token": ledger.kv_block_bytes / ledger.block_size}   # step reads per context position


def _load_pairs(run, a: dict, cpus: int) -> tuple[list[list[float]], list[dict]]:
    """[quiet, loaded] tok/s per round: the same run without, then with, busy loops on `cpus` cores; and per round
    the CPU each side had, in cores (CPU seconds over wall seconds): the engine's own, quiet and loaded, and what
    the busy loops took while the engine ran loaded (the CPU they left it is `cpus` minus that)."""
    pairs, cpu = [], []
    for _ in range(a["rounds"]):
        t0 = time.perf_counter()    # settle: an adaptive team grows back after the last round's load (a window of
        run(a["n"])                 # 0.3 s of steps: runner/step_threads.py), so a second of decoding before timing
        while time.perf_counter() - t0 < 1.0:
            run(a["n"])
        own = CpuClock()
        quiet = _rate(run, a["batch"], a["n"])["tok_s"]
        quiet_cores = own.cores()
        with Load(cpus) as load:
            own, loops = CpuClock(), CpuClock([p.pid for p in load.procs])
            loaded = _rate(run, a["batch"], a["n"])["tok_s"]
            cpu.append({"quiet_engine": quiet_cores, "loaded_engine": own.cores(), "loaded_loops": loops.cores()})
        pairs.append([quiet, loaded])
    return pairs, cpu


def _time_kernels() -> dict:
    """Wrap the compiled kernels the decoder calls (quantized matmuls, paged attention) with timers: what remains
    of a step is glue (norms, RoPE, cache writes, module calls, scheduling, sampling)."""
    from warmstart.models import quant
    from warmstart.runner import attention
    spent = {"matmul": 0.0, "attention": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper
    quant._qlinear_kernel = timed(quant._qlinear_kernel, "matmul")
    attention.paged_attention = timed(attention.paged_attention, "attention")
    return spent


def worker_hf(a: dict) -> dict:
    import torch
    from hf_model import hf_float_model
    from warmstart.weights.gguf import default_model_dir
    model = hf_float_model(default_model_dir(), getattr(torch, a["dtype"]))
    ids = torch.tensor(_prompts(a["batch"], a["ctx"]))

    def run(n):
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
    return _rate(run, a["batch"], a["n"])


def _llama_run(a: dict):
    from llama_cpp import Llama
    # n_batch=1: the prompt goes in one token at a time. llama-cpp-python 0.3.36's ggml segfaults in
    # ggml_backend_amx_mul_mat on multi-token batches on AMX hosts (gdb, Xeon with amx_int8); decode, what is timed,
    # is one token per call either way, and the prompt's cost cancels out of the rate (t1 is subtracted).
    llm = Llama(model_path=a["gguf"], n_ctx=a["ctx"] + a["n"] + 16, n_threads=a["threads"], verbose=False,
                n_batch=1)
    prompt = _prompts(1, a["ctx"])[0]

    def run(n):
        llm.reset()
        llm.create_completion(prompt, max_tokens=n, temperature=0.0, logit_bias={llm.token_eos(): -1e9})
    return run


def worker_llama(a: dict) -> dict:
    return _rate(_llama_run(a), 1, a["n"])


def worker_llama_paired(a: dict) -> dict:
    """llama.cpp's batch-1 decode quiet vs loaded, alternated as worker_ws_paired does: the peer's slowdown under
    the same load. (The peers' venv need not import warmstart: the caller passes the core count.)"""
    pairs, cpu = _load_pairs(_llama_run(a), {**a, "batch": 1}, a["cpus"])
    return {"pairs": pairs, "cpu": cpu}


def worker_bandwidth(a: dict) -> dict:
    import torch
    buf = torch.ones(2**28)                                 # 1 GiB of float32
    best = min(_timed(lambda _: buf.sum(), 1) for _ in range(5))
    return {"read_gb_s": buf.numel() * 4 / best / 1e9}


WORKERS = {"ws": worker_ws, "ws_paired": worker_ws_paired, "hf": worker_hf, "llama": worker_llama,
           "llama_paired": worker_llama_paired,
           "bandwidth": worker_bandwidth}


# ------------------------------------------------------------------------------------------------ driver
def spawn(kind: str, args: dict, env: dict | None = None, timeout: float = 900) -> dict | None:
    py = str(PEERS_PY) if kind.startswith("llama") else sys.executable
    e = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
    r = subprocess.run([py, __file__, "--worker", kind, json.dumps(args)], capture_output=True, text=True,
                       env=e, cwd=ROOT, timeout=timeout)
    if r.returncode != 0:
        print(f"  {kind} {args} failed: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def boot_seconds(env: dict | None = None) -> float:
    """Process start -> first token of a plan-hit boot of the default model (the plan is primed first)."""
    cmd = [sys.executable, "-m", "warmstart", "-q", "generate", "default", "--prompt", "Hi", "--max-tokens", "1",
           "--max-model-len", "2048"]
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, env=e, cwd=ROOT, check=True, timeout=600)
    return time.perf_counter() - t0


def alternated_under_load(arms: dict[str, tuple[dict, dict | None]], rounds: int) -> dict[str, list]:
    """Decode tok/s of each arm (warmstart worker args, extra env), separate processes alternated round by round
    under one continuous load on every core."""
    from warmstart.threads import available_cpus
    out: dict[str, list] = {name: [] for name in arms}
    with Load(available_cpus()):
        for _ in range(rounds):
            for name, (args, env) in arms.items():
                out[name].append((spawn("ws", args, env) or {}).get("tok_s"))
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


SECTIONS = ("batch1", "breakdown", "batch32", "context", "load")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and one round (a smoke run)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for every system (default: the cores this process may use); 1 thread is the fair "
                         "setting on a host other jobs keep busy")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode.json"))
    ap.add_argument("--only", nargs="+", choices=SECTIONS, metavar="SECTION",
                    help=f"run only these sections ({', '.join(SECTIONS)}); the bandwidth is always measured")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker[0]](json.loads(args.worker[1]))))
        return 0
    n, rounds = (32, 1) if args.quick else (args.new_tokens, args.rounds)
    sys.path.insert(0, str(ROOT))
    from warmstart.threads import available_cpus
    from warmstart.weights.gguf import default_model_gguf
    threads = args.threads or available_cpus()
    os.environ["OMP_NUM_THREADS"] = str(threads)          # every worker, warmstart and transformers alike
    gguf_path = str(default_model_gguf())
    flags = open("/proc/cpuinfo").read()
    native_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    have_llama = PEERS_PY.exists() and subprocess.run([str(PEERS_PY), "-c", "import llama_cpp"],
                                                      capture_output=True).returncode == 0
    if not have_llama:
        print("llama.cpp: skipped (.venv-peers has no llama_cpp; build it with "
              "`python3 -m venv .venv-peers && .venv-peers/bin/pip install llama-cpp-python==0.3.36`)")
    res: dict = {"threads": threads, "cpus": available_cpus(), "new_tokens": n, "rounds": rounds}
    want = lambda section: not args.only or section in args.only  # noqa: E731
    paired_rounds = rounds if args.quick else max(4, rounds)

    if want("batch1"):
        # batch 1 (prompt of 40 tokens, as a chat turn)
        b1 = {"ws fp32": ("ws", {"dtype": "float32", "quantization": "none"}),
              "ws bf16": ("ws", {"dtype": "bfloat16", "quantization": "none"}),
              "ws gguf-native (int4+int8)": ("ws", {"dtype": "float32", "quantization": "auto"}),
              "hf fp32": ("hf", {"dtype": "float32"})}
        if have_llama:
            b1["llama.cpp Q4_1"] = ("llama", {"gguf": gguf_path, "threads": threads})
        rows: dict[str, list] = {k: [] for k in b1}
        for _ in range(rounds):
            for name, (kind, extra) in b1.items():
                rows[name].append(spawn(kind, {"batch": 1, "ctx": 40, "n": n, **extra}))
        res["batch1"] = {k: {"tok_s": med([r and r["tok_s"] for r in v]),
                             "weight_bytes": next((r.get("weight_bytes") for r in v if r), None)}
                         for k, v in rows.items()}
        print("batch 1:", json.dumps(res["batch1"]), flush=True)
    if want("breakdown"):
        # where a batch-1 step of the default mode goes (the issue's "lean step"), and that it does not grow with
        # context.
        # The kernels are timed through their Python wrappers, so the breakdown runs the Python layer loop
        # (WARMSTART_NO_NATIVE_STACK); the compiled stack's step, same context, is measured beside it.
        res["step_breakdown"] = {}
        for c in (40, 2048):
            one = {"batch": 1, "ctx": c, "n": min(n, 64), "dtype": "float32", "quantization": "auto"}
            b = (spawn("ws", {**one, "breakdown": True}, {"WARMSTART_NO_NATIVE_STACK": "1"}) or {}).get(
                "breakdown_ms_per_step")
            stack = spawn("ws", one)
            if b and stack:
                b["step_stack"] = 1e3 / stack["tok_s"]
            res["step_breakdown"][c] = b
        print("step breakdown:", json.dumps(res["step_breakdown"]), flush=True)

    if want("batch32"):
        # batch 32: each in its fastest dtype (both are tried)
        b32 = {"ws fp32": ("ws", {"dtype": "float32", "quantization": "none"}),
               "ws bf16": ("ws", {"dtype": "bfloat16", "quantization": "none"}),
               "ws gguf-native": ("ws", {"dtype": "float32", "quantization": "auto"}),
               "hf fp32": ("hf", {"dtype": "float32"})}
        if native_bf16:
            b32["hf bf16"] = ("hf", {"dtype": "bfloat16"})
        else:
            print("transformers bf16: skipped, this CPU has no avx512_bf16/amx (bf16 is emulated: its slowest dtype)")
        rows = {k: [] for k in b32}
        for _ in range(rounds):
            for name, (kind, extra) in b32.items():
                rows[name].append(spawn(kind, {"batch": 32, "ctx": 40, "n": n, **extra}))
        res["batch32"] = {k: med([r and r["tok_s"] for r in v]) for k, v in rows.items()}
        print("batch 32:", json.dumps(res["batch32"]), flush=True)

    if want("context"):
        # context scaling: batch 8 at 128 vs 2048 tokens of context, the default (native) mode, with the KV cache as the
        # default chooses (float16 for a float32 model on CPU), in float32 (exact) and in int8 (codes + a scale per
        # token and head: about half of float16's bytes)
        ctx: dict = {}
        for kvd in ("auto", "float32", "int8"):
            ctx[kvd] = {}
            for c in (128, 2048):
                ctx[kvd][c] = med([(spawn("ws", {"batch": 8, "ctx": c, "n": min(n, 64), "dtype": "float32",
                                                 "quantization": "auto", "kv_cache_dtype": kvd}) or {}).get("tok_s")
                                   for _ in range(rounds)])
        res["context"] = ctx
        print("context:", json.dumps(ctx), flush=True)
        # the same ratio with both contexts in one process, alternated: [128 tok/s, 2048 tok/s] per round
        res["context_paired"], res["kv_bytes_per_token"] = {}, {}
        for kvd in ("auto", "int8"):
            r = spawn("ws_paired", {"kind": "context", "batch": 8, "n": min(n, 64), "dtype": "float32",
                                    "quantization": "auto", "kv_cache_dtype": kvd, "rounds": paired_rounds}) or {}
            res["context_paired"][kvd], res["kv_bytes_per_token"][kvd] = r.get("pairs"), r.get("kv_bytes_per_token")
        print("context, paired:", json.dumps(res["context_paired"]), flush=True)

    if want("load"):
        # under load: busy loops on every core vs quiet; the default (the kernels' pool, OpenMP passive without spin,
        # one pinned thread per CPU, a step's team chosen by rate while the host is busy) vs a fixed team, not pinned,
        # the OpenMP team spinning 100,000, and active wait. Loaded decode is
        # bimodal when threads are not pinned (the scheduler may stack both on one core), so it is sampled `rounds`
        # times: the median, and the worst sample.
        load = {}
        boot_seconds()                                          # prime: import the model and write the plan once
        policies = {"default (kernel pool, OpenMP PASSIVE no spin, pinned, adaptive team)": {},
                    "fixed team (WARMSTART_ADAPTIVE_THREADS=0)": {"WARMSTART_ADAPTIVE_THREADS": "0"},
                    "not pinned": {"WARMSTART_PIN_THREADS": "0"},
                    "OpenMP team, spin 100000 (the old default)": {"WARMSTART_THREAD_POOL": "0",
                                                                   "GOMP_SPINCOUNT": "100000"},
                    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"}}
        one = {"batch": 1, "ctx": 40, "n": min(n, 64), "dtype": "float32", "quantization": "auto"}
        for policy, env in policies.items():
            q = spawn("ws", one, env)
            qb = boot_seconds(env)
            with Load(available_cpus()):
                ls = [(spawn("ws", one, env) or {}).get("tok_s") for _ in range(rounds)]
                lb = boot_seconds(env)
            load[policy] = {"quiet_tok_s": q and q["tok_s"], "loaded_tok_s": med(ls), "loaded_samples": ls,
                            "quiet_boot_s": qb, "loaded_boot_s": lb}
            print(f"under load, {policy}:", json.dumps(load[policy]), flush=True)
        res["under_load"] = load
        # the default policy's quiet and loaded decode in one process, alternated: [quiet, loaded] tok/s per round
        paired = spawn("ws_paired", {"kind": "load", **one, "rounds": paired_rounds}) or {}
        res["under_load_paired"], res["under_load_cpu"] = paired.get("pairs"), paired.get("cpu")
        print("under load, paired:", json.dumps(res["under_load_paired"]), flush=True)
        # the adaptive team against a fixed one under one continuous load, separate processes alternated: single
        # loaded rows swing with where the scheduler puts the busy loops, so the two are compared side by side
        fixed = {"WARMSTART_ADAPTIVE_THREADS": "0"}
        ab = alternated_under_load({"adaptive": (one, None), "fixed": (one, fixed)}, paired_rounds)
        res["under_load_adaptive_ab"] = ab
        print("under load, adaptive vs fixed team:", json.dumps(ab), flush=True)
        # the same at batch 32, where the full team stays the faster one under load (the adaptive team chooses by
        # the rate its steps get), with one thread beside them (what a team that always shrank would get)
        b32 = {**one, "batch": 32}
        ab = alternated_under_load({"adaptive": (b32, None), "fixed": (b32, fixed),
                                    "one thread": ({**b32, "threads": 1}, None)}, paired_rounds)
        res["under_load_adaptive_ab_b32"] = ab
        print("under load, batch 32, adaptive vs fixed team vs one thread:", json.dumps(ab), flush=True)
        if have_llama:                                          # the peer under the same load, for reference
            paired = spawn("llama_paired", {**one, "gguf": gguf_path, "threads": threads, "rounds": paired_rounds,
                                            "cpus": available_cpus()}) or {}
            res["under_load_paired_llama"], res["under_load_cpu_llama"] = paired.get("pairs"), paired.get("cpu")
            print("under load, paired, llama.cpp:", json.dumps(res["under_load_paired_llama"]), flush=True)
        # the proportional reference: loaded, the engine has about one core's worth of CPU time; one quiet thread is
        # what one core's worth does at full efficiency
        res["quiet_one_thread_tok_s"] = (spawn("ws", {**one, "threads": 1}) or {}).get("tok_s")
    res["bandwidth_gb_s"] = (spawn("bandwidth", {}) or {}).get("read_gb_s")
    from decode_report import report
    report(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        os.environ.setdefault("WARMSTART_CACHE_DIR", d)
        sys.exit(main())
