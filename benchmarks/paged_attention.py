"""Decode attention: the paged kernel (reads K/V blocks in place) vs today's path (index_select gather of every
sequence's padded context, then SDPA with a padding mask, as warmstart/runner/attention.py `_decode` does).

SmolLM2-135M's attention shapes (H=9, Hkv=3, D=64), block size 16, one layer; decode = T=B queries, one per
sequence, every sequence at the same context length; block ids shuffled over the pool. Both paths run interleaved in
one process, each sample a loop of calls long enough to time, min of n samples; 1 and 2 threads; fp32 and bf16
caches (q in the cache's dtype, as the model would run). Ratio = current / kernel (>1: the kernel is faster).

A second table: one sequence querying a chunk of n new tokens over a cached 1,024-token prefix (speculative
verification, chunked prefill), kernel vs the runner's non-decode path (gather the context, SDPA with a causal-offset
mask: attention.py `_attend`). It shows up to which chunk length the kernel should be used.

A first table, decode scaling: the kernel alone at batch 8, context 128 vs 2,048, fp32/fp16/bf16/int8 caches,
microseconds per layer call and the implied rate of K/V read (GB/s: the bytes of every sequence's K and V rows over
the time). Each sample cycles over enough distinct caches (one per "layer") that the reads come from memory, not
from the last call's cache lines, as in a real decode step. Caches are laid out as the runner's (head-major memory,
kernels.kv_blocks); `--layouts head position` also times the same kernel on position-major copies (heads interleaved
per position, the layout before head-major). `--baseline GITREF` also builds the kernel source at
that git revision (under another module name) and times it interleaved in the same process: old vs new on the same
noisy host.

    PYTHONPATH=. .venv/bin/python benchmarks/paged_attention.py [--samples 7] [--threads 1 2] [--out benchmarks/results/paged_attention.json]
    PYTHONPATH=. .venv/bin/python benchmarks/paged_attention.py --scaling-only --threads 1 --baseline main
    PYTHONPATH=. .venv/bin/python benchmarks/paged_attention.py --scaling-only --layouts head position
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from warmstart import kernels  # noqa: E402
from warmstart.runner.attention import _attend  # noqa: E402

H, HKV, D, BS = 9, 3, 64, 16


def setup(B: int, ctx: int, dtype: torch.dtype, seed: int = 0, layout: str = "head"):
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // BS)
    nb = B * per_seq + 1
    kc = torch.randn(nb, BS, HKV, D, generator=g)
    vc = torch.randn(nb, BS, HKV, D, generator=g)
    if dtype is torch.int8:                      # int8 rows: D codes + a float32 scale; queries stay float32
        kc, vc = kernels.quantize_kv_rows(kc), kernels.quantize_kv_rows(vc)
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    if layout == "head":
        kc, vc = kernels.head_major_copy(kc), kernels.head_major_copy(vc)
    ids = torch.randperm(nb, generator=g)[:B * per_seq].to(torch.int32)
    bt = ids.view(B, per_seq).contiguous()
    q = torch.randn(B, H, D, generator=g).to(torch.float32 if dtype is torch.int8 else dtype)
    seq_idx = torch.arange(B, dtype=torch.int32)
    ctx_lens = torch.full((B,), ctx, dtype=torch.int32)
    # today's inputs, built once per step by the runner (not per layer): padded slot matrix + mask (None at B=1)
    pos = torch.arange(ctx)
    slots = bt.long()[:, pos // BS] * BS + pos % BS                          # [B, L]
    mask = None if B == 1 else (pos[None, :] < ctx_lens[:, None].long())[:, None, None, :]
    return q, kc, vc, bt, seq_idx, ctx_lens, slots, mask


def current(q, kc, vc, slots, mask):
    """warmstart.runner.attention.PagedAttentionBackend._decode"""
    b, length = slots.shape
    flat = slots.reshape(-1)
    kk = kernels.kv_slot_rows(kc, flat).view(b, length, HKV, D).transpose(1, 2).to(q.dtype)
    vv = kernels.kv_slot_rows(vc, flat).view(b, length, HKV, D).transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(q[:, :, None, :], kk, vv, attn_mask=mask, enable_gqa=True)
    return out[:, :, 0, :]


def build_baseline(ref: str):
    """The paged kernel's source at git revision `ref`, compiled as module _paged_baseline (a second module named
    _paged would not load next to the current one)."""
    from torch.utils.cpp_extension import load
    d = Path(tempfile.mkdtemp(prefix="paged_baseline_"))
    csrc = "warmstart/kernels/csrc"
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{ref}:{csrc}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:                           # the .cpp and the headers it includes, as they were at `ref`
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{csrc}/{name}"], check=True,
                             capture_output=True, text=True).stdout
        (d / name).write_text(src)
    flags = ["-O3", "-fno-math-errno", "-DNDEBUG", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]   # as setup.py
    print(f"building the kernel at {ref} as _paged_baseline ...", flush=True)
    return load(name="_paged_baseline", sources=[str(d / "paged_attention.cpp")], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], build_directory=str(d), verbose=False)


def decode_scaling(args, baseline) -> list[dict]:
    """Batch-8 decode, the kernel alone: ctx 128 vs 2,048 per cache dtype, us per layer call and GB/s of K/V read."""
    B = 8
    scale = D ** -0.5
    fns = {"kernel": lambda *a: kernels.paged_attention(*a, scale)}
    if baseline is not None:
        fns["baseline"] = lambda *a: baseline.paged_attention(*a, scale)
    # (name, function, layout): the first layout under the plain name, the others as name@layout
    impls = [(k if layout == args.layouts[0] else f"{k}@{layout}", f, layout) for layout in args.layouts
             for k, f in fns.items()]
    rows = []
    print(f"decode scaling, batch {B}: us per layer call, GB/s of K/V read; caches cycled over {args.layer_bytes >> 20}"
          f" MiB of layers")
    hdr = "".join(f" {name + ' us':>12} {'GB/s':>6}" for name, _, _ in impls)
    print(f"{'threads':>7} {'cache':>8} {'ctx':>5}{hdr}" + ("  speedup" if baseline is not None else ""))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
            for ctx in args.scaling_ctx:
                one = setup(B, ctx, dtype)
                kv_bytes = 2 * B * ctx * HKV * one[1].shape[-1] * one[1].element_size()   # K and V rows read
                n_layers = max(2, min(30, args.layer_bytes // (2 * one[1].numel() * one[1].element_size())))
                layers = {lay: [setup(B, ctx, dtype, seed=s, layout=lay) for s in range(n_layers)]
                          for lay in args.layouts}
                q = one[0].float()
                calls = {k: (lambda f=f, lay=lay: [f(q, kc, vc, bt, si, cl)
                                                   for _, kc, vc, bt, si, cl, _, _ in layers[lay]])
                         for k, f, lay in impls}
                for f in calls.values():
                    f()                                                          # warm-up
                best = {k: float("inf") for k in calls}
                for _ in range(args.samples):                                    # interleaved
                    for k, f in calls.items():
                        t0 = time.perf_counter()
                        f()
                        best[k] = min(best[k], (time.perf_counter() - t0) / n_layers)
                row = dict(threads=threads, cache_dtype=str(dtype).removeprefix("torch."), batch=B, ctx=ctx,
                           kv_bytes=kv_bytes)
                line = f"{threads:>7} {row['cache_dtype']:>8} {ctx:>5}"
                for k, t in best.items():
                    row[f"{k}_us"] = round(t * 1e6, 1)
                    row[f"{k}_gbps"] = round(kv_bytes / t / 1e9, 2)
                    line += f" {t * 1e6:>12.1f} {kv_bytes / t / 1e9:>6.2f}"
                if baseline is not None:
                    row["speedup"] = round(best["baseline"] / best["kernel"], 2)
                    line += f"  {row['speedup']:>6.2f}x"
                for lay in args.layouts[1:]:
                    row[f"kernel_vs_{lay}"] = round(best[f"kernel@{lay}"] / best["kernel"], 2)
                    line += f"  {row[f'kernel_vs_{lay}']:>5.2f}x vs {lay}"
                rows.append(row)
                print(line, flush=True)
    for threads in args.threads:
        for dtype in ("float32", "float16", "bfloat16", "int8"):
            t = {r["ctx"]: r["kernel_us"] for r in rows if r["threads"] == threads and r["cache_dtype"] == dtype}
            if len(t) >= 2:
                lo, hi = min(t), max(t)
                print(f"  threads {threads} {dtype}: ctx {hi} costs {t[hi] / t[lo]:.1f}x ctx {lo} per call "
                      f"({t[hi] / hi * 1e3 / B:.1f} vs {t[lo] / lo * 1e3 / B:.1f} ns per sequence-position)")
    print()
    return rows


def sample(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--chunks", type=int, nargs="*", default=[4, 16, 64], help="chunk lengths over a 1024 prefix")
    ap.add_argument("--scaling-ctx", type=int, nargs="+", default=[128, 2048], help="decode-scaling contexts")
    ap.add_argument("--layer-bytes", type=int, default=256 << 20,
                    help="decode scaling: distinct caches cycled per sample, in bytes (more than the L3)")
    ap.add_argument("--baseline", metavar="GITREF", help="also time the kernel source at this git revision")
    ap.add_argument("--scaling-only", action="store_true", help="only the decode-scaling table")
    ap.add_argument("--layouts", nargs="+", choices=("head", "position"), default=["head"],
                    help="decode scaling: cache layouts to time the kernel on (head: the runner's; position: heads "
                         "interleaved per position)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "paged_attention.json"))
    args = ap.parse_args()
    if not kernels.has_native():
        print(f"native kernel unavailable ({kernels.NATIVE_UNAVAILABLE_REASON}); timing the pure-torch fallback")
    baseline = build_baseline(args.baseline) if args.baseline else None
    scaling_rows = decode_scaling(args, baseline)
    if args.scaling_only:
        args.batches, args.ctx, args.chunks = [], [], []
    scale = D ** -0.5
    rows = []
    if args.batches and args.ctx:
        print(f"H={H} Hkv={HKV} D={D} block={BS}; min of {args.samples} samples; times are per call (one layer)")
        print(f"{'threads':>7} {'cache':>5} {'B':>3} {'ctx':>5} {'current us':>11} {'kernel us':>10} {'ratio':>6}"
              "  max|diff|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for B in args.batches:
                for ctx in args.ctx:
                    q, kc, vc, bt, si, cl, slots, mask = setup(B, ctx, dtype)
                    cur = lambda: current(q, kc, vc, slots, mask)  # noqa: E731
                    ker = lambda: kernels.paged_attention(q, kc, vc, bt, si, cl, scale)  # noqa: E731
                    diff = (cur().float() - ker().float()).abs().max().item()
                    t_one = max(sample(cur, 1), sample(ker, 1), 1e-6)
                    inner = max(1, min(200, int(0.01 / t_one)))                     # ~10 ms per sample
                    tc, tk = [], []
                    for _ in range(args.samples):                                    # interleaved
                        tc.append(sample(cur, inner))
                        tk.append(sample(ker, inner))
                    c, k = min(tc) * 1e6, min(tk) * 1e6
                    rows.append(dict(threads=threads, cache_dtype=str(dtype).removeprefix("torch."), batch=B, ctx=ctx,
                                     current_us=round(c, 1), kernel_us=round(k, 1), ratio=round(c / k, 2),
                                     max_abs_diff=diff))
                    print(f"{threads:>7} {rows[-1]['cache_dtype'][:5]:>5} {B:>3} {ctx:>5} {c:>11.1f} {k:>10.1f} "
                          f"{c / k:>6.2f}  {diff:.1e}", flush=True)
    chunk_rows = []
    if args.chunks:
        prefix = 1024
        print(f"\nchunk of n queries over a {prefix}-token prefix (one sequence)")
        print(f"{'threads':>7} {'cache':>5} {'n':>3} {'current us':>11} {'kernel us':>10} {'ratio':>6}  max|diff|")
    for threads in args.threads if args.chunks else []:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for n in args.chunks:
                q, kc, vc, bt, _, _, _, _ = setup(1, prefix + n, dtype)
                q = torch.randn(n, H, D).to(dtype)
                si = torch.zeros(n, dtype=torch.int32)
                cl = torch.arange(prefix + 1, prefix + n + 1, dtype=torch.int32)
                pos = torch.arange(prefix + n)
                slots = bt[0].long()[pos // BS] * BS + pos % BS
                kf, vf = kernels.kv_slot_rows(kc, slots), kernels.kv_slot_rows(vc, slots)
                cur = lambda: _attend(q, kf.to(q.dtype), vf.to(q.dtype), n)  # noqa: E731
                ker = lambda: kernels.paged_attention(q, kc, vc, bt, si, cl, scale)  # noqa: E731
                diff = (cur().float() - ker().float()).abs().max().item()
                t_one = max(sample(cur, 1), sample(ker, 1), 1e-6)
                inner = max(1, min(200, int(0.01 / t_one)))
                tc, tk = [], []
                for _ in range(args.samples):
                    tc.append(sample(cur, inner))
                    tk.append(sample(ker, inner))
                c, k = min(tc) * 1e6, min(tk) * 1e6
                chunk_rows.append(dict(threads=threads, cache_dtype=str(dtype).removeprefix("torch."), prefix=prefix,
                                       chunk=n, current_us=round(c, 1), kernel_us=round(k, 1), ratio=round(c / k, 2),
                                       max_abs_diff=diff))
                print(f"{threads:>7} {chunk_rows[-1]['cache_dtype'][:5]:>5} {n:>3} {c:>11.1f} {k:>10.1f} "
                      f"{c / k:>6.2f}  {diff:.1e}", flush=True)
    result = dict(shape=dict(H=H, Hkv=HKV, D=D, block_size=BS), native=kernels.has_native(),
                  native_unavailable_reason=kernels.NATIVE_UNAVAILABLE_REASON, torch=torch.__version__,
                  samples=args.samples, scaling_rows=scaling_rows, baseline=args.baseline, rows=rows,
                  chunk_rows=chunk_rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
