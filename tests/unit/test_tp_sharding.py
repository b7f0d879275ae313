"""Tensor-parallel sharding, pure: what each rank holds, that the shards recompose the full layer, and what is
refused (the process-level checks are in tests/integration/test_tensor_parallel.py)."""
import dataclasses

import pytest
import torch

from warmstart.errors import UserError
from warmstart.models.spec import ModelSpec, RopeSpec
from warmstart.models import quant
from warmstart.weights.quantize import canonical, fuse, postprocess
from warmstart.weights.shard import ShardCut, check_divisible, kv_heads_of, local_spec, shard_tensors


def spec(h=4, hkv=2, d=8, hidden=32, inter=64) -> ModelSpec:
    return ModelSpec(architecture="LlamaForCausalLM", vocab_size=50, hidden_size=hidden, intermediate_size=inter,
                     num_layers=1, num_heads=h, num_kv_heads=hkv, head_dim=d, rms_norm_eps=1e-6,
                     rope=RopeSpec(theta=10000.0, rope_type="default", factor=1.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position=128),
                     max_position_embeddings=128, tie_word_embeddings=True, qkv_bias=True, o_bias=False,
                     mlp_bias=False, qk_norm=False, checkpoint_dtype="float32", eos_token_ids=(2,), bos_token_id=None)


def tensors(s: ModelSpec) -> dict:
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)
    p = "model.layers.0."
    return {p + "self_attn.q_proj.weight": r(s.num_heads * s.head_dim, s.hidden_size),
            p + "self_attn.q_proj.bias": r(s.num_heads * s.head_dim),
            p + "self_attn.k_proj.weight": r(s.num_kv_heads * s.head_dim, s.hidden_size),
            p + "self_attn.v_proj.weight": r(s.num_kv_heads * s.head_dim, s.hidden_size),
            p + "self_attn.o_proj.weight": r(s.hidden_size, s.num_heads * s.head_dim),
            p + "mlp.gate_proj.weight": r(s.intermediate_size, s.hidden_size),
            p + "mlp.up_proj.weight": r(s.intermediate_size, s.hidden_size),
            p + "mlp.down_proj.weight": r(s.hidden_size, s.intermediate_size),
            "model.embed_tokens.weight": r(s.vocab_size, s.hidden_size)}


def test_mlp_shards_recompose_the_full_layer():
    s, world = spec(), 2
    full = tensors(s)
    p = "model.layers.0.mlp."
    x = torch.randn(3, s.hidden_size, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.functional.linear(torch.nn.functional.silu(x @ full[p + "gate_proj.weight"].T) *
                                     (x @ full[p + "up_proj.weight"].T), full[p + "down_proj.weight"])
    total = 0
    for rank in range(world):
        sh = shard_tensors(full, s, rank, world)
        assert sh[p + "gate_proj.weight"].shape == (s.intermediate_size // world, s.hidden_size)
        assert sh["model.embed_tokens.weight"] is full["model.embed_tokens.weight"]     # replicated, not copied
        total = total + (torch.nn.functional.silu(x @ sh[p + "gate_proj.weight"].T) *
                         (x @ sh[p + "up_proj.weight"].T)) @ sh[p + "down_proj.weight"].T
    torch.testing.assert_close(total, ref, rtol=1e-4, atol=1e-4)     # float32, two partial sums vs one


@pytest.mark.parametrize("hkv,world,expected", [(2, 2, [(0, 1), (1, 2)]), (4, 2, [(0, 2), (2, 4)]),
                                                (1, 2, [(0, 1), (0, 1)]), (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)])])
def test_kv_heads_split_or_replicate(hkv, world, expected):
    s = spec(h=4, hkv=hkv)
    assert [kv_heads_of(s, r, world) for r in range(world)] == expected
    local = local_spec(s, world)
    assert local.num_heads == 4 // world and local.num_kv_heads == max(1, hkv // world)
    sh = shard_tensors(tensors(s), s, world - 1, world)
    k0, k1 = expected[-1]
    torch.testing.assert_close(sh["model.layers.0.self_attn.k_proj.weight"],
                               tensors(s)["model.layers.0.self_attn.k_proj.weight"][k0 * 8:k1 * 8])
    # Each rank's query heads read the KV head that the full model's GQA grouping gives them.
    group = s.num_heads // s.num_kv_heads
    for r in range(world):
        q_heads = range(r * local.num_heads, (r + 1) * local.num_heads)
        first = kv_heads_of(s, r, world)[0]
        assert [q // group for q in q_heads] == [first + j // (local.num_heads // local.num_kv_heads)
                                                 for j in range(local.num_heads)]


def test_refuses_what_cannot_divide():
    with pytest.raises(UserError, match="num_attention_heads 6 is not divisible by 4"):
        check_divisible(spec(h=6, hkv=2, inter=64), 4)
    with pytest.raises(UserError, match="intermediate_size 66 is not divisible by 4"):
        check_divisible(spec(h=4, hkv=2, inter=66), 4)
    with pytest.raises(UserError, match="num_key_value_heads 3 neither divides nor is divisible by 2"):
        check_divisible(spec(h=6, hkv=3), 2)
    check_divisible(spec(h=4, hkv=1), 4)


LAYER = "model.layers.0."
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def _quantized(full: dict, mode: str) -> dict:
    """Canonical quantized tensors of the float set (the form a GGUF import stores, or --quantization int8/int4)."""
    return canonical(full, torch.float32, mode)


def _linear(t: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    part = {k: t[f"{prefix}.{k}"] for k in ("qweight", "scales", "mins") if f"{prefix}.{k}" in t}
    return x @ quant.dequantize(part).T


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_shards_recompose_the_unsharded_matmul(mode):
    """Column-parallel outputs concatenate, row-parallel partial sums add up, to the unsharded quantized linear:
    the shards carry the same codes and scales (cut after quantizing), so only summation order differs."""
    s, world = spec(h=4, hkv=2, d=32, hidden=64, inter=128), 2            # per-rank K of o/down: 64, 64
    full = _quantized(tensors(s), mode)
    assert full[LAYER + "mlp.down_proj.qweight"].dtype == (torch.uint8 if mode == "int4" else torch.int8)
    shards = [shard_tensors(full, s, r, world) for r in range(world)]
    x = torch.randn(3, s.hidden_size)
    for lin in COLUMN:
        ref = _linear(full, LAYER + lin, x)
        got = torch.cat([_linear(sh, LAYER + lin, x) for sh in shards], dim=1)
        if lin.endswith(("k_proj", "v_proj")):
            assert torch.equal(got, ref)                          # one KV head per rank: the rows, as they were
        torch.testing.assert_close(got, ref)
    for lin, k in (("self_attn.o_proj", s.num_heads * s.head_dim), ("mlp.down_proj", s.intermediate_size)):
        xk = torch.randn(3, k)
        ref = _linear(full, LAYER + lin, xk)
        per = k // world
        got = sum(_linear(sh, LAYER + lin, xk[:, r * per:(r + 1) * per]) for r, sh in enumerate(shards))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if mode == "int8":                                            # per-row scales are whole on every rank
        assert torch.equal(shards[1][LAYER + "mlp.down_proj.scales"], full[LAYER + "mlp.down_proj.scales"])


def test_grouped_int8_scales_split_along_k():
    """GGUF's Q8_0: int8 with one scale per block of 32 along K; a row-parallel cut takes its blocks' scales."""
    s, world = spec(h=4, hkv=2, d=32, hidden=64, inter=128), 2
    full = _quantized(tensors(s), "int8")
    p = LAYER + "mlp.down_proj"
    w = tensors(s)[p + ".weight"]
    q = full[p + ".qweight"]
    full[p + ".scales"] = (w.reshape(64, 4, 32).abs().amax(2) / 127)          # [N, K/32]
    full[p + ".qweight"] = torch.round(w / full[p + ".scales"].repeat_interleave(32, 1)).clamp(-127, 127).to(q.dtype)
    xk = torch.randn(2, 128)
    ref = _linear(full, p, xk)
    got = sum(_linear(shard_tensors(full, s, r, world), p, xk[:, r * 64:(r + 1) * 64]) for r in range(world))
    assert shard_tensors(full, s, 1, world)[p + ".scales"].shape == (64, 2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_grouped_scales_refuse_a_cut_inside_a_group():
    s = spec(h=4, hkv=2, d=8, hidden=64, inter=128)                 # o_proj K per rank: 16, not a multiple of 32
    full = _quantized(tensors(s), "int4")
    with pytest.raises(UserError, match="self_attn.o_proj.*16 features.*multiple of the quantization group"):
        shard_tensors(full, s, 0, 2)
    # int8 per row has no groups: any K splits
    shard_tensors(_quantized(tensors(s), "int8"), s, 0, 2)


def test_postprocess_fuses_each_rank_s_shard():
    """The cut happens before the kernel preparation and the q/k/v, gate/up fusion: every rank fuses its own rows."""
    s, world = spec(h=4, hkv=2, d=32, hidden=64, inter=128), 2
    full = tensors(s)
    del full[LAYER + "self_attn.q_proj.bias"]                   # q/k/v fuse only when they match part for part
    whole = postprocess(dict(full), torch.float32, "int4")
    for r in range(world):
        mine = postprocess(dict(full), torch.float32, "int4", ShardCut(s, r, world))
        if quant.native_kernel():
            qkv = mine[LAYER + "self_attn.qkv_proj.qweight"]
            assert qkv.shape[0] == (s.num_heads + 2 * s.num_kv_heads) * s.head_dim // world
            assert LAYER + "self_attn.q_proj.qweight" not in mine
        assert set(mine) == set(whole)
    assert fuse({}) == {}


def test_config_refuses_unsupported_combinations():
    from warmstart.config import EngineConfig
    for kw, words in (({"compile": True}, "--compile"),
                      ({"speculative_method": "ngram", "num_speculative_tokens": 2}, "Speculative decoding"),
                      ({"draft_model": "d", "num_speculative_tokens": 2}, "--speculative-model.*not supported")):
        with pytest.raises(UserError, match=words):
            EngineConfig(model="m", world_size=2, **kw)
    assert EngineConfig(model="m", world_size=2, quantization="int4").quantization == "int4"
    assert dataclasses.replace(EngineConfig(model="m", world_size=2)).world_size == 2
