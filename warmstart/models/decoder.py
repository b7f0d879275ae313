"""The Llama-shaped decoder shared by Llama, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Parameter names equal the Hugging Face checkpoint names, so a state dict binds without renaming and a daemon
manifest lines up with a disk load one to one. Inputs are packed: all scheduled tokens of all sequences in one
[T] tensor; the attention backend knows which tokens belong to which sequence."""
from __future__ import annotations

import torch
from torch import nn

from warmstart.models import native
from warmstart.models.layers import DenseLinear, GatedMLP, PagedAttention, RMSNorm, RotaryEmbedding, apply_rotary
from warmstart.models.spec import ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.layer, self.h, self.hkv, self.d = layer, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = DenseLinear(spec.hidden_size, self.h * self.d, bias=spec.qkv_bias)
        self.k_proj = DenseLinear(spec.hidden_size, self.hkv * self.d, bias=spec.qkv_bias)
        self.v_proj = DenseLinear(spec.hidden_size, self.hkv * self.d, bias=spec.qkv_bias)
        self.o_proj = DenseLinear(self.h * self.d, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: PagedAttention) -> torch.Tensor:
        t = x.shape[0]
        if hasattr(self, "qkv_proj"):       # fused at load (weights/quantize.fuse): one call instead of three
            q, k, v = self.qkv_proj(x).split((self.h * self.d, self.hkv * self.d, self.hkv * self.d), dim=-1)
            q, k, v = q.view(t, self.h, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        else:
            q = self.q_proj(x).view(t, self.h, self.d)
            k = self.k_proj(x).view(t, self.hkv, self.d)
            v = self.v_proj(x).view(t, self.hkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        return self.o_proj(attn(self.layer, q, k, v).reshape(t, self.h * self.d))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.self_attn = Attention(spec, layer)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual block, with the residual stream carried separately: the input hidden state is
        x + residual (residual None on the first layer), and so is the output. Each norm adds its residual in the
        same pass (kernels.add_rms_norm), so the block's two residual adds cost no extra op."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, rope, attn), residual)
        return self.mlp(h), residual


class DecoderBody(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.rope)

    def forward(self, input_ids, positions, attn):
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        step = attn.paged_step() if native.usable_for(x) and hasattr(attn, "paged_step") else None
        stack = native.stack_for(self) if step is not None else None
        if stack is not None:
            # Every row reads the paged cache: the whole layer loop is one compiled call (models/native.py).
            cos, sin = (r.reshape(x.shape[0], -1) for r in rope)
            x, residual = stack.forward(x, cos, sin, *step, self.layers[0].self_attn.d ** -0.5)
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, rope, attn)
        return self.norm.add_forward(x, residual)[0]


class DecoderLM(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = DecoderBody(spec)
        self.lm_head = DenseLinear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        """Hidden states [T, hidden] for packed tokens; call compute_logits on the rows that need them."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def tied_weights(self) -> dict[str, str]:
        """Parameter name -> the name it shares storage with, when the checkpoint ties embeddings."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.spec.tie_word_embeddings else {}
