"""The decode step's fused glue (kernels/csrc/fused.h) against plain torch ops doing the same math: row counts on
both sides of the threading grain, strided views like the ones the decoder passes (q/k/v split from one fused
projection), every cache dtype, and the torch fallback for inputs the compiled path does not take."""
import pytest
import torch
import torch.nn.functional as F

from warmstart import kernels

pytestmark = pytest.mark.skipif(not kernels.has_fused(), reason=f"fused kernels not built: "
                                f"{kernels.FUSED_UNAVAILABLE_REASON}")

ROWS = (1, 3, 17, 40)


def _rms_ref(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(rows, with_residual):
    d, eps = 576, 1e-5
    x, w = torch.randn(rows, d), torch.randn(d)
    residual = torch.randn(rows, d) if with_residual else None
    h_want = x + residual if with_residual else x.clone()
    out, h = kernels.add_rms_norm(x, residual, w, eps)
    assert torch.allclose(h, h_want, atol=1e-6)
    if with_residual:
        assert h is residual                    # the compiled path carries the residual stream in place
    assert torch.allclose(out, _rms_ref(h_want, w, eps), atol=2e-5, rtol=1e-5)


def test_add_rms_norm_strided_rows():
    x = torch.randn(5, 2 * 64)[:, :64]          # rows of stride 128
    out, _ = kernels.add_rms_norm(x, None, torch.ones(64), 1e-6)
    assert torch.allclose(out, _rms_ref(x, torch.ones(64), 1e-6), atol=2e-5)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_in_place_on_split_views(rows):
    h, hkv, d = 9, 3, 64
    qkv = torch.randn(rows, (h + 2 * hkv) * d)
    q, k, v = qkv.split((h * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(rows, h, d), k.view(rows, hkv, d), v.view(rows, hkv, d)
    ang = torch.randn(rows, 1, d)
    cos, sin = ang.cos(), ang.sin()
    q_want, k_want, v_before = _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin), v.clone()
    q_out, k_out = kernels.rotary_(q, cos, sin), kernels.rotary_(k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr()     # rotated in place, inside the fused projection's output
    assert torch.allclose(q_out, q_want, atol=1e-5) and torch.allclose(k_out, k_want, atol=1e-5)
    assert torch.equal(v, v_before)             # v shares the buffer and is untouched


def _caches(blocks, bs, hkv, width, dtype, head_major):
    """A zeroed [blocks, bs, hkv, width] cache pair, position-major or laid out as the runner's (kernels.kv_blocks)."""
    if not head_major:
        return tuple(torch.zeros(blocks, bs, hkv, width, dtype=dtype) for _ in range(2))
    return tuple(kernels.head_major_copy(torch.zeros(blocks, bs, hkv, width, dtype=dtype)) for _ in range(2))


def _written(cache, slots, rows):
    """What write_kv must leave: the cache with `rows` at `slots` (flat slot order), built without write_kv."""
    want = cache.contiguous().clone()
    want.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
    return want


@pytest.mark.parametrize("head_major", (False, True), ids=("position-major", "head-major"))
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", (1, 7))
def test_write_kv(cache_dtype, rows, head_major):
    hkv, d, blocks, bs = 3, 64, 10, 5
    kv = torch.randn(rows, 2 * hkv * d)
    k, v = (t.view(rows, hkv, d) for t in kv.split((hkv * d, hkv * d), dim=-1))
    slots = torch.randperm(blocks * bs)[:rows]
    kc, vc = _caches(blocks, bs, hkv, d, cache_dtype, head_major)
    kc_want, vc_want = _written(kc, slots, k.to(cache_dtype)), _written(vc, slots, v.to(cache_dtype))
    kernels.write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_want) and torch.equal(vc, vc_want)   # same rounding (to nearest even) as .to()


@pytest.mark.parametrize("head_major", (False, True), ids=("position-major", "head-major"))
@pytest.mark.parametrize("rows", (1, 7))
def test_write_kv_int8_rows_are_the_torch_paths_bytes(rows, head_major):
    """The compiled int8 write (csrc/fused.h write_rows_i8) and kernels.quantize_kv_rows write the same bytes:
    codes and float32 scale, rows of widely different magnitudes and an all-zero row included."""
    hkv, d, blocks, bs = 3, 64, 10, 5
    kv = torch.randn(rows, 2 * hkv * d) * torch.logspace(-2, 2, rows)[:, None]
    kv[0, :d] = 0
    k, v = (t.view(rows, hkv, d) for t in kv.split((hkv * d, hkv * d), dim=-1))
    slots = torch.randperm(blocks * bs)[:rows]
    kc, vc = _caches(blocks, bs, hkv, d + kernels.KV_SCALE_BYTES, torch.int8, head_major)
    kc_want = _written(kc, slots, kernels.quantize_kv_rows(k))
    vc_want = _written(vc, slots, kernels.quantize_kv_rows(v))
    kernels.write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_want) and torch.equal(vc, vc_want)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_write_kv_torch_path_writes_a_head_major_cache_in_place(cache_dtype, monkeypatch):
    """The fallback (no compiled kernels, or a GPU) writes through the strided view into the cache's storage."""
    monkeypatch.setattr(kernels.fused, "_use_fused", lambda *t: False)
    hkv, d, blocks, bs = 3, 64, 10, 5
    width = d + kernels.KV_SCALE_BYTES if cache_dtype is torch.int8 else d
    k, v = torch.randn(4, hkv, d), torch.randn(4, hkv, d)
    slots = torch.tensor([0, 7, 12, 49])
    kc, vc = _caches(blocks, bs, hkv, width, cache_dtype, True)
    conv = kernels.quantize_kv_rows if cache_dtype is torch.int8 else (lambda t: t.to(cache_dtype))
    kc_want, vc_want = _written(kc, slots, conv(k)), _written(vc, slots, conv(v))
    kernels.write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_want) and torch.equal(vc, vc_want)


def test_write_kv_rejects_a_slot_outside_the_cache():
    k = torch.randn(1, 3, 64)
    kc, vc = torch.zeros(2, 2, 3, 64), torch.zeros(2, 2, 3, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.write_kv(k, k.clone(), kc, vc, torch.tensor([4]))


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(rows):
    x = torch.randn(rows, 2 * 1536) * 4
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(kernels.silu_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_silu_mul_extremes():
    """The vectorized exp clamps its input at +-88.4: SiLU must still give x for large x, 0 (not NaN) for very
    negative x, and stay exact around 0 and for non-multiple-of-8 widths (the scalar tail)."""
    gate = torch.tensor([[-1e4, -200.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 3.0, 20.0, 88.0, 200.0, 1e4, -5.0]])
    x = torch.cat([gate, torch.ones_like(gate)], dim=1)
    got = kernels.silu_mul(x)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, F.silu(gate), atol=1e-6, rtol=1e-5)


def test_float16_inputs_take_the_torch_path():
    """float16 activations (and CUDA, and torch.compile tracing) use the torch ops: same results as the reference."""
    x, w = torch.randn(4, 64, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    out, h = kernels.add_rms_norm(x, None, w, 1e-6)
    assert out.dtype == torch.float16 and h is x
    assert torch.equal(out, w * F.rms_norm(x.float(), (64,), eps=1e-6).to(x.dtype))
    y = torch.randn(4, 128, dtype=torch.float16)
    assert torch.equal(kernels.silu_mul(y), F.silu(y[:, :64]) * y[:, 64:])
    with pytest.raises(RuntimeError):                  # and the compiled kernels refuse it outright
        kernels._fused.silu_mul(y)


def _close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 results of the same math with the same roundings: within two bfloat16 steps of the torch ops' (an
    fp32 sum in another order, or another exp, may move an intermediate rounding by one step, and the next op's
    rounding by one more), and nearly all of them equal."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.float().abs() * 2.0 ** -7 + 1e-30
    assert ((got.float() - want.float()).abs() <= 2 * step).all()
    assert (got == want).float().mean().item() > 0.98       # 300 seeds: at least 0.997; rotary, silu exact


@pytest.mark.parametrize("rows", ROWS)
def test_bfloat16_glue_rounds_as_the_torch_ops(rows):
    """A bfloat16 model's decode step runs the compiled glue too (and the decoder stack with it): each op's result
    rounded to bfloat16 where the torch reference rounds it."""
    torch.manual_seed(rows)
    bf = torch.bfloat16
    d, eps = 576, 1e-5
    x, w, res = torch.randn(rows, d, dtype=bf), torch.randn(d, dtype=bf), torch.randn(rows, d, dtype=bf)
    h_want = x + res
    want = w * F.rms_norm(h_want.float(), (d,), eps=eps).to(bf)
    out, h = kernels.add_rms_norm(x, res, w, eps)
    assert h is res and torch.equal(h, h_want)           # the residual add is one bfloat16 add, in place
    _close_in_bf16(out, want)
    out0, h0 = kernels.add_rms_norm(x, None, w, eps)
    assert h0 is x
    _close_in_bf16(out0, w * F.rms_norm(x.float(), (d,), eps=eps).to(bf))

    heads, hd = 9, 64
    q = torch.randn(rows, heads * hd, dtype=bf).view(rows, heads, hd)
    ang = torch.randn(rows, 1, hd)
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    q_want = _rotate_ref(q, cos, sin)
    _close_in_bf16(kernels.rotary_(q, cos, sin), q_want)

    g = torch.randn(rows, 2 * 1536, dtype=bf) * 4
    _close_in_bf16(kernels.silu_mul(g), F.silu(g[:, :1536]) * g[:, 1536:])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8])
def test_write_kv_from_bfloat16(cache_dtype):
    rows, hkv, d, slots_total = 5, 3, 64, 50
    k, v = (torch.randn(rows, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(slots_total)[:rows]
    width = d + kernels.KV_SCALE_BYTES if cache_dtype is torch.int8 else d
    kc, vc = _caches(slots_total // 5, 5, hkv, width, cache_dtype, True)
    conv = kernels.quantize_kv_rows if cache_dtype is torch.int8 else (lambda t: t.to(cache_dtype))
    kc_want, vc_want = _written(kc, slots, conv(k)), _written(vc, slots, conv(v))
    kernels._fused.write_kv(k, v, kc, vc, slots)      # the compiled path itself
    assert torch.equal(kc, kc_want) and torch.equal(vc, vc_want)


@pytest.mark.parametrize("rows", (1, 5, 33))
@pytest.mark.parametrize("vocab", (1, 7, 8, 49152, 49157))
def test_argmax_is_torchs_index(rows, vocab):
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    x = torch.randn(rows, vocab, generator=g)
    assert kernels.argmax(x) == x.argmax(dim=-1).tolist()
    # a strided view (rows of a wider tensor), as the runner passes a slice of the logits
    wide = torch.randn(rows, vocab + 3, generator=g)[:, :vocab]
    assert kernels.argmax(wide) == wide.argmax(dim=-1).tolist()


def test_argmax_ties_nans_and_infinities_follow_torch():
    v = 49155                                                      # 3 past a multiple of 8: a scalar tail
    x = torch.full((7, v), -1.0)
    x[0, 9000] = x[0, 100] = x[0, 40000] = 5.0                     # a tie: the first maximum
    x[1, 30000] = float("nan"); x[1, 20000] = float("nan")        # NaN counts as the maximum, the first one
    x[1, 5] = float("inf")
    x[2] = float("-inf")                                           # all -inf: index 0
    x[3, v - 1] = 2.0                                              # the maximum in the scalar tail
    x[4, 0] = -0.0; x[4, 1:] = -1.0; x[4, 3] = 0.0                 # -0.0 == 0.0: the first of them
    x[5, v - 2] = float("nan")                                     # a NaN in the tail only
    x[6, 3] = float("inf")
    assert kernels.argmax(x) == x.argmax(dim=-1).tolist() == [100, 20000, 0, v - 1, 0, v - 2, 3]


def test_argmax_of_other_dtypes_takes_the_torch_path():
    x = torch.randn(3, 100).to(torch.bfloat16)
    assert kernels.argmax(x) == x.argmax(dim=-1).tolist()
