"""--compile: regional torch.compile of the decoder's repeated MLP blocks, with a persistent inductor cache.

Regional compilation: every layer's MLP has the same code, so one compiled graph serves all layers (weights are
graph inputs), and compile time does not grow with depth. Attention stays eager: its per-sequence Python loop
would specialise a whole-model graph on the batch's composition. The cache folder is named by the compile key
(keys.py), which holds no budget knob, so a memory-utilization change reuses compiled code."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torch import nn


@dataclass(frozen=True)
class CompileStats:
    cache_dir: Path

    def snapshot(self) -> dict:
        """Inductor's FX-graph cache counters so far in this process: hits mean compiled code came from disk."""
        from torch._dynamo.utils import counters
        return {"key": self.cache_dir.name, "cache_dir": str(self.cache_dir),
                "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
                "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"])}


def compile_model(model: nn.Module, cache_dir: Path) -> CompileStats:
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Inductor resolves its cache folder from this variable each time it needs it; set before the first compile.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = True
    for layer in model.model.layers:
        layer.mlp.compile(dynamic=True)
    return CompileStats(cache_dir)
