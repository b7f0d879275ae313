"""The few-row float GEMV (kernels/csrc/dense_linear.h, kernels.dense_linear) against a float64 reference, at each
ISA level the CPU has, for float32 and bfloat16: odd shapes and K tails, biases, every row count it takes and the
hand-over to F.linear above it; results independent of the thread count; DenseLinear is nn.Linear to everything
else (state dict, parameters)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from warmstart import kernels
from warmstart.models.layers import DenseLinear

pytestmark = pytest.mark.skipif(not kernels.has_qlinear(),
                                reason=f"compiled kernels not built: {kernels.QLINEAR_UNAVAILABLE_REASON}")
SHAPES = [(1, 16), (3, 17), (7, 33), (16, 100), (64, 576), (33, 1536)]     # (N, K): K tails of 1..31 included


@pytest.fixture(params=["avx2", "avx512-vnni"])
def level(request):
    """Each inner loop the CPU can run (AVX-512's skipped where it has none); restores the level in force."""
    before = kernels.qlinear_isa()
    got = kernels.set_qlinear_isa(request.param)
    if got != request.param:
        kernels.set_qlinear_isa(before)
        pytest.skip(f"this CPU has no {request.param}")
    yield got
    kernels.set_qlinear_isa(before)


def reference(x, w, b):
    """float64 sums of the given values (bfloat16 ones are exact in float64)."""
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_float32_within_float32_rounding(level, n, k, rows):
    torch.manual_seed(n * k + rows)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    for bias in (None, b):
        y = kernels.dense_linear(x, w, bias)
        ref = reference(x, w, bias)
        assert y.dtype is torch.float32 and y.shape == (rows, n)
        # float32 sums of k products: error ~ sqrt(k) * 2^-24 of the terms' scale
        tol = 1e-6 * k ** 0.5 * (x.abs().max() * w.abs().max()).item() * 4
        assert (y.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_bfloat16_is_one_rounding_of_a_float32_sum(level, n, k, rows):
    """bfloat16 in and out: float32 sums of exact products, the bias added, one rounding to bfloat16 (as oneDNN)."""
    torch.manual_seed(n * k + rows)
    x, w, b = (torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16())
    for bias in (None, b):
        y = kernels.dense_linear(x, w, bias)
        assert y.dtype is torch.bfloat16 and y.shape == (rows, n)
        ref = reference(x, w, bias)
        exact = ref.bfloat16()                                   # the correctly rounded result
        sum_err = 1e-6 * k ** 0.5 * (x.float().abs().max() * w.float().abs().max()).item() * 4
        ulp = ref.abs() * 2.0 ** -8 + sum_err                    # one bfloat16 rounding, plus the float32 sums'
        assert ((y.double() - ref).abs() <= ulp).all()
        # and most outputs are exactly the correctly rounded value (float32 sums rarely cross a bf16 boundary)
        assert (y == exact).float().mean().item() > 0.9


def test_thread_count_does_not_change_a_bit(level):
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = torch.randn(3, 576).to(dtype), torch.randn(1536, 576).to(dtype), torch.randn(1536).to(dtype)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernels.dense_linear(x, w, b)
            torch.set_num_threads(2)
            two = kernels.dense_linear(x, w, b)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, two)


def test_hands_over_to_f_linear_where_it_does_not_apply():
    """More rows than it takes, mixed dtypes, float16, non-contiguous input: exactly F.linear's result."""
    torch.manual_seed(1)
    w, b = torch.randn(24, 64), torch.randn(24)
    many = torch.randn(kernels.DENSE_GEMV_MAX_ROWS + 1, 64)
    assert torch.equal(kernels.dense_linear(many, w, b), F.linear(many, w, b))
    strided = torch.randn(64, 3).t()
    assert torch.equal(kernels.dense_linear(strided, w, b), F.linear(strided, w, b))
    half = torch.randn(2, 64).half()
    assert torch.equal(kernels.dense_linear(half, w.half(), b.half()), F.linear(half, w.half(), b.half()))
    with pytest.raises(RuntimeError):                           # mixed dtypes fail as F.linear fails
        kernels.dense_linear(torch.randn(2, 64), w.bfloat16())
    three_d = torch.randn(2, 3, 64)
    assert torch.equal(kernels.dense_linear(three_d, w, b), F.linear(three_d, w, b))


def test_dense_linear_is_an_nn_linear_with_the_kernel_for_few_rows():
    torch.manual_seed(2)
    plain = nn.Linear(40, 24)
    dense = DenseLinear(40, 24)
    dense.load_state_dict(plain.state_dict())
    assert isinstance(dense, nn.Linear) and dense.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(2, 40)
    with torch.no_grad():
        assert torch.equal(dense(x), kernels.dense_linear(x, dense.weight, dense.bias))
        assert torch.allclose(dense(x), plain(x), atol=1e-5)
        many = torch.randn(20, 40)
        assert torch.equal(dense(many), plain(many))            # many rows: F.linear itself
