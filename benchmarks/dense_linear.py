"""warmstart's few-row float GEMV (kernels.dense_linear) against torch's F.linear, in one process, interleaved.

    PYTHONPATH=. .venv/bin/python benchmarks/dense_linear.py [--out FILE]

One "step" is every linear of SmolLM2-135M at batch 1..8 rows: 30 layers of q, k, v, o, gate, up, down, and the
tied LM head, each layer its own weights, so they come from memory as in a decode step (538 MB in float32). For
float32 and bfloat16 it prints the best step time of each kernel, the weight bytes per second, and the ratio
torch / warmstart (above 1: the GEMV is faster). Rounds alternate the two kernels, so the host's drift hits both.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from warmstart import kernels

LAYER = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]   # (K, N)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if kernels.DENSE_GEMV_MAX_ROWS == 0:
        print(f"the compiled kernels are not built here ({kernels.QLINEAR_UNAVAILABLE_REASON}): nothing to compare")
        return 0
    results = []
    print(f"{'dtype':9} {'rows':>4} {'torch ms':>9} {'ws ms':>7} {'torch GB/s':>10} {'ws GB/s':>8} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(n, k).to(dtype) for _ in range(30) for k, n in LAYER]
        weights.append(torch.randn(49152, 576).to(dtype))                  # the tied LM head
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        for rows in (1, 2, 4, 8):
            xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
            best = {"torch": float("inf"), "ws": float("inf")}
            fns = {"torch": F.linear, "ws": kernels.dense_linear}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    for w in weights:
                        fn(xs[w.shape[1]], w)
                    best[name] = min(best[name], time.perf_counter() - t0)
            row = {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "torch_ms": best["torch"] * 1e3,
                   "ws_ms": best["ws"] * 1e3, "torch_gb_s": nbytes / best["torch"] / 1e9,
                   "ws_gb_s": nbytes / best["ws"] / 1e9, "ratio": best["torch"] / best["ws"]}
            results.append(row)
            print(f"{row['dtype']:9} {rows:>4} {row['torch_ms']:>9.2f} {row['ws_ms']:>7.2f} {row['torch_gb_s']:>10.1f} "
                  f"{row['ws_gb_s']:>8.1f} {row['ratio']:>6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "isa": kernels.qlinear_isa(), "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
