"""The dtypes a boot resolves before loading: weights and activations (--dtype), and the KV cache
(--kv-cache-dtype). The engine's boot, the weight daemon and `warmstart plan` resolve them through these functions,
so a daemon's cache key names the dtype an engine asks for."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from warmstart.models.spec import ModelSpec
from warmstart.startup.device import DeviceFacts
from warmstart.weights.loader import DTYPES

log = logging.getLogger("warmstart")


def resolve_dtype(requested: str, facts: DeviceFacts, spec: ModelSpec | None = None,
                  cache_dir: Path | None = None, quantized: bool = False) -> torch.dtype:
    """The weight/activation dtype. On CPU, auto is float32 when the linears are quantized and run on warmstart's
    integer kernels (`quantized`: they compute in integers and float32, and the compiled decode step takes float32
    activations only; bfloat16 ones ran the default model at half the speed), and is otherwise decided by
    runner/dtype_probe.py (measured where it is not obvious, cached per machine); pass the model's spec and the
    cache dir so the probe uses its shapes."""
    if requested != "auto":
        if requested == "bfloat16" and facts.kind == "cpu" and not facts.has_fast_bf16:
            log.warning("bfloat16 on this CPU (%s) has no native matmul support and runs slower than float32",
                        facts.capability)
        return DTYPES[requested]
    if facts.kind == "cuda":
        return torch.bfloat16 if facts.has_fast_bf16 else torch.float16
    if quantized:
        from warmstart.models.quant import native_kernel
        if native_kernel():
            log.info("dtype auto: float32 (quantized linears on warmstart's integer kernels)")
            return torch.float32
    from warmstart.paths import warmstart_cache_dir
    from warmstart.runner.dtype_probe import choose_cpu_dtype
    h, i = (spec.hidden_size, spec.intermediate_size) if spec else (1024, 4096)
    choice = choose_cpu_dtype(facts.name, facts.capability, [(i, h), (h, i), (h, h)],
                              cache_dir or warmstart_cache_dir())
    return DTYPES[choice.dtype]


def quantized_load(requested: str, model_dir: Path) -> bool:
    """Whether the load keeps quantized linears: --quantization int8/int4, or auto on a quantized checkpoint (an
    imported GGUF). Reads only the checkpoint's tensor names."""
    if requested in ("int8", "int4"):
        return True
    if requested != "auto":
        return False
    from warmstart.weights.loader import checkpoint_names
    from warmstart.weights.quantize import checkpoint_kind
    return checkpoint_kind(checkpoint_names(model_dir)) == "quantized"


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, device_kind: str) -> torch.dtype:
    """The KV cache's dtype. auto: float16 for a float32 model on CPU, as llama.cpp's default F16 cache (a long
    context's decode reads the whole cache every step, and at 2,048 tokens the float16 step is ~1.4x faster; the
    cache holds twice the blocks); the model dtype otherwise. An explicit --kv-cache-dtype always wins; int8 is the
    quantized CPU cache (kernels.quantize_kv_rows)."""
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype != "auto":
        return DTYPES[kv_cache_dtype]
    return torch.float16 if device_kind == "cpu" and dtype is torch.float32 else dtype
