"""The decoder's layer loop as one compiled call (kernels/csrc/decoder_stack.cpp), for steps whose every row reads
the paged cache: decode, and short chunks over a cached prefix.

The compiled loop makes the same kernel calls as the Python decoder, in the same order, so its outputs are
bit-identical (tests/unit/test_native_stack.py); what it removes is Python: ~15 module calls, wrapper checks and
views per layer, which at batch 1 cost about a third of a step. float32 and bfloat16 models (quantized linears:
float32 only). Everything else keeps the Python path: prompts with nothing cached, mixed steps, the memory profile
(no cache), torch.compile, CUDA, per-head q/k norms (Qwen3), float16 models, and linears of any other kind
(tensor-parallel wrappers, torch's int4/int8 packs).

Set WARMSTART_NO_NATIVE_STACK=1 to turn it off (WARMSTART_NO_NATIVE_KERNELS turns off every compiled kernel)."""
from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch import nn

from warmstart import kernels
from warmstart.models.layers import DenseLinear
from warmstart.models.quant import NativeQuantLinear

DISABLED_ENV = "WARMSTART_NO_NATIVE_STACK"
STACK_DTYPES = (torch.float32, torch.bfloat16)   # the activations' dtypes the compiled kernels take

# Decoder body -> its Stack (None: not eligible), built on first use. Kept outside the module so that a copy of the
# model (copy.deepcopy, as the quantization tests do) never shares, or fails to pickle, the original's stack.
_STACKS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def _linear(module: nn.Module, mod, dtype: torch.dtype) -> Any | None:
    """A stack Linear for a DenseLinear in `dtype` (float32 or bfloat16: the stack calls its kernel,
    kernels.dense_linear) or, for float32, a NativeQuantLinear; None otherwise."""
    bias = module.bias
    if bias is not None:
        if bias.dtype is not dtype or not bias.is_cpu:
            return None
        bias = bias.detach()
    if type(module) is DenseLinear:
        w = module.weight
        if w.dtype is not dtype or not w.is_cpu or w.is_meta:
            return None
        return mod.Linear.dense(w.detach(), bias)
    if type(module) is NativeQuantLinear:
        if not module.qweight.is_cpu or dtype is not torch.float32:
            return None
        return mod.Linear.quantized(module.qweight, module.scales, module.mins, bias, kernels.DENSE_MIN_ROWS,
                                    kernels.panel_threshold(module.mins is not None))
    return None


def _group(owner: nn.Module, fused: str, parts: tuple[str, ...], mod, dtype: torch.dtype) -> list | None:
    names = (fused,) if hasattr(owner, fused) else parts
    linears = [_linear(getattr(owner, n), mod, dtype) for n in names]
    return None if any(lin is None for lin in linears) else linears


def build(body: nn.Module) -> Any | None:
    """A compiled Stack over the decoder body's layers, or None when any layer is not eligible (see the module
    docstring). Holds references to the modules' weight tensors, no copies."""
    mod = kernels.native_stack()
    if mod is None or os.environ.get(DISABLED_ENV):
        return None
    layers = []
    dtype = body.layers[0].input_layernorm.weight.dtype if len(body.layers) else torch.float32
    if dtype not in STACK_DTYPES:
        return None
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if attn.qk_norm or any(n.weight.dtype is not dtype or not n.weight.is_cpu for n in norms) \
                or norms[0].eps != norms[1].eps:
            return None
        qkv = _group(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), mod, dtype)
        gate_up = _group(mlp, "gate_up_proj", ("gate_proj", "up_proj"), mod, dtype)
        o, down = _linear(attn.o_proj, mod, dtype), _linear(mlp.down_proj, mod, dtype)
        if qkv is None or gate_up is None or o is None or down is None:
            return None
        layers.append(mod.Layer(norms[0].weight.detach(), norms[1].weight.detach(), norms[0].eps, qkv, o, gate_up,
                                down))
    first = body.layers[0].self_attn
    return mod.Stack(layers, first.h, first.hkv, first.d)


def stack_for(body: nn.Module) -> Any | None:
    """The body's Stack, built on its first paged step (modules swapped into the body afterwards are not seen)."""
    try:
        return _STACKS[body]
    except KeyError:
        stack = _STACKS[body] = build(body)
        return stack


def set_stack(body: nn.Module, stack: Any | None) -> None:
    """Use `stack` for this body from now on (None: the Python loop)."""
    _STACKS[body] = stack


def usable_for(x: torch.Tensor) -> bool:
    """Per call: the activations are float32 or bfloat16 on the CPU and torch.compile is not tracing (the Stack
    itself checks that x is in the model's dtype)."""
    return x.dtype in STACK_DTYPES and x.is_cpu and not torch.compiler.is_compiling()
