"""The one collective of a tensor-parallel forward: row-parallel linears (o_proj, down_proj) all-reduce their
partial sums, once each, so a layer costs two all-reduces of [tokens, hidden].

What each rank holds (the cut of the checkpoint, float or quantized) is weights/shard.py; this module only wraps
the bound o_proj/down_proj modules, whatever their kind (nn.Linear or a quantized linear from models/quant.py).
The embedding and LM head are replicated rather than vocab-parallel: for the small-vocab models warmstart serves
this costs one extra copy of the embedding per rank and saves two collectives per step."""
from __future__ import annotations

import threading
import time

import torch
from torch import nn


class _Comm(threading.local):
    enabled = True          # False during the per-rank profiling forward: ranks profile independently (plan hits
                            # may differ per rank), and an in-place all-reduce allocates nothing to measure


COMM = _Comm()
STATS = {"calls": 0, "seconds": 0.0}     # all-reduce calls and wall time on this rank (the benchmark reads it)


class no_collectives:
    def __enter__(self):
        COMM.enabled = False

    def __exit__(self, *exc):
        COMM.enabled = True


class RowParallel(nn.Module):
    """y = all_reduce(inner(x_shard)) + b: the inner module (float or quantized) computes this rank's partial sum
    without its bias; the bias is added once, after the reduce."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        bias = inner.bias
        inner.bias = None
        self.inner = inner
        self.bias = bias
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if COMM.enabled:
            y = y.contiguous()              # a quantized kernel may return a view (padded rows sliced off)
            import torch.distributed as dist
            t0 = time.perf_counter()
            dist.all_reduce(y)
            STATS["seconds"] += time.perf_counter() - t0
            STATS["calls"] += 1
        return y if self.bias is None else y + self.bias


def make_row_parallel(model: nn.Module) -> None:
    """Wrap every o_proj and down_proj of a bound model in a RowParallel."""
    for layer in model.model.layers:
        for parent, attr in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            setattr(parent, attr, RowParallel(getattr(parent, attr)))
