"""Quantized linears against their dequantized reference, and GGUF block decoders against the gguf package."""
import gguf
import numpy as np
import pytest
import torch

from warmstart.models import quant
from warmstart.weights.gguf_quant import Q, canonical
from warmstart.weights.quantize import postprocess

# Kernels take bfloat16 activations (8 bits of mantissa): outputs agree with the float32 reference to about 2^-8 of
# the output scale. Stated per output as a fraction of the largest |reference| output.
REL_TOL = 1.5e-2


def _check_linear(canon: dict, n: int, k: int, bias: torch.Tensor | None = None):
    ready = quant.prepare(canon)
    tensors = {f"l.{name}": t for name, t in ready.items()}
    if bias is not None:
        tensors["l.bias"] = bias
    module = quant.make_linear(tensors, "l", k, n)
    want = quant.NativeQuantLinear if quant.native_kernel() else (quant.Int4Linear, quant.Int8Linear)
    assert isinstance(module, want)
    # The dequantized weight the kernel multiplies by equals the canonical weight up to bfloat16 scales.
    ref_w = quant.dequantize(canon)
    assert module.dequantized().shape == (n, k)
    assert torch.allclose(module.dequantized(), ref_w, atol=1e-2 * ref_w.abs().max().item(), rtol=0)
    for rows in (1, 5, 11, 70, 260):   # int8 activations; the float32 panel kernel (8+); torch's GEMM (256+)
        x = torch.randn(rows, k)
        y, ref = module(x), quant.reference_linear(module, x)
        assert y.shape == (rows, n) and y.dtype == x.dtype
        assert (y - ref).abs().max() <= REL_TOL * ref.abs().max(), (rows, (y - ref).abs().max())


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch):
    """Both kernels: warmstart's compiled one (skipped where it is not built) and torch's."""
    from warmstart.kernels import has_qlinear
    if request.param == "native" and not has_qlinear():
        pytest.skip("the compiled quantized-linear kernel is not built here")
    monkeypatch.setattr(quant, "native_kernel", lambda: request.param == "native")
    return request.param


@pytest.mark.parametrize("n,k", [(16, 32), (7, 64), (33, 96), (192, 576), (1, 32)])
def test_int8_linear_matches_reference(n, k, kernel):
    torch.manual_seed(n * k)
    _check_linear(quant.quantize_int8(torch.randn(n, k)), n, k, bias=torch.randn(n))


@pytest.mark.parametrize("n,k", [(16, 32), (7, 64), (33, 96), (192, 576), (1, 32)])
def test_int4_linear_matches_reference(n, k, kernel):
    torch.manual_seed(n * k)
    _check_linear(quant.quantize_int4(torch.randn(n, k)), n, k)


def test_int4_groups_are_independent():
    """A huge value in one group must not change another group's codes (group boundaries are right)."""
    w = torch.randn(16, 96)
    w2 = w.clone()
    w2[:, 40] = 1000.0                                   # group 1 only (features 32..63)
    a, b = quant.quantize_int4(w), quant.quantize_int4(w2)
    qa, qb = quant.unpack_nibbles(a["qweight"]), quant.unpack_nibbles(b["qweight"])
    assert torch.equal(qa[:, :32], qb[:, :32]) and torch.equal(qa[:, 64:], qb[:, 64:])
    assert not torch.equal(qa[:, 32:64], qb[:, 32:64])
    assert torch.allclose(quant.dequantize(a)[:, 64:], w[:, 64:], atol=0.5)


def test_nibble_packing_round_trips():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(quant.unpack_nibbles(quant.pack_nibbles(q)), q)


def _gguf_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    if qtype == Q.Q4_K:   # the gguf package cannot quantize K-quants: random blocks with sane fp16 scales
        raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
        raw[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)
        raw[..., 2:4] = np.array([0.004], np.float16).view(np.uint8)
        return raw.reshape(rows, -1)
    return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0])
def test_gguf_exact_formats_decode_like_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 6, 512
    raw = _gguf_blocks(qtype, rows, cols, rng)
    ref = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(rows, cols)
    parts = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in canonical(raw, qtype, rows, cols).items()}
    assert np.array_equal(quant.dequantize(parts).numpy(), ref)          # exact: the file's codes and scales
    expected_bits = 4 if qtype != Q.Q8_0 else 8
    assert parts["qweight"].numel() * 8 == rows * cols * expected_bits


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_gguf_other_formats_requantize_to_int8(qtype):
    rng = np.random.default_rng(1)
    raw = _gguf_blocks(qtype, 4, 256, rng)
    ref = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(4, 256)
    parts = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in canonical(raw, qtype, 4, 256).items()}
    assert parts["qweight"].dtype == torch.int8 and parts["scales"].shape == (4,)
    err = np.abs(quant.dequantize(parts).numpy() - ref)
    assert (err <= np.abs(ref).max(axis=1, keepdims=True) / 254 + 1e-6).all()   # half an int8 step per row


def test_q8_0_group_scales_stay_exact_on_the_native_kernel(kernel):
    q = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    # a scale per block of 32, as Q8_0 stores it: float16 values (the native kernel keeps them in float16)
    canon = {"qweight": q, "scales": (torch.rand(16, 2) + 0.1).half().float()}
    module = quant.make_linear({f"l.{k}": v for k, v in quant.prepare(canon).items()}, "l", 64, 16)
    exact = torch.equal(module.dequantized(), quant.dequantize(canon))
    assert exact == (kernel == "native")        # torch's int8 kernel takes one scale per row: re-quantized


def test_postprocess_modes_keep_names_and_shrink_bytes(kernel):
    torch.manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(64, 96), "model.layers.0.mlp.up_proj.weight": torch.randn(224, 96),
         "model.layers.0.mlp.down_proj.weight": torch.randn(96, 224), "model.norm.weight": torch.ones(96)}
    none = postprocess(dict(t), torch.float32, "none")
    assert none.keys() == t.keys()
    int8 = postprocess(dict(t), torch.float32, "int8")
    # tied (no lm_head): the embedding is quantized once, as the LM head's int8 table
    assert "model.embed_tokens.qweight" in int8 and "model.embed_tokens.weight" not in int8
    int4 = postprocess(dict(t), torch.float32, "int4")
    int4_part = "mins" if kernel == "native" else "scales_zeros"
    assert f"model.layers.0.mlp.up_proj.{int4_part}" in int4
    assert f"model.layers.0.mlp.down_proj.{int4_part}" in int4
    assert "model.embed_tokens.scales" in int4            # LM head / tied embedding stay int8
    nbytes = lambda d: sum(v.numel() * v.element_size() for v in d.values())
    assert nbytes(int4) < nbytes(int8) < nbytes(none)


def _compiled_case(kind: str, n: int, k: int, rows: int):
    """The compiled kernel's arguments (x [rows, k] and a random [n, k] weight quantized as `kind`) and x times the
    weight they stand for (float16 scales and mins, as prepared); skips where the kernel is not built."""
    from warmstart import kernels
    if not kernels.has_qlinear():
        pytest.skip("the compiled quantized-linear kernel is not built here")
    w = torch.randn(n, k)
    canon = quant.quantize_int4(w) if kind == "int4" else quant.quantize_int8(w)
    ready = quant.prepare(canon)
    x = torch.randn(rows, k)
    return (x, ready["qweight"], ready["scales"], ready.get("mins")), x @ quant.dequantize(ready).t()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_dense_path_equals_the_dequantized_weight_across_tiles(kind):
    """From DENSE_MIN_ROWS rows on the kernel expands the weight to float32 in tiles of output columns: with K this
    large a tile is 64 rows, so N = 130 spans three tiles, the last one partial."""
    from warmstart import kernels
    args, want = _compiled_case(kind, 130, 32768, kernels.DENSE_MIN_ROWS)
    y = kernels.qlinear(*args, panel_min_rows=0)    # (on AMX the panel route takes these rows when it is on)
    assert torch.allclose(y, want, atol=1e-3 * want.abs().max().item(), rtol=0)
    y_int8_act = kernels.qlinear(*args, dense_min_rows=0, panel_min_rows=0)
    assert (y_int8_act - want).abs().max() > (y - want).abs().max()     # the dense path really ran: it is exact


def _int8_activation_reference(x: torch.Tensor, ready: dict) -> torch.Tensor:
    """What the int8-activation route computes, in float64 from its integer parts: x quantized per row and block of
    32 (scale max|x| / 127 in float32, codes x * (1 / scale) rounded half to even), each block's integer dot product
    with the weight codes, times the weight block's scale and the activation's; plus, for int4, the block's min times
    its code sum times the activation scale."""
    n, nb = ready["scales"].shape
    xb = x.view(x.shape[0], nb, 32)
    d = xb.abs().amax(-1) / 127.0                                           # float32, as the kernel
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(xb * inv[..., None]).to(torch.int64)              # [M, nb, 32]
    if "mins" in ready:
        packed = ready["qweight"].to(torch.int64)                          # element 2i in the low nibble of byte i
        q = torch.stack([packed & 0x0F, packed >> 4], -1).view(n, nb, 32)
    else:
        q = ready["qweight"].to(torch.int64).view(n, nb, 32)
    isum = torch.einsum("mbk,nbk->mnb", codes, q).double()                 # exact integer sums
    y = (isum * ready["scales"].double()[None] * d.double()[:, None, :]).sum(-1)
    if "mins" in ready:
        y += (ready["mins"].double()[None] * (codes.sum(-1).double() * d.double())[:, None, :]).sum(-1)
    return y


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (33, 576), (9, 1536), (5, 4128)])
def test_int8_activation_route_is_its_integer_math(kind, n, k):
    """Below PANEL_MIN_ROWS the kernel rounds the activations to int8 codes and sums integer products per block:
    its output equals that math (in float64) to float32 accumulation error. A code off by one in any block, or a
    layout that pairs the wrong codes with the wrong nibbles, misses by orders of magnitude more. Odd block counts
    (96, 32: the AVX2 route's half-empty last pair) and K = 4128 (129 blocks: past its 128-block factor chunk)."""
    from warmstart import kernels
    args, _ = _compiled_case(kind, n, k, 7)
    x, qweight, scales, mins = args
    ready = {"qweight": qweight, "scales": scales, **({"mins": mins} if mins is not None else {})}
    for rows in range(1, 8):
        y = kernels.qlinear(x[:rows].contiguous(), qweight, scales, mins).double()
        want = _int8_activation_reference(x[:rows], ready)
        assert (y - want).abs().max() <= 1e-5 * want.abs().max(), (rows, (y - want).abs().max())


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("n,k", [(13, 96), (9, 576), (6, 4128)])
def test_int8_activation_route_gives_a_row_the_same_bits_in_any_batch(kind, n, k):
    """Decode batches of 1-7 rows run one weight row against 4, 3, 2 or 1 activation rows at a time (and one row
    against pairs of weight rows): each activation row's result is the same float operations in the same order
    whichever tile it lands in, and whatever the thread count, so a sequence's logits do not depend on its batch."""
    from warmstart import kernels
    args, _ = _compiled_case(kind, n, k, 7)
    x, rest = args[0], args[1:]
    full = kernels.qlinear(x, *rest)
    for rows in range(1, 8):
        for first in range(0, 8 - rows):
            assert torch.equal(kernels.qlinear(x[first:first + rows].contiguous(), *rest), full[first:first + rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.qlinear(x, *rest), full)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def isa():
    """Sets the kernels' ISA level for a test (at most the CPU's: set returns the level in force) and restores it."""
    from warmstart import kernels
    if not kernels.has_qlinear():
        pytest.skip("the compiled quantized-linear kernel is not built here")
    before = kernels.qlinear_isa()
    yield kernels.set_qlinear_isa
    kernels.set_qlinear_isa(before)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows", [8, 11, 64, 255])
def test_panel_path_equals_the_dequantized_weight(kind, rows, isa):
    """From PANEL_MIN_ROWS rows the kernel expands 48 weight rows at a time and multiplies them in registers, 4 x
    rows by 3 weight rows: N = 130 spans three panels (the last partial, 34 rows: not a multiple of 3) and the row
    counts leave every remainder of 4. The float32 route (AVX2 or AVX-512, below AMX) is exact."""
    from warmstart import kernels
    assert isa("avx512-vnni") in ("avx512-vnni", "avx2")
    args, want = _compiled_case(kind, 130, 320, rows)
    y = kernels.qlinear(*args, panel_min_rows=kernels.PANEL_MIN_ROWS)   # (VNNI's default keeps int8 activations)
    assert torch.allclose(y, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    y_int8_act = kernels.qlinear(*args, dense_min_rows=0, panel_min_rows=0)
    assert (y_int8_act - want).abs().max() > 10 * (y - want).abs().max()   # the panel path really ran


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows", [8, 11, 17, 32, 64, 255, 256, 300, 600])
def test_amx_panel_route_is_within_bfloat16_rounding(kind, rows, isa):
    """On AMX the panel route multiplies bfloat16 weights (32-row panels, two tiles) by bfloat16 activations (16-row
    tiles, padded), from PANEL_MIN_ROWS rows up, 256 at a time. Each product carries two roundings of at most 2^-9
    (relative), so every output is within 2^-7 of sum_k |x w| of the exact value (float32 sums add far less).
    N = 130: four full panels and one of 2 rows (its second tile empty); K = 320: ten tile steps; the row counts
    leave odd tile counts and partial tiles, and 300 / 600 cross the 256-row slices. Also: the dense route's float32
    GEMM no longer takes 256+ rows while the panel route is on."""
    from warmstart import kernels
    if isa("amx-bf16") != "amx-bf16":
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 tiles")
    args, want = _compiled_case(kind, 130, 320, rows)
    x, qweight, scales, mins = args
    ref_w = quant.dequantize({"qweight": qweight, "scales": scales, **({"mins": mins} if mins is not None else {})})
    y = kernels.qlinear(*args)
    bound = 2.0 ** -7 * (x.abs() @ ref_w.abs().t())
    err = (y - want).abs()
    assert (err <= bound + 1e-6).all(), (err / bound).max()
    assert err.max() > 0                                   # rounded: not the float32 route
    exact = kernels.qlinear(*args, panel_min_rows=0, dense_min_rows=1)      # the float32 GEMM route, still there
    assert torch.allclose(exact, want, atol=1e-4 * want.abs().max().item(), rtol=0)
    isa("avx512-vnni")
    y32 = kernels.qlinear(*args, panel_min_rows=kernels.PANEL_MIN_ROWS)   # below AMX: the exact float32 panels
    assert (y32 - want).abs().max() < err.max()


@pytest.fixture
def vnni():
    """The AVX-512 VNNI integer kernels (csrc/qlinear_vnni.h), restored afterwards; skipped where the CPU lacks
    them (the AVX2 ones are then what every other test here runs)."""
    from warmstart import kernels
    if not kernels.has_qlinear():
        pytest.skip("the compiled quantized-linear kernel is not built here")
    before = kernels.qlinear_isa()
    if kernels.set_qlinear_isa("avx512-vnni") != "avx512-vnni":
        kernels.set_qlinear_isa(before)
        pytest.skip("this CPU has no AVX-512 VNNI")
    yield kernels
    kernels.set_qlinear_isa(before)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (33, 64), (130, 320), (50, 1536), (9, 160)])
def test_vnni_route_equals_the_avx2_route(vnni, kind, n, k):
    """Same activation codes and block scales, the same integer sums: the two ISAs differ only in the order of the
    float accumulation. Odd block counts (96, 160, 32) take the half-empty last pair; n not a multiple of 4 takes
    the single-row tiles; 1-7 rows take every activation-row tile (4, 3, 2, 1); 8, 11 and 70 rows the float32
    panel route (AVX-512: 4 x 6 tiles; n = 130 leaves every remainder of 6 and of 3), asked for from
    PANEL_MIN_ROWS on both ISAs (VNNI's own default keeps int8 activations further: the next test)."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k)
    canon = quant.quantize_int4(w) if kind == "int4" else quant.quantize_int8(w)
    ready = quant.prepare(canon)
    ref_w = quant.dequantize(ready)
    for rows in (*range(1, 8), 8, 11, 70):
        x = torch.randn(rows, k)
        args = (x, ready["qweight"], ready["scales"], ready.get("mins"))
        assert vnni.set_qlinear_isa("avx2") == "avx2"
        a = vnni.qlinear(*args, panel_min_rows=vnni.PANEL_MIN_ROWS)
        assert vnni.set_qlinear_isa("avx512-vnni") == "avx512-vnni"
        b = vnni.qlinear(*args, panel_min_rows=vnni.PANEL_MIN_ROWS)
        assert (a - b).abs().max() <= 1e-5 * a.abs().max(), (rows, (a - b).abs().max())
        ref = x @ ref_w.t()
        assert (b - ref).abs().max() <= REL_TOL * ref.abs().max()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_vnni_keeps_int8_activations_up_to_its_measured_crossover(vnni, kind):
    """On AVX-512 VNNI without AMX the int8-activation route beats the float32 panels further up (measured; see
    kernels/__init__.py): by default int4 weights keep it below VNNI_INT4_PANEL_ROWS rows and int8 weights below
    DENSE_MIN_ROWS; AVX2 and AMX take the panel route from PANEL_MIN_ROWS. The default's output equals the chosen
    route's bit for bit, and the two routes' outputs differ (int8 activations are rounded)."""
    cut = vnni.VNNI_INT4_PANEL_ROWS if kind == "int4" else vnni.DENSE_MIN_ROWS
    assert vnni.panel_threshold(kind == "int4") == cut
    for rows in sorted({vnni.PANEL_MIN_ROWS, 32, vnni.VNNI_INT4_PANEL_ROWS - 1, vnni.VNNI_INT4_PANEL_ROWS,
                        vnni.DENSE_MIN_ROWS - 1}):
        args, _ = _compiled_case(kind, 130, 320, rows)
        int8_act = vnni.qlinear(*args, dense_min_rows=0, panel_min_rows=0)
        panel = vnni.qlinear(*args, panel_min_rows=vnni.PANEL_MIN_ROWS)
        assert not torch.equal(int8_act, panel)
        assert torch.equal(vnni.qlinear(*args), int8_act if rows < cut else panel), rows
    assert vnni.set_qlinear_isa("avx2") == "avx2"
    assert vnni.panel_threshold(True) == vnni.panel_threshold(False) == vnni.PANEL_MIN_ROWS


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("n,k", [(13, 96), (9, 576), (6, 1056)])
def test_vnni_one_row_kernel_equals_the_tiles_bit_for_bit(vnni, kind, n, k):
    """A decode step at batch 1 takes its own kernel (each weight row's scales multiplied by the activation's 16
    blocks at a time, then permuted per pair): the same products in the same order as the multi-row tiles, so row 0
    of a 1-row call equals row 0 of a 2-row call exactly. k = 1056 (33 blocks) crosses two 16-block chunks and ends
    on a half-empty pair; n = 13 and 9 leave single-row remainders."""
    torch.manual_seed(n * k)
    ready = quant.prepare(quant.quantize_int4(torch.randn(n, k)) if kind == "int4"
                          else quant.quantize_int8(torch.randn(n, k)))
    x = torch.randn(2, k)
    assert vnni.set_qlinear_isa("avx512-vnni") == "avx512-vnni"
    one = vnni.qlinear(x[:1], ready["qweight"], ready["scales"], ready.get("mins"))
    two = vnni.qlinear(x, ready["qweight"], ready["scales"], ready.get("mins"))
    assert torch.equal(one[0], two[0])


def test_kernel_isa_is_held_by_the_environment():
    """WARMSTART_KERNEL_ISA=avx2 holds a fresh process at AVX2 whatever the CPU has."""
    import subprocess
    import sys
    from warmstart import kernels
    if not kernels.has_qlinear():
        pytest.skip("the compiled quantized-linear kernel is not built here")
    code = "from warmstart import kernels; print(kernels.qlinear_isa())"
    env = {**__import__("os").environ, "WARMSTART_KERNEL_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "avx2"
    env["WARMSTART_KERNEL_ISA"] = "avx512-vnni"             # below AMX (the float32 panel route), at most the CPU's
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() in ("avx512-vnni", "avx2")
    with pytest.raises(RuntimeError, match="unknown kernel ISA"):
        kernels.set_qlinear_isa("sse9")
