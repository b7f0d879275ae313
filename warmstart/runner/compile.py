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
        """Compiler-cache counters so far in this process. A graph found in AOTAutograd's cache never reaches
        inductor's FX-graph cache, so both levels are reported; cache_hits/cache_misses are their sums."""
        from torch._dynamo.utils import counters
        raw = {"fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
               "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
               "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
               "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"]}
        raw = {k: int(v) for k, v in raw.items()}
        return {"key": self.cache_dir.name, "cache_dir": str(self.cache_dir), **raw,
                "cache_hits": raw["fxgraph_cache_hit"] + raw["autograd_cache_hit"],
                "cache_misses": raw["fxgraph_cache_miss"] + raw["autograd_cache_miss"]}


def compile_model(model: nn.Module, cache_dir: Path) -> CompileStats:
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Inductor resolves its cache folder from this variable each time it needs it; set before the first compile.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = True
    import torch
    for layer in model.model.layers:
        # (nn.Module.compile() left these modules untraced on torch 2.13; wrapping forward does trace.)
        layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True)
    return CompileStats(cache_dir)
