"""Tensor-parallel sharding, pure: what each rank holds, that the shards recompose the full layer, and what is
refused (the process-level checks are in tests/integration/test_tensor_parallel.py)."""
import dataclasses

import pytest
import torch

from warmstart.errors import UserError
from warmstart.models.spec import ModelSpec, RopeSpec
from warmstart.parallel.sharding import check_divisible, kv_heads_of, local_spec, shard_tensors


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
    x = torch.randn(3, s.hidden_size)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(x @ full[p + "gate_proj.weight"].T) *
                                     (x @ full[p + "up_proj.weight"].T), full[p + "down_proj.weight"])
    total = 0
    for rank in range(world):
        sh = shard_tensors(full, s, rank, world)
        assert sh[p + "gate_proj.weight"].shape == (s.intermediate_size // world, s.hidden_size)
        assert sh["model.embed_tokens.weight"] is full["model.embed_tokens.weight"]     # replicated, not copied
        total = total + (torch.nn.functional.silu(x @ sh[p + "gate_proj.weight"].T) *
                         (x @ sh[p + "up_proj.weight"].T)) @ sh[p + "down_proj.weight"].T
    torch.testing.assert_close(total, ref)


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


def test_quantized_load_is_refused():
    s = spec()
    t = tensors(s)
    t["model.layers.0.mlp.up_proj.qweight"] = torch.zeros(1, dtype=torch.int8)
    with pytest.raises(UserError, match="float weights only"):
        shard_tensors(t, s, 0, 2)


def test_config_refuses_unsupported_combinations():
    from warmstart.config import EngineConfig
    for kw, words in (({"compile": True}, "--compile"), ({"quantization": "int4"}, "float weights only")):
        with pytest.raises(UserError, match=words):
            EngineConfig(model="m", world_size=2, **kw)
    assert dataclasses.replace(EngineConfig(model="m", world_size=2)).world_size == 2
