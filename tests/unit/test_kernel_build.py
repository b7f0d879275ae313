"""How the compiled kernels were built: each extension must carry OpenMP (at::parallel_for is a header template and
runs every kernel on one thread in code compiled without -fopenmp; that went unnoticed for three sessions), and now
that they do run threaded, their results must not depend on the thread count."""
import sys

import pytest
import torch

from warmstart import kernels

EXTENSIONS = {"_paged": kernels._native, "_qlinear": kernels._qlinear, "_fused": kernels._fused}


@pytest.mark.skipif(sys.platform != "linux", reason="OpenMP builds are Linux-only (setup.py)")
@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_extension_is_built_with_openmp(name):
    module = EXTENSIONS[name]
    if module is None:
        pytest.skip(f"{name} not built")
    assert module.openmp is True, f"{name} was compiled without -fopenmp: its at::parallel_for runs on one thread"


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.skipif(not (kernels.has_native() and kernels.has_qlinear()), reason="kernels not built")
def test_results_do_not_depend_on_the_thread_count(threads):
    torch.manual_seed(0)
    H, Hkv, D, bs = 9, 3, 64, 16
    kc, vc = torch.randn(64, bs, Hkv, D), torch.randn(64, bs, Hkv, D)
    table = torch.randperm(64)[:60].view(3, 20).int()
    q = torch.randn(5, H, D)
    seq, ctx = torch.tensor([0, 1, 2, 2, 1], dtype=torch.int32), torch.tensor([300, 17, 320, 1, 299], dtype=torch.int32)
    x, x40 = torch.randn(7, 256), torch.randn(40, 256)
    qw = torch.randint(0, 256, (96, 128), dtype=torch.uint8)
    sc, mn = torch.rand(96, 8).half(), torch.randn(96, 8).half()
    h, w = torch.randn(40, 576), torch.randn(576)
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append((kernels.paged_attention(q, kc, vc, table, seq, ctx, 0.125),     # split into chunks of 512
                     kernels.qlinear(x, qw, sc, mn), kernels.qlinear(x[:1], qw, sc, mn),
                     kernels.qlinear(x40, qw, sc, mn),                                # the panel route
                     kernels.qlinear(x, qw.view(torch.int8).view(96, 128).repeat(1, 2), sc),
                     kernels.add_rms_norm(h, None, w, 1e-5)[0]))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)
