"""The tables of benchmarks/decode.py (issue 8) from its results dict, and the physical limits beside the two goals
that are ratios of measured rates: the best 2048/128 context ratio the K/V reads allow, and the proportional
reference under load."""
from __future__ import annotations

import statistics


def report(res: dict) -> None:
    bw = res.get("bandwidth_gb_s")
    if "batch1" in res:
        b1 = res["batch1"]
        print(f"\n## batch 1 ({res['new_tokens']} new tokens, {res['threads']} threads, median of {res['rounds']})")
        print("| system | tok/s | weight bytes read/token | bandwidth bound tok/s | share of bound |\n"
              "|---|---|---|---|---|")
        gguf_bytes = 96_576_768
        sizes = {"ws fp32": 538_060_032, "ws bf16": 269_030_016, "hf fp32": 538_060_032, "llama.cpp Q4_1": gguf_bytes}
        for k, v in b1.items():
            size = v.get("weight_bytes") or sizes.get(k)
            bound = bw * 1e9 / size if (bw and size) else None
            share = f"{v['tok_s'] / bound:.0%}" if (bound and v["tok_s"]) else "-"
            print(f"| {k} | {_f(v['tok_s'])} | {size or '-'} | {_f(bound)} | {share} |")
        best_ws = max((v["tok_s"] or 0 for k, v in b1.items() if k.startswith("ws")), default=0)
        if b1.get("llama.cpp Q4_1", {}).get("tok_s"):
            print(f"\nbest warmstart / llama.cpp = {best_ws / b1['llama.cpp Q4_1']['tok_s']:.2f} (goal >= 1)")
    if "batch32" in res:
        b32 = res["batch32"]
        best_ws32 = max(v or 0 for k, v in b32.items() if k.startswith("ws"))
        best_hf32 = max(v or 0 for k, v in b32.items() if k.startswith("hf"))
        print("\n## batch 32\n| system | tok/s |\n|---|---|")
        for k, v in b32.items():
            print(f"| {k} | {_f(v)} |")
        if best_hf32:
            print(f"\nbest warmstart / best transformers = {best_ws32 / best_hf32:.2f} (goal >= 1.5)")
    for kvd, c in res.get("context", {}).items():
        if c.get(128) and c.get(2048):
            print(f"\n## context scaling (batch 8, KV cache {kvd}): 128 ctx {c[128]:.1f} tok/s, 2048 ctx "
                  f"{c[2048]:.1f} tok/s, ratio {c[2048] / c[128]:.2f} (goal >= 0.7)")
    for kvd, pairs in res.get("context_paired", {}).items():
        if pairs:
            ratios = [b / a for a, b in pairs]
            print(f"\n## context scaling, paired in one process (batch 8, KV cache {kvd}): 2048/128 per round "
                  f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f} (goal >= 0.7)")
            bound = context_bound(8, statistics.median(a for a, _ in pairs),
                                  res.get("kv_bytes_per_token", {}).get(kvd), bw)
            if bound:
                print(f"   the physical limit: the 2048 step reads {bound['extra_mb']:.0f} MB more K/V than the 128 "
                      f"step, {bound['extra_ms']:.1f} ms at the measured {bw:.1f} GB/s with no arithmetic at all, "
                      f"beside a 128-ctx step of {bound['step128_ms']:.1f} ms: the memory allows a ratio of at most "
                      f"{bound['ratio']:.2f} here")
    if res.get("step_breakdown"):
        print("\n## batch-1 step breakdown, default mode (ms per decode step; kernels timed in the Python layer loop)\n"
              "| context | step, compiled stack | step, Python loop | quantized matmuls | paged attention | "
              "glue (the rest, Python loop) | glue share |\n|---|---|---|---|---|---|---|")
        for c, b in res["step_breakdown"].items():
            if b:
                glue = b["step"] - b["matmul"] - b["attention"]
                print(f"| {c} | {_f(b.get('step_stack'), 2)} | {b['step']:.2f} | {b['matmul']:.2f} | "
                      f"{b['attention']:.2f} | {glue:.2f} | {glue / b['step']:.0%} |")
    if "under_load" in res:
        print("\n## under load (busy loops on every core)\n| wait policy | quiet tok/s | loaded tok/s | slowdown | "
              "loaded samples | quiet boot s | loaded boot s | slowdown |\n|---|---|---|---|---|---|---|---|")
        for p, v in res["under_load"].items():
            sd = v["quiet_tok_s"] / v["loaded_tok_s"] if v["quiet_tok_s"] and v["loaded_tok_s"] else None
            samples = ", ".join(_f(x) for x in v.get("loaded_samples", []))
            print(f"| {p} | {_f(v['quiet_tok_s'])} | {_f(v['loaded_tok_s'])} (median) | {_f(sd, 2)}x | {samples} | "
                  f"{_f(v['quiet_boot_s'], 2)} | {_f(v['loaded_boot_s'], 2)} | "
                  f"{_f(v['loaded_boot_s'] / v['quiet_boot_s'], 2)}x |")
        for who, key, cpu_key, goal in (("warmstart, default policy", "under_load_paired", "under_load_cpu",
                                         " (goal <= 2)"),
                                        ("llama.cpp, same GGUF and threads (reference)", "under_load_paired_llama",
                                         "under_load_cpu_llama", "")):
            if res.get(key):
                slow = [q / l for q, l in res[key]]
                print(f"\n{who}, quiet and loaded alternated in one process: loaded tok/s per round "
                      f"{', '.join(_f(l) for _, l in res[key])}; slowdown per round "
                      f"{', '.join(f'{x:.2f}x' for x in slow)}; median {statistics.median(slow):.2f}x{goal}")
                cpu_share_table(res[key], res.get(cpu_key), res.get("cpus"))
                one = res.get("quiet_one_thread_tok_s")
                if key == "under_load_paired" and one:
                    quiet = statistics.median(q for q, _ in res[key])
                    print(f"   the proportional reference: with every core shared with a busy loop the engine has "
                          f"one core's worth of CPU; one quiet thread decodes {one:.1f} tok/s, so an engine that used "
                          f"that share as well as one quiet thread would slow down {quiet / one:.2f}x (its quiet "
                          f"{quiet:.1f} tok/s on {res['threads']} threads / {one:.1f})")
    for key, batch in (("under_load_adaptive_ab", 1), ("under_load_adaptive_ab_b32", 32)):
        ab = res.get(key)
        if ab and all(x for xs in ab.values() for x in xs):
            med = {k: statistics.median(v) for k, v in ab.items()}
            print(f"\nunder load, batch {batch}, separate processes alternated (tok/s): "
                  + "; ".join(f"{k} {', '.join(_f(x) for x in v)}" for k, v in ab.items())
                  + "; medians " + " vs ".join(f"{m:.1f}" for m in med.values())
                  + f" (adaptive / fixed {med['adaptive'] / med['fixed']:.2f}x)")
    print(f"\nmeasured read bandwidth: {_f(bw, 1)} GB/s")


def cpu_share_table(pairs: list, cpu: list | None, cpus: int | None) -> None:
    """Per round of a quiet/loaded pair: the cores each side used (CPU seconds per wall second) and the slowdown
    set against the CPU the engine had. 'in proportion' = quiet cores / the cores the busy loops left it: the
    slowdown of an engine that kept its quiet speed per core on whatever CPU the load left."""
    if not cpu or not cpus:
        return
    print("   | round | tok/s quiet -> loaded | slowdown | engine cores quiet -> loaded | busy loops' cores | "
          f"cores left (of {cpus}) | slowdown in proportion to the cores left |\n   |---|---|---|---|---|---|---|")
    for i, ((q, l), c) in enumerate(zip(pairs, cpu), 1):
        left = max(cpus - c["loaded_loops"], 0.01)             # (the loops can leave next to nothing)
        print(f"   | {i} | {_f(q)} -> {_f(l)} | {q / l:.2f}x | {c['quiet_engine']:.2f} -> {c['loaded_engine']:.2f} | "
              f"{c['loaded_loops']:.2f} | {left:.2f} | {c['quiet_engine'] / left:.2f}x |")


def context_bound(batch: int, tok_s_128: float, kv_bytes_per_token: float | None, bw_gb_s: float | None,
                  short: int = 128, long: int = 2048) -> dict | None:
    """The best 2048/128 decode ratio the memory allows: every decode step reads each sequence's whole context of
    K/V once, so the long step reads batch x (long - short) x kv_bytes_per_token more, at best at the measured read
    bandwidth, on top of the short step's time (everything else in the step is the same work)."""
    if not (tok_s_128 and kv_bytes_per_token and bw_gb_s):
        return None
    step128 = batch / tok_s_128
    extra = batch * (long - short) * kv_bytes_per_token
    extra_s = extra / (bw_gb_s * 1e9)
    return {"step128_ms": step128 * 1e3, "extra_mb": extra / 1e6, "extra_ms": extra_s * 1e3,
            "ratio": step128 / (step128 + extra_s)}


def _f(x, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"
