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
              dt=0.01, shape=(1, 1)) -> list[int]:
    """Steps for `seconds` of step time; returns the thread count each step ran on. dt: a step's time, or a function
    of the step's thread count (how fast each team runs on this scripted host); shape: what the step records (None:
    nothing)."""
    seen, spent = [], 0.0
    host.idle = idle
    while spent < seconds - 1e-9:
        with gov() as record:
            n = torch.get_num_threads()
            seen.append(n)
            step = dt(n) if callable(dt) else dt
            if shape is not None:
                record(shape)
            host.t += step
            host.wait += step * share
            spent += step
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


# step time between trials after a trial window of COMPARE_S (this scripted host's windows at batch 1)
EXPLORE = max(st.EXPLORE_S, st.COMPARE_S * (1 - st.TRIAL_SHARE) / st.TRIAL_SHARE)
ONE_FASTER = {1: 0.006, 2: 0.010}.get       # step seconds by team size on a busy host where one thread wins
TWO_FASTER = {1: 0.010, 2: 0.006}.get       # ... and where the full team still wins (bigger batches)
EVEN = {1: 0.010, 2: 0.0095}.get            # ... and where they are within the margin


def reasons(gov: StepThreads) -> list[tuple[int, str]]:
    return [(c.threads, c.reason) for c in gov.changes]


def test_a_busy_host_runs_the_smaller_team_and_idle_cpus_end_it(two_threads):
    host = Host()
    gov = make(host)
    assert run_steps(gov, host, 0.5, share=0.0, idle=1.0) == [2] * 50      # quiet: the full team, nothing decided
    assert gov.changes == [] and not gov.busy
    seen = run_steps(gov, host, 0.8, share=0.5, idle=0.0, dt=ONE_FASTER)   # every core shared with a busy process
    assert seen[0] == 2 and seen[-1] == 1 and gov.team == 1 and gov.busy and gov.chosen == 1
    # the smaller team at once, then a window on the full team, compared: slower, so the smaller one is back
    assert reasons(gov) == [(1, "busy"), (2, "trial"), (1, "back")]
    assert gov.changes[0].wait_share == 0.5 and gov.changes[2].full_gain == pytest.approx(0.6, rel=0.01)
    assert torch.get_num_threads() == 2                                    # outside a step the count is untouched
    # alone on a core while the busy processes share the other: the thread waits for nothing, yet a second thread
    # would bring the contention back, so the team stays small while no CPU is idle (its trials lose)
    seen = run_steps(gov, host, 4.0, share=0.0, idle=0.0, dt=ONE_FASTER)
    assert seen[-1] == 1 and {r for _, r in reasons(gov)[3:]} == {"trial", "back"}
    assert run_steps(gov, host, 0.7, share=0.0, idle=0.9)[-1] == 2          # the busy processes left
    assert reasons(gov)[-1] == (2, "quiet") and gov.changes[-1].idle_cpus == 0.9 and not gov.busy


def test_a_busy_host_keeps_the_full_team_where_it_runs_faster(two_threads):
    host = Host()
    gov = make(host)
    seen = run_steps(gov, host, 4.0, share=0.5, idle=0.0, dt=TWO_FASTER)
    # two trials in a row that find the full team faster (the second right after one window), then it is kept
    assert reasons(gov)[:5] == [(1, "busy"), (2, "trial"), (1, "back"), (2, "trial"), (2, "kept")]
    assert gov.changes[2].full_gain == gov.changes[4].full_gain == pytest.approx(10 / 6, rel=0.01)
    assert gov.changes[3].at_s - gov.changes[2].at_s < st.EXPLORE_S
    assert gov.team == 2 and gov.chosen == 2 and gov.busy
    seen = run_steps(gov, host, 10 * EXPLORE, share=0.5, idle=0.0, dt=TWO_FASTER)
    assert (1, "trial") in reasons(gov)                                    # it looks again now and then ...
    assert seen.count(1) * 0.010 <= 1.1 * st.TRIAL_SHARE * 10 * EXPLORE    # ... in a small share of the time
    assert gov.chosen == 2 and (1, "kept") not in reasons(gov)
    run_steps(gov, host, 0.7, share=0.0, idle=1.0)                         # the full team stops waiting: quiet
    assert reasons(gov)[-1] == (2, "quiet") and not gov.busy               # (after a trial under way, if any)


def test_within_the_margin_the_smaller_team_stays(two_threads):
    host = Host()
    gov = make(host)
    run_steps(gov, host, 3.0, share=0.5, idle=0.0, dt=EVEN)               # the full team 5% faster: not enough
    assert gov.chosen == 1 and "kept" not in [r for _, r in reasons(gov)]
    assert all(c.full_gain == pytest.approx(1 / 0.95, rel=0.01) for c in gov.changes if c.reason == "back")


def test_one_trial_alone_does_not_switch(two_threads):
    """A single window in which the full team happened to run faster (the busy processes placed where they suit it)
    is not enough: the next trial, right after one window, must agree."""
    host = Host()
    gov = make(host)

    def dt(n):
        trials = sum(1 for t, r in reasons(gov) if (t, r) == (2, "trial"))
        return 0.008 if n == 1 else 0.006 if trials <= 1 else 0.010   # the full team fast in the first trial only
    run_steps(gov, host, 3.0, share=0.5, idle=0.0, dt=dt)
    assert reasons(gov)[:5] == [(1, "busy"), (2, "trial"), (1, "back"), (2, "trial"), (1, "back")]
    assert gov.changes[2].full_gain > 1.1 > gov.changes[4].full_gain
    assert gov.chosen == 1 and (2, "kept") not in reasons(gov)


def test_the_choice_follows_the_work_when_it_changes(two_threads):
    """A batch that grows under the same load: the next trial finds that the full team is now the faster one."""
    host = Host()
    gov = make(host)
    run_steps(gov, host, 1.0, share=0.5, idle=0.0, dt=ONE_FASTER, shape=(1, 1))
    assert gov.chosen == 1
    run_steps(gov, host, EXPLORE + 4 * st.COMPARE_S, share=0.5, idle=0.0, dt=TWO_FASTER, shape=(32, 32))
    assert gov.chosen == 2 and reasons(gov)[-1] == (2, "kept")
    run_steps(gov, host, EXPLORE + 4 * st.COMPARE_S, share=0.5, idle=0.0, dt=ONE_FASTER, shape=(1, 1))
    assert gov.chosen == 1 and reasons(gov)[-1] == (1, "kept")             # and back when it shrinks again


def test_long_trials_take_a_bounded_share_of_the_step_time(two_threads):
    """Batch 32 under load: a step of the smaller team takes ~0.2 s, so a trial window (WINDOW_STEPS steps) lasts
    1.6 s. Trials then come less often, so that they take at most TRIAL_SHARE of the step time (up to MAX_EXPLORE_S
    between them); every EXPLORE_S they took about half of it, at the slower size."""
    host = Host()
    gov = make(host)
    slow = {1: 0.20, 2: 0.12}.get
    run_steps(gov, host, 10.0, share=0.5, idle=0.0, dt=slow, shape=(32, 32))
    assert gov.chosen == 2
    seen = run_steps(gov, host, 120.0, share=0.5, idle=0.0, dt=slow, shape=(32, 32))
    trials = seen.count(1) * 0.20
    trial_window = st.WINDOW_STEPS * 0.20
    assert trials <= trial_window / (trial_window + st.MAX_EXPLORE_S) * 120.0 + trial_window
    assert trials >= trial_window                                          # it still looks
    assert all(c.full_gain == pytest.approx(1 / 0.6, rel=0.01) for c in gov.changes if c.reason == "back")


def test_a_close_trial_keeps_the_pace_of_explore_s(two_threads):
    """Where the two sizes run within CLEAR of each other (batch 1 under load) the next trial may decide the other
    way, so trials stay every EXPLORE_S: a short process at batch 32 whose first trial read only 1.14x (noise) must
    not wait MAX_EXPLORE_S at the slower size before looking again."""
    host = Host()
    gov = make(host)
    run_steps(gov, host, 12 * (st.EXPLORE_S + st.COMPARE_S), share=0.5, idle=0.0, dt=EVEN)
    trials = [c.at_s for c in gov.changes if c.reason == "trial"]
    assert len(trials) >= 10 and max(b - a for a, b in zip(trials, trials[1:])) < st.EXPLORE_S + 2 * st.COMPARE_S


def test_steps_of_other_shapes_are_not_compared(two_threads):
    """A trial whose steps share no shape with the window before it (or records none) decides nothing: the size
    chosen before stays."""
    host = Host()
    gov = make(host)
    run_steps(gov, host, 0.1 + st.COMPARE_S + 0.005, share=0.5, idle=0.0, dt=ONE_FASTER, shape=(1, 1))
    assert reasons(gov) == [(1, "busy"), (2, "trial")]
    run_steps(gov, host, st.COMPARE_S, share=0.5, idle=0.0, dt=TWO_FASTER, shape=(8, 8))  # the trial: other shapes
    assert reasons(gov)[2] == (1, "back") and gov.changes[2].full_gain is None
    host2 = Host()
    gov2 = make(host2)
    run_steps(gov2, host2, 2.0, share=0.5, idle=0.0, dt=TWO_FASTER, shape=None)  # nothing recorded: no trials
    assert reasons(gov2) == [(1, "busy")]


def test_speedup_weights_each_shape_by_the_rarer_side():
    before, after = st.Window(), st.Window()
    for _ in range(4):
        before.add((1, 1), 0.010)
    before.add((8, 8), 0.050)
    for _ in range(2):
        after.add((1, 1), 0.005)
        after.add((8, 8), 0.025)
    after.add((32, 32), 1.0)                                               # only in one window: left out
    assert st.speedup(before, after) == pytest.approx((2 * 0.010 + 0.050) / (2 * 0.005 + 0.025))
    assert st.speedup(before, st.Window()) is None
    small = st.Window()
    small.add((1, 1), 0.005)
    assert st.speedup(before, small) is None                               # fewer than MIN_STEPS in common


def test_the_team_shrinks_in_proportion_to_the_cpu_it_gets(two_threads):
    host = Host()
    gov = make(host, threads=8)
    run_steps(gov, host, 0.15, share=0.5, idle=0.0)
    assert gov.team == 4                                                   # 8 threads, each waiting half the time
    assert reasons(gov) == [(4, "busy")]
    run_steps(gov, host, 2 * st.COMPARE_S, share=0.5, idle=0.0, dt=lambda n: 0.012 - 0.001 * n)
    assert reasons(gov)[1:] == [(8, "trial"), (4, "back")]                   # 4 vs 8 threads, then back to 4


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


def test_the_pinning_is_told_when_the_host_turns_busy_and_quiet_again(two_threads):
    host = Host()
    told = []
    gov = StepThreads(2, contextlib.nullcontext, True, wait_s=host.wait_s, idle_cpus=host.idle_cpus,
                      clock=host.clock, spread=told.append)
    run_steps(gov, host, 0.5, share=0.0, idle=1.0)
    assert told == []                                                      # quiet: pinned, nothing said
    run_steps(gov, host, 4.0, share=0.5, idle=0.0, dt=ONE_FASTER)          # trials and their verdicts: no news
    assert told == [True] and len(gov.changes) > 2
    run_steps(gov, host, 0.7, share=0.0, idle=0.9)
    assert told == [True, False] and reasons(gov)[-1] == (2, "quiet")
