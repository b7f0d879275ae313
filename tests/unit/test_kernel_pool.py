"""The compiled kernels' thread pool (kernels/csrc/pool.h): the same results as torch's OpenMP team at every thread
count, loops shared between the calling thread and the workers, a loop that finishes with no worker at all (a
forked child has none), and two Python threads calling kernels at once."""
from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from warmstart import kernels

pytestmark = pytest.mark.skipif(not (kernels.has_native() and kernels.has_qlinear() and kernels.has_fused()),
                                reason="kernels not built")


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D, bs = 9, 3, 64, 16
    kc, vc = torch.randn(64, bs, Hkv, D, generator=g), torch.randn(64, bs, Hkv, D, generator=g)
    return dict(
        q=torch.randn(5, H, D, generator=g), kc=kc, vc=vc,
        kc8=kernels.quantize_kv_rows(kc), vc8=kernels.quantize_kv_rows(vc),
        table=torch.randperm(64, generator=g)[:60].view(3, 20).int(),
        seq=torch.tensor([0, 1, 2, 2, 1], dtype=torch.int32),
        ctx=torch.tensor([300, 17, 320, 1, 299], dtype=torch.int32),
        x=torch.randn(7, 256, generator=g), x40=torch.randn(40, 256, generator=g),
        qw=torch.randint(0, 256, (96, 128), dtype=torch.uint8, generator=g),
        sc=torch.rand(96, 8, generator=g).half(), mn=torch.randn(96, 8, generator=g).half(),
        h=torch.randn(40, 576, generator=g), w=torch.randn(576, generator=g))


def _workload(a: dict) -> list[torch.Tensor]:
    """Every parallel loop the kernels have: paged attention (split into chunks of 512, then merged; float and int8
    caches), the three qlinear routes (int4 and int8 activations, the panel route) and a fused row op."""
    return [kernels.paged_attention(a["q"], a["kc"], a["vc"], a["table"], a["seq"], a["ctx"], 0.125),
            kernels.paged_attention(a["q"], a["kc8"], a["vc8"], a["table"], a["seq"], a["ctx"], 0.125),
            kernels.qlinear(a["x"], a["qw"], a["sc"], a["mn"]), kernels.qlinear(a["x"][:1], a["qw"], a["sc"], a["mn"]),
            kernels.qlinear(a["x40"], a["qw"], a["sc"], a["mn"]),
            kernels.qlinear(a["x"], a["qw"].view(torch.int8).view(96, 128).repeat(1, 2), a["sc"]),
            kernels.add_rms_norm(a["h"], None, a["w"], 1e-5)[0]]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
    kernels.set_pool_enabled(True)


def test_the_pool_and_openmp_give_identical_results_at_every_thread_count(threads):
    a = _inputs()
    outs = {}
    for on in (True, False):
        kernels.set_pool_enabled(on)
        for n in (1, 2, 3, 4):
            threads(n)
            outs[on, n] = _workload(a)
    want = outs[False, 1]
    for key, got in outs.items():
        for i, (x, y) in enumerate(zip(want, got)):
            assert torch.equal(x, y), f"output {i} differs with pool={key[0]}, threads={key[1]}"


def test_loops_run_on_the_pool_and_its_workers_take_chunks(threads):
    """200 loops of two microsecond chunks each, then more until a worker has taken a chunk (at most 3 s): a worker
    that had gone to sleep, or shares the caller's CPU, can miss all of the first 200 (seen after other test files
    had pinned the pool's workers), but not every loop for seconds."""
    a = _inputs()
    threads(2)
    kernels.set_pool_enabled(True)
    before = kernels.pool_stats()
    deadline = time.monotonic() + 3.0
    for i in itertools.count():
        kernels.qlinear(a["x40"], a["qw"], a["sc"], a["mn"])
        if i >= 199 and (kernels.pool_stats()["worker_chunks"] > before["worker_chunks"]
                         or time.monotonic() > deadline):
            break
    after = kernels.pool_stats()
    loops = after["loops"] - before["loops"]
    caller = after["caller_chunks"] - before["caller_chunks"]
    workers = after["worker_chunks"] - before["worker_chunks"]
    assert loops >= 200                              # at least the panel loop of every call
    assert caller > 0 and workers > 0                # both threads claimed chunks
    assert caller + workers >= 2 * loops             # each loop was cut into chunks (several per thread)
    kernels.set_pool_enabled(False)
    kernels.qlinear(a["x40"], a["qw"], a["sc"], a["mn"])
    assert kernels.pool_stats()["loops"] == after["loops"]   # off: the loops went to OpenMP


def test_a_loop_finishes_with_no_worker_at_all():
    """A forked child has the pool's state but none of its worker threads: the calling thread claims every chunk
    itself, as it does when a worker has lost its core, and the loop ends with the right result."""
    script = textwrap.dedent("""
        import os, torch
        from warmstart import kernels
        torch.set_num_threads(2)
        x = torch.randn(40, 256)
        qw = torch.randint(0, 256, (96, 128), dtype=torch.uint8)
        sc, mn = torch.rand(96, 8).half(), torch.randn(96, 8).half()
        want = kernels.qlinear(x, qw, sc, mn)          # starts the pool's worker
        assert kernels.pool_stats()["worker_chunks"] >= 0
        pid = os.fork()
        if pid == 0:
            before = kernels.pool_stats()
            ok = all(torch.equal(kernels.qlinear(x, qw, sc, mn), want) for _ in range(20))
            after = kernels.pool_stats()
            ok = ok and after["loops"] > before["loops"] and after["worker_chunks"] == before["worker_chunks"]
            os._exit(0 if ok else 3)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "0"


def test_two_python_threads_calling_kernels_at_once_get_their_own_results(threads):
    """The kernels release the GIL: a loop started while another thread holds the pool runs on OpenMP instead."""
    threads(2)
    cases = [_inputs(seed) for seed in (1, 2)]
    want = [_workload(c) for c in cases]
    errors: list[str] = []

    def hammer(i: int) -> None:
        for _ in range(30):
            for j, (x, y) in enumerate(zip(want[i], _workload(cases[i]))):
                if not torch.equal(x, y):
                    errors.append(f"thread {i} output {j}")

    ts = [threading.Thread(target=hammer, args=(i,)) for i in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in ts)
    assert not errors
