"""Paged attention that reads the KV cache in place (warmstart.kernels): the compiled kernel and the pure-torch
fallback against a straightforward reference (dense SDPA in float64 over each sequence's gathered context, causal
offset), and against each other.

Tolerances: fp32 within 1e-5 (relative and absolute; outputs are O(1) convex combinations of V rows). bf16/fp16
inputs are compared with the reference computed in float64 from the same rounded inputs; the only extra error is the
output rounding plus fp32 accumulation: bf16 2e-2, fp16 3e-3 (a bf16 ulp at 1-2 is 2**-7)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from warmstart import kernels
from warmstart.kernels import paged_attention, paged_attention_torch

native = pytest.mark.skipif(not kernels.has_native(),
                            reason=f"native paged-attention kernel unavailable: {kernels.NATIVE_UNAVAILABLE_REASON}")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=3e-3, atol=3e-3)}


def make_case(seqs, H, Hkv, D, bs, dtype=torch.float32, cache_dtype=None, seed=0, spare_blocks=7):
    """seqs: list of (context length, queries): a sequence whose last `queries` positions are queried (ctx_lens
    L-n+1..L). Blocks are shuffled and non-contiguous; cache slots past each sequence's context hold NaN, so a read
    outside the context poisons the output."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    need = [-(-L // bs) for L, _ in seqs]
    nb = sum(need) + spare_blocks
    ids = torch.randperm(nb, generator=g).to(torch.int32)
    kc = torch.full((nb, bs, Hkv, D), float("nan"))
    vc = torch.full((nb, bs, Hkv, D), float("nan"))
    bt = torch.zeros(len(seqs), max(need) + 2, dtype=torch.int32)   # padded with 0 (a block another sequence owns)
    seq_idx, ctx_lens, at = [], [], 0
    for s, (L, n) in enumerate(seqs):
        bt[s, :need[s]] = ids[at:at + need[s]]
        at += need[s]
        pos = torch.arange(L)
        slots = bt[s].long()[pos // bs] * bs + pos % bs
        kc.view(-1, Hkv, D)[slots] = torch.randn(L, Hkv, D, generator=g)
        vc.view(-1, Hkv, D)[slots] = torch.randn(L, Hkv, D, generator=g)
        seq_idx += [s] * n
        ctx_lens += list(range(L - n + 1, L + 1))
    q = torch.randn(len(seq_idx), H, D, generator=g).to(dtype)
    if cache_dtype is torch.int8:        # int8 rows (codes + scale); a NaN row keeps a NaN scale: still poison
        kc, vc = kernels.quantize_kv_rows(kc), kernels.quantize_kv_rows(vc)
    else:
        kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    return (q, kc, vc, bt, torch.tensor(seq_idx, dtype=torch.int32), torch.tensor(ctx_lens, dtype=torch.int32))


def reference(q, kc, vc, bt, seq_idx, ctx_lens, scale):
    """Dense SDPA (float64) per sequence over its gathered context, queries at the end with a causal offset."""
    T, H, D = q.shape
    bs = kc.shape[1]
    out = torch.empty(T, H, D, dtype=torch.float64)
    for s in seq_idx.unique().tolist():
        rows = (seq_idx == s).nonzero().flatten()
        L = int(ctx_lens[rows].max())
        pos = torch.arange(L)
        slots = bt[s].long()[pos // bs] * bs + pos % bs
        k = kernels.kv_rows_as(kc.flatten(0, 1)[slots], torch.float64).transpose(0, 1)   # [Hkv, L, D]
        v = kernels.kv_rows_as(vc.flatten(0, 1)[slots], torch.float64).transpose(0, 1)
        mask = pos[None, :] < ctx_lens[rows].long()[:, None]          # [n, L]: causal offset within the context
        o = F.scaled_dot_product_attention(q[rows].double().transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    return out


IMPLS = {"native": pytest.param(paged_attention, marks=native), "torch": paged_attention_torch}


def ragged(bs):
    # decode-style contexts of 1, one block, two blocks, an odd length; one sequence queried in a chunk of 4 over a
    # prefix (speculative verification / chunked prefill), and one whole short prompt
    return [(1, 1), (bs, 1), (2 * bs, 1), (37, 1), (3 * bs + 5, 4), (5, 5)]


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("D", [24, 64, 128])
@pytest.mark.parametrize("ratio", [1, 3, 4])
def test_fp32_matches_reference(impl, ratio, D, bs):
    Hkv = 2
    case = make_case(ragged(bs), H=Hkv * ratio, Hkv=Hkv, D=D, bs=bs, seed=ratio * 1000 + D + bs)
    scale = D ** -0.5
    out = impl(*case, scale)
    assert out.dtype == torch.float32 and out.shape == case[0].shape
    torch.testing.assert_close(out.double(), reference(*case, scale), **TOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.float16)])
@pytest.mark.parametrize("bs", [1, 16])
def test_low_precision_matches_reference(impl, dtype, cache_dtype, bs):
    case = make_case(ragged(bs), H=9, Hkv=3, D=64, bs=bs, dtype=dtype, cache_dtype=cache_dtype, seed=7)
    out = impl(*case, 0.125)
    assert out.dtype == dtype
    tol = TOL[torch.bfloat16 if torch.bfloat16 in (dtype, cache_dtype) and dtype != torch.float32 else dtype]
    torch.testing.assert_close(out.double(), reference(*case, 0.125), **tol)


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_single_query(impl):
    case = make_case([(1100, 1)], H=9, Hkv=3, D=64, bs=16, seed=3)            # split into 3 chunks
    torch.testing.assert_close(impl(*case, 0.3).double(), reference(*case, 0.3), **TOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_64_queries_decode_batch(impl):
    seqs = [(1 + (17 * i) % 130, 1) for i in range(64)]               # ragged, includes 1 and block multiples
    assert any(L % 16 == 0 for L, _ in seqs) and (1, 1) in seqs
    case = make_case(seqs, H=8, Hkv=2, D=64, bs=16, seed=11)
    torch.testing.assert_close(impl(*case, 0.125).double(), reference(*case, 0.125), **TOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_64_queries_chunk_over_prefix(impl):
    # one sequence: a 64-token chunk after a 100-token cached prefix, plus a decode query of another sequence
    case = make_case([(164, 64), (40, 1)], H=12, Hkv=3, D=128, bs=32, seed=5)
    assert case[0].shape[0] == 65
    torch.testing.assert_close(impl(*case, 0.09).double(), reference(*case, 0.09), **TOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
@pytest.mark.parametrize("D", [24, 64])
def test_long_context_chunks_merge(impl, D):
    # contexts past the kernel's 512-position split, exactly at it, one past it; a chunk of queries straddling it
    case = make_case([(1024, 1), (512, 1), (513, 1), (530, 30)], H=8, Hkv=2, D=D, bs=16, seed=D)
    torch.testing.assert_close(impl(*case, 0.2).double(), reference(*case, 0.2), **TOL[torch.float32])


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_matches_fallback(dtype):
    case = make_case(ragged(16) + [(200, 3)], H=9, Hkv=3, D=64, bs=16, dtype=dtype, seed=21)
    a, b = paged_attention(*case, 0.125), paged_attention_torch(*case, 0.125)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)   # 1 output ulp
    torch.testing.assert_close(a.float(), b.float(), **tol)


@native
def test_native_same_result_with_any_thread_count():
    case = make_case([(1300, 1), (70, 2), (33, 1)], H=9, Hkv=3, D=64, bs=16, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(*case, 0.125)
        torch.set_num_threads(2)
        two = paged_attention(*case, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)          # each (query, kv head) is one task: no cross-thread reduction


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_head_major_cache_gives_the_same_bits(impl, cache_dtype):
    """The runner's cache is head-major in memory (kernels.kv_blocks); the kernel reads it through its strides and
    must give the position-major result bit for bit (the same values summed in the same order), split chunks and
    one- and all-heads-per-task groupings included (a decode batch of one, and of many)."""
    for seqs in ([(1300, 1)], [(40, 1)] * 9 + [(600, 3)]):
        q, kc, vc, bt, si, cl = make_case(seqs, H=9, Hkv=3, D=64, bs=16, cache_dtype=cache_dtype, seed=5)
        hk, hv = kernels.head_major_copy(kc), kernels.head_major_copy(vc)
        assert hk.stride(2) == 16 * hk.shape[-1] and not hk.is_contiguous()
        assert torch.equal(impl(q, hk, hv, bt, si, cl, 0.125), impl(q, kc, vc, bt, si, cl, 0.125))


@native
def test_native_rejects_bad_tables():
    q, kc, vc, bt, si, cl = make_case([(20, 1)], H=4, Hkv=2, D=24, bs=16, seed=1)
    bad = bt.clone()
    bad[0, 1] = kc.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        paged_attention(q, kc, vc, bad, si, cl, 1.0)
    with pytest.raises(RuntimeError, match="ctx_len exceeds"):
        paged_attention(q, kc, vc, bt, si, cl + 1000, 1.0)
    with pytest.raises(RuntimeError, match="seq_idx out of range"):
        paged_attention(q, kc, vc, bt, si + 1, cl, 1.0)


def test_unavailable_reason_is_stated():
    assert kernels.has_native() == (kernels.NATIVE_UNAVAILABLE_REASON is None)
    if not kernels.has_native():
        assert isinstance(kernels.NATIVE_UNAVAILABLE_REASON, str) and kernels.NATIVE_UNAVAILABLE_REASON


def test_matches_the_runner_attention():
    """The fallback against today's gather + SDPA path in warmstart.runner.attention (its default scale)."""
    from warmstart.runner.attention import _attend
    q, kc, vc, bt, si, cl = make_case([(50, 6)], H=6, Hkv=2, D=32, bs=16, seed=9)
    pos = torch.arange(50)
    slots = bt[0].long()[pos // 16] * 16 + pos % 16
    want = _attend(q, kc.flatten(0, 1)[slots], vc.flatten(0, 1)[slots], 6)
    torch.testing.assert_close(paged_attention(q, kc, vc, bt, si, cl, 32 ** -0.5), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len", [40, 12])
def test_runner_prefill_attention_takes_the_flash_kernel(q_len):
    """A fresh prompt (causal) and a chunk over a prefix (mask) must reach torch's CPU flash-attention kernel: with
    3-D inputs SDPA silently takes its math path instead (the full score matrix; 8x slower at 2,000 tokens). The
    result equals explicit softmax attention."""
    from torch.profiler import ProfilerActivity, profile
    from warmstart.runner.attention import _attend
    torch.manual_seed(q_len)
    q, k, v = torch.randn(q_len, 6, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = _attend(q, k, v, q_len)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, sorted(names)
    kk, vv = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)            # [ctx, H, D]
    s = torch.einsum("qhd,khd->hqk", q, kk) * 32 ** -0.5
    pos = torch.arange(40 - q_len, 40)[:, None] >= torch.arange(40)[None, :]
    want = torch.einsum("hqk,khd->qhd", s.masked_fill(~pos, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# The kernel register-blocks up to 3 query heads of a group per pass over a tile of 32 positions (groups of 5 and 7
# run as 3+2 and 3+3+1), handles head_dim in 8-lane vectors plus a scalar tail, converts bf16/fp16 rows in registers,
# and prefetches the next tile: contexts just under, at and over a tile and over the 512-position split.
TILE_EDGES = [(31, 1), (32, 1), (33, 1), (64, 1), (65, 2), (600, 1), (1, 1)]


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
@pytest.mark.parametrize("D", [20, 36, 72])
@pytest.mark.parametrize("ratio", [1, 2, 5, 7])
def test_odd_head_dims_and_group_sizes(impl, ratio, D):
    case = make_case(TILE_EDGES, H=2 * ratio, Hkv=2, D=D, bs=16, seed=ratio * 100 + D)
    scale = D ** -0.5
    torch.testing.assert_close(impl(*case, scale).double(), reference(*case, scale), **TOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,ratio", [(20, 1), (64, 3), (36, 5)])
def test_half_caches_odd_shapes(impl, cache_dtype, D, ratio):
    case = make_case(TILE_EDGES, H=3 * ratio, Hkv=3, D=D, bs=16, dtype=torch.float32, cache_dtype=cache_dtype,
                     seed=D + ratio)
    out = impl(*case, 0.2)
    torch.testing.assert_close(out.double(), reference(*case, 0.2), **TOL[torch.float32])   # fp32 math on the rounded cache


def int8_kernel_query(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """The query as the compiled kernel's integer q.k sees it for an int8 cache whose head dim is a multiple of 16 (at
    most 256): q * scale per (token, head) rounded to int16 codes with step max|q * scale| / 32767. Returns the
    rounded, already-scaled query and the scale (1.0) to attend with; other head dims: q and scale unchanged."""
    D = q.shape[-1]
    if D % 16 or D > 256:
        return q, scale
    x = q.float() * scale                                        # float32 products and divisions, as the kernel
    amax = x.abs().amax(-1, keepdim=True)
    # a float32 division, as the kernel's (a number divided by a tensor is a reciprocal times it in torch: 1 ulp off)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767) / torch.where(amax > 0, amax, 1), 0)
    codes = (x * inv).round().clamp(-32767, 32767)
    return codes * (amax / 32767), 1.0


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
@pytest.mark.parametrize("D,ratio", [(20, 1), (36, 5), (64, 1), (64, 2), (64, 3), (128, 4), (32, 7), (256, 3)])
def test_int8_cache_equals_attention_over_its_dequantized_values(impl, D, ratio):
    """The int8 cache's only error is the quantization itself: attention over the int8 rows equals fp32 attention
    over the values they decode to (codes * scale), past the kernel's split and across tile edges. The compiled
    kernel's integer q.k (head dims that are multiples of 16) also rounds each query head to int16 codes: against a
    reference over that rounded query it is within fp32 rounding (1e-5), and the rounding itself moves outputs by
    under 1e-3 here (a score error of about sqrt(D) * step * |k|, step = max|q| / 32767), a hundredth of what the
    int8 cache's own rounding does."""
    case = make_case(TILE_EDGES + [(530, 3)], H=3 * ratio, Hkv=3, D=D, bs=16, cache_dtype=torch.int8,
                     seed=D + 7 * ratio)
    assert case[1].dtype is torch.int8 and case[1].shape[-1] == D + kernels.KV_SCALE_BYTES
    out = impl(*case, 0.2).double()
    q, rest = case[0], case[1:]
    if impl is paged_attention and kernels.has_native():
        q_seen, scale_seen = int8_kernel_query(q, 0.2)
        torch.testing.assert_close(out, reference(q_seen, *rest, scale_seen), **TOL[torch.float32])
        torch.testing.assert_close(out, reference(q, *rest, 0.2), rtol=0, atol=1e-3)
    else:
        torch.testing.assert_close(out, reference(q, *rest, 0.2), **TOL[torch.float32])


@native
@pytest.mark.parametrize("D", [64, 256])
def test_int8_integer_path_extremes(D):
    """The integer q.k at its largest: every K code +-127 along the query's signs (q.k = 32767 * 127 * D before
    scaling, inside int32 up to D = 256), one position far below the rest, V codes at +-127; and at a large softmax
    scale (one dominant position, many tiny probabilities)."""
    case = make_case([(700, 1), (33, 1), (2, 1)], H=6, Hkv=2, D=D, bs=16, seed=D)
    q, kc, vc, bt, si, cl = case
    sign = torch.where(q[:, ::3] >= 0, 1, -1).to(torch.int8)                 # kv head g serves queries 3g..3g+2
    kc[..., :D] = 127 * sign[0].unsqueeze(0).unsqueeze(0)
    kc[3, 5, :, :D] = -kc[3, 5, :, :D]                                     # one position far below the rest
    vc[..., :D] = torch.where(torch.arange(D) % 3 == 0, 127, -127).to(torch.int8)
    vc[bt[0, 7], 2, 1, :D] = 5
    for scale in (1.0, 50.0):
        q_seen, scale_seen = int8_kernel_query(q, scale)
        torch.testing.assert_close(paged_attention(*case, scale).double(), reference(q_seen, *case[1:], scale_seen),
                                   **TOL[torch.float32])


def test_int8_rows_round_trip_within_half_a_step():
    scales = torch.logspace(-3, 3, 50)[:, None, None]
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * scales
    x[7, 1] = 0                                              # an all-zero row: scale 0, codes 0
    rows = kernels.quantize_kv_rows(x)
    back = kernels.kv_rows_as(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + x.abs() * 2 ** -23).all()     # + float32 rounding of codes * scale
    assert torch.equal(back[7, 1], torch.zeros(64))
    assert rows[..., :64].abs().max() == 127                 # every nonzero row uses the full code range


@native
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_native_query_alone_equals_query_in_a_batch(cache_dtype):
    """A big batch runs all kv heads of an item in one task, a lone query one kv head per task: same arithmetic per
    (query, kv head), so bit-identical results."""
    case = make_case([(700, 1)] + [(40 + i, 1) for i in range(15)], H=9, Hkv=3, D=64, bs=16, cache_dtype=cache_dtype,
                     seed=4)
    q, kc, vc, bt, si, cl = case
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)          # 17 work items: all heads per task; 2: one head per task
        batch = paged_attention(*case, 0.125)
        alone = paged_attention(q[:1], kc, vc, bt, si[:1], cl[:1], 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch[:1], alone)


@native
@pytest.mark.skipif(kernels.qlinear_isa() not in ("avx512-vnni", "amx-bf16"),
                    reason="no AVX-512 VNNI on this CPU: only the 8-lane step runs")
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32])
@pytest.mark.parametrize("D,ratio", [(64, 3), (128, 4), (96, 1), (32, 7), (48, 2)])
def test_int8_16_lane_step_equals_the_8_lane_one(cache_dtype, D, ratio):
    """An int8 cache's 16-lane step (paged_attention_avx512.h: CPUs with AVX-512 VNNI, head dims that are multiples
    of 32) against the 8-lane one (WARMSTART_KERNEL_ISA=avx2) on the same case: bit-identical, as the integer q.k is
    exact in both and P.V sums the same products in the same order in every lane. (Float caches and other head dims
    run the 8-lane step either way: the float32 cases check that the ISA switch leaves them alone.) Equal results
    cannot show which step ran, so the kernel's own choice (paged_int8_lanes) is asserted under each ISA, and the
    16-lane result is checked against the reference too."""
    case = make_case(TILE_EDGES + [(1100, 2)], H=3 * ratio, Hkv=3, D=D, bs=16, cache_dtype=cache_dtype,
                     seed=D + ratio)
    before = kernels.qlinear_isa()
    try:
        assert kernels.paged_int8_lanes(D) == (16 if D % 32 == 0 else 8)
        wide = paged_attention(*case, 0.125)
        assert kernels.set_qlinear_isa("avx2") == "avx2"
        assert kernels.paged_int8_lanes(D) == 8
        narrow = paged_attention(*case, 0.125)
    finally:
        kernels.set_qlinear_isa(before)
    assert kernels.qlinear_isa() == before
    assert torch.equal(wide, narrow)
    if cache_dtype is torch.int8:
        q_seen, scale_seen = int8_kernel_query(case[0], 0.125)
        torch.testing.assert_close(wide.double(), reference(q_seen, *case[1:], scale_seen), **TOL[torch.float32])
