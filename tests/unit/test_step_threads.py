"""A step's team size on a busy host (runner/step_threads.py): the decisions, on a scripted host, and the two
signals they read, on this one (a busy process pinned beside this thread)."""
import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch

from warmstart.runner import step_threads as st
from warmstart.runner.step_threads import IdleCpus, StepThreads, run_queue_wait_s


class Host:
    """A scripted host: step time passes by `dt` per step, the thread waits `share` of it, `idle` CPUs idle."""

    def __init__(self):
        self.t, self.wait, self.idle = 0.0, 0.0, None
        self.wait_reads = 0

    def clock(self) -> float:
        return self.t

    def wait_s(self) -> float:
        self.wait_reads += 1
        return self.wait

    def idle_cpus(self) -> float | None:
        return self.idle


def run_steps(gov: StepThreads, host: Host, seconds: float, share: float, idle: float | None,
              dt: float = 0.01) -> list[int]:
    """Steps for `seconds` of step time; returns the thread count each step ran on."""
    seen = []
    host.idle = idle
    for _ in range(round(seconds / dt)):
        with gov():
            seen.append(torch.get_num_threads())
            host.t += dt
            host.wait += dt * share
    return seen


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def make(host: Host, threads: int = 2, adaptive: bool = True) -> StepThreads:
    return StepThreads(threads, contextlib.nullcontext, adaptive, wait_s=host.wait_s, idle_cpus=host.idle_cpus,
                       clock=host.clock)


def test_a_busy_host_shrinks_the_team_and_only_idle_cpus_grow_it_back(two_threads):
    host = Host()
    gov = make(host)
    assert run_steps(gov, host, 0.5, share=0.0, idle=1.0) == [2] * 50      # quiet: the full team, nothing decided
    seen = run_steps(gov, host, 0.5, share=0.5, idle=0.0)                  # every core shared with a busy process
    assert seen[0] == 2 and seen[-1] == 1 and gov.team == 1
    assert [(c.threads, c.reason) for c in gov.changes] == [(1, "busy")]
    assert torch.get_num_threads() == 2                                    # outside a step the count is untouched
    # alone on a core while the busy processes share the other: the thread waits for nothing, yet a second thread
    # would bring the contention back, so the team stays small while no CPU is idle
    assert run_steps(gov, host, 1.0, share=0.0, idle=0.0) == [1] * 100
    assert run_steps(gov, host, 0.3, share=0.0, idle=0.9)[-1] == 2          # the busy processes left
    assert [(c.threads, c.reason) for c in gov.changes] == [(1, "busy"), (2, "quiet")]
    assert gov.changes[-1].idle_cpus == 0.9 and gov.changes[0].wait_share == 0.5


def test_a_smaller_team_tries_the_full_one_every_probe_interval(two_threads):
    host = Host()
    gov = make(host)
    run_steps(gov, host, 0.2, share=0.6, idle=0.0)
    assert gov.team == 1
    seen = run_steps(gov, host, st.PROBE_S + 0.3, share=0.0, idle=None)    # idle CPUs unknown: probes only
    assert seen[-1] == 2 and gov.changes[-1].reason == "probe"
    run_steps(gov, host, 0.2, share=0.6, idle=0.0)                         # still busy: back down
    assert [c.reason for c in gov.changes] == ["busy", "probe", "busy"] and gov.team == 1


def test_the_team_shrinks_in_proportion_to_the_cpu_it_gets(two_threads):
    host = Host()
    gov = make(host, threads=8)
    run_steps(gov, host, 0.15, share=0.5, idle=0.0)
    assert gov.team == 4                                                   # 8 threads, each waiting half the time
    run_steps(gov, host, 0.3, share=0.1, idle=0.0)
    assert gov.team == 4                                                   # no idle CPU: stays


@pytest.mark.parametrize("threads,adaptive", [(2, False), (1, True)])
def test_a_fixed_team_never_changes_nor_measures(two_threads, threads, adaptive):
    host = Host()
    gov = make(host, threads=threads, adaptive=adaptive)
    assert run_steps(gov, host, 0.5, share=0.9, idle=0.0) == [2] * 50
    assert gov.changes == [] and host.wait_reads == 0


def test_a_kernel_without_run_queue_accounting_turns_it_off(two_threads):
    gov = StepThreads(2, contextlib.nullcontext, True, wait_s=lambda: None, idle_cpus=lambda: 0.0)
    for _ in range(30):
        with gov():
            time.sleep(0.005)
    assert gov.adaptive is False and gov.team == 2


# ---- the signals, on this host ---------------------------------------------------------------------------------

linux = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no /proc/thread-self/schedstat")


@contextlib.contextmanager
def busy_process_on(cpu: int):
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                         preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        time.sleep(0.3)                                  # started and spinning
        yield p
    finally:
        p.kill()
        p.wait()


@linux
def test_run_queue_wait_counts_the_time_this_thread_waited_for_its_cpu():
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    with busy_process_on(cpu):
        os.sched_setaffinity(0, {cpu})                   # this thread and the busy process share one CPU
        try:
            w0, t0 = run_queue_wait_s(), time.perf_counter()
            while time.perf_counter() - t0 < 0.5:
                pass
            share = (run_queue_wait_s() - w0) / (time.perf_counter() - t0)
        finally:
            os.sched_setaffinity(0, before)
    assert st.BUSY <= share <= 1.0, share                # about half: the scheduler alternates the two


@linux
def test_idle_cpus_reads_a_busy_cpu_as_busy():
    cpu = min(os.sched_getaffinity(0))
    with busy_process_on(cpu):
        idle = IdleCpus({cpu})
        assert idle() is None                            # the first read only starts the window
        time.sleep(0.4)
        x = idle()
    assert x is not None and 0.0 <= x < 0.2, x
