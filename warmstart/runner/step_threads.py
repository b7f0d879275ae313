"""How many threads a step runs on when other processes take the host's CPUs (why below; settings: threads.py).

A step's parallel loops run on a team of threads (the kernels' pool, torch's OpenMP team), and the calling thread
drives every step: between loops, and for the Python between steps, only it runs. When another process keeps every
core busy, each of the team's threads gets about half a core, in turns the scheduler deals independently, so the
other threads are often off their cores while the caller runs and the caller is off its core while they wait for the
next loop: measured on the 2-core Zen 4 EPYC with the default model at batch 1, 2 threads decoded 244 tok/s quiet
and 104 under two busy loops (2.35x slower), while one thread decoded 178 quiet and 177 under the same two busy
loops. With one busy loop the caller kept its core (the loop sat beside the pool's worker) and two threads were as
fast as one (189 vs 184 tok/s).

Which team is faster on a busy host depends on the work, so it is measured, not assumed: under the same two busy
loops, batch 32 (default model; each team size fixed for 12 s of decoding, separate processes alternated) decoded
435 and 465 tok/s on 2 threads and 339 and 349 on one, while at batch 1 one thread was as fast or a little faster
(medians 133 vs 125 tok/s over 1-s windows alternated in one process for 40 s). Against the team that only shrank
(before this choice; separate processes alternated, 12 s of decoding each under the two busy loops): batch 32
390, 399, 388 tok/s vs 330, 334, 339; batch 1 126, 138, 114 vs 138, 124, 127 (within this host's spread).

So while the host is busy the step's team is chosen by the rate it gets. The host is busy when the calling thread
spent BUSY or more of its step time runnable but not running (the second field of /proc/thread-self/schedstat, the
scheduler's own accounting) over a window of WINDOW_S of step time at the full team. The step then runs on the
smaller team (the threads the host gives it: threads x (1 - share), at least one) for a window (COMPARE_S of step
time and WINDOW_STEPS steps, or MAX_WINDOW_S), and the full team is tried for the next: it is chosen only if its
steps ran more than MARGIN faster (a smaller team takes less of a shared host, and a single thread's rate is the
steadier one under load), in CONFIRM trials in a row (a single window can catch the busy processes where they happen
to suit the full team: at batch 1 one of seven read 1.34x). After EXPLORE_S of step time at the chosen size the
other is tried again the same way (after a trial that asked for a switch, after one window), so a change in the load
or in the batch finds the faster team again. After a trial that was clearly slower (by CLEAR or more) the wait
grows so that such trials take at most TRIAL_SHARE of the step time (up to MAX_EXPLORE_S): at batch 32 a window of
the smaller team lasts ~1.6 s under load (WINDOW_STEPS steps of ~0.2 s), and trials every EXPLORE_S took about half
of the step time at a size 1.4-1.6x slower (12 s of decoding under two busy loops: a trial every 1.6-1.7 s, each
0.8-1.6 s). With the bound, 20 s of batch-32 decoding under the same load, separate processes alternated: 374.5,
376.4, 359.5 tok/s vs 362.3, 355.4, 361.0 before (a fixed team of two: 396.1, 382.8, 384.4). A trial within CLEAR
keeps the pace of EXPLORE_S, as the next one may well decide the other way (a 5-s run at batch 32 whose first trial
read 1.14x must not wait MAX_EXPLORE_S at one thread). Steps are compared by shape (sequences, tokens: the engine
records each step's): the mean step time of each shape both windows ran, weighted by the steps of the rarer side.
Trials cost at most TRIAL_SHARE of the step time at the other size after a clear decision (COMPARE_S / (EXPLORE_S +
COMPARE_S) otherwise), and only while the host is busy.
The host is quiet again when the full team waits for its CPU less than BUSY of a window, or, for a smaller team,
when the CPUs this process may use had IDLE_PER_THREAD of a CPU idle per missing thread over a window (idle time in
/proc/stat; a thread alone often gets a core to itself while the busy processes share the others, so its own waits
read near 0 though a second thread would bring the contention back). Results do not depend on the team size
(kernels/csrc/pool.h: chunk boundaries never change a result). WARMSTART_ADAPTIVE_THREADS=0 keeps the team fixed."""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, ContextManager, Hashable, Iterator

import torch

log = logging.getLogger("warmstart")

WINDOW_S = 0.1      # step time per decision while the host is quiet
BUSY = 0.25         # run-queue wait share at which the host counts as busy (two busy loops on 2 cores: 0.50 at 2
                    # threads)
IDLE_PER_THREAD = 0.5  # idle CPU per missing thread at which a smaller team grows back
COMPARE_S = 0.3     # step time per window while the host is busy (a trial, and the window it is compared with) ...
WINDOW_STEPS = 8    # ... and steps recorded in it, at least (batch 32 under load: ~80 ms a step) ...
MAX_WINDOW_S = 2.0  # ... unless it has run this long
EXPLORE_S = 1.5     # step time at the chosen size between trials of the other, at least ...
TRIAL_SHARE = 0.1   # ... and, after a trial that ran CLEAR slower, enough that such trials take at most this
MAX_EXPLORE_S = 12.0  # share of the step time, up to this
CLEAR = 0.25        # a trial this much slower is a clear decision
MIN_STEPS = 3       # steps of shapes both windows ran, at least, for a comparison to decide
MARGIN = 0.1        # the full team is chosen only when it ran this much faster than the smaller one ...
CONFIRM = 2         # ... in this many trials in a row (and the smaller one again likewise)


def run_queue_wait_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU, or None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class IdleCpus:
    """Idle CPUs (a sum of fractions of a CPU) among `cpus` since the previous call, from /proc/stat; None where
    the kernel does not say, and on the first call."""

    def __init__(self, cpus: set[int]):
        self.names = {f"cpu{c}" for c in cpus}
        self._last: dict[str, tuple[int, int]] | None = None

    def __call__(self) -> float | None:
        try:
            with open("/proc/stat") as f:
                now = {}
                for line in f:
                    name, _, rest = line.partition(" ")
                    if name in self.names:
                        v = [int(x) for x in rest.split()[:8]]      # user nice system idle iowait irq softirq steal
                        now[name] = (v[3] + v[4], sum(v))
        except (OSError, ValueError, IndexError):
            return None
        last, self._last = self._last, now
        if not last or not now:
            return None
        return sum((now[c][0] - last[c][0]) / (now[c][1] - last[c][1])
                   for c in now if c in last and now[c][1] > last[c][1])


Shape = Hashable     # what makes two steps comparable: the engine records (sequences, tokens)


class Window:
    """Step time per shape over a window: shape -> [seconds, steps]; n: the steps recorded."""

    def __init__(self):
        self.steps: dict[Shape, list] = {}
        self.n = 0

    def add(self, shape: Shape, dt: float) -> None:
        cell = self.steps.setdefault(shape, [0.0, 0])
        cell[0] += dt
        cell[1] += 1
        self.n += 1


def speedup(before: Window, after: Window) -> float | None:
    """How much faster `after`'s steps ran than `before`'s (> 1: faster): over the shapes both windows ran, the mean
    step times of each weighted by the steps of the rarer side. None when they share fewer than MIN_STEPS."""
    a = b = 0.0
    n = 0
    for shape, (tb, nb) in before.steps.items():
        if shape in after.steps:
            ta, na = after.steps[shape]
            w = min(na, nb)
            b += w * tb / nb
            a += w * ta / na
            n += w
    return b / a if n >= MIN_STEPS and a > 0.0 else None


@dataclass(frozen=True)
class TeamChange:
    """One decision while the host is busy, or on its way out of it (kept for the metrics and the tests)."""
    at_s: float             # step time since the first step
    threads: int            # the team from here on
    wait_share: float       # the calling thread's run-queue wait / step time over the window that decided it
    idle_cpus: float | None  # idle CPUs over that window (None: unknown)
    reason: str             # "busy": the host is busy, the smaller team runs | "trial": the other size is tried |
                            # "kept": the trial's size stays | "back": the size before the trial is back | "quiet":
                            # the host is quiet again, the full team is back
    full_gain: float | None = None  # "kept"/"back": how much faster the full team's steps ran than the smaller
                                    # team's (None: no steps of a shape both windows ran)


class StepThreads:
    """The engine's per-step context: sets the step's team size, then enters `pinning` (runner/affinity.py; it pins
    only a full team). It yields `record(shape)`, which tells it what the step was (without it the step's time
    counts towards the window but not towards a comparison). Decisions are per calling thread's measurements; one
    engine steps from one thread."""

    def __init__(self, threads: int, pinning: Callable[[], ContextManager[None]], adaptive: bool = True,
                 wait_s: Callable[[], float | None] = run_queue_wait_s,
                 idle_cpus: Callable[[], float | None] | None = None, clock: Callable[[], float] = time.perf_counter,
                 spread: Callable[[bool], None] | None = None):
        self.full = max(1, threads)
        self.pinning = pinning
        self.spread = spread        # told True when the host turns busy, False when it is quiet again (the
                                    # pinning's own switch: runner/affinity.py StepPinning.spread)
        self.wait_s, self.clock = wait_s, clock
        self.idle_cpus = idle_cpus if idle_cpus is not None else IdleCpus(os.sched_getaffinity(0))
        self.adaptive = adaptive and self.full > 1
        self.team = self.full
        self.changes: list[TeamChange] = []
        self.busy = False           # the host is busy: the team is chosen by rate
        self.chosen = self.full     # while busy: the size that ran faster
        self.trial = False          # while busy: this window tries the other size
        self._small = self.full     # while busy: the smaller size (the threads the host gives the team)
        self._votes = 0             # while busy: trials in a row that asked for the other size
        self._window = Window()
        self._last: Window | None = None  # the last whole window at the chosen size
        self._busy = 0.0            # step time in the current window
        self._total = 0.0           # step time since the first step
        self._since_trial = 0.0     # step time since the last trial
        self._explore = EXPLORE_S   # step time between trials (longer after a clearly slower trial: TRIAL_SHARE)
        self._w0: float | None = None

    @contextmanager
    def __call__(self) -> Iterator[Callable[[Shape], None]]:
        shape: list[Shape] = []
        if not self.adaptive:
            with self.pinning():
                yield shape.append
            return
        if self._w0 is None:
            self._w0 = self.wait_s()
            if self._w0 is None:
                self.adaptive = False
                log.info("adaptive threads off: this kernel does not report run-queue waits "
                         "(/proc/thread-self/schedstat)")
        prev = torch.get_num_threads()
        shrunk = self.team < prev           # a full team leaves the count as it is (as a step did before)
        if shrunk:
            torch.set_num_threads(self.team)
        t0 = self.clock()
        try:
            with self.pinning():
                yield shape.append
        finally:
            dt = self.clock() - t0
            if shrunk:                      # the calling thread's count outside steps is its own business
                torch.set_num_threads(prev)
            if shape:
                self._window.add(shape[-1], dt)
            self._busy += dt
            self._total += dt
            if self.adaptive and self._window_done():
                self._decide()

    def _window_done(self) -> bool:
        if not self.busy:
            return self._busy >= WINDOW_S
        return self._busy >= COMPARE_S and self._window.n >= WINDOW_STEPS or self._busy >= MAX_WINDOW_S

    def _decide(self) -> None:
        w, idle = self.wait_s(), self.idle_cpus()
        if w is None or self._w0 is None:
            return
        share = min(1.0, max(0.0, (w - self._w0) / self._busy))
        window, self._window, window_s = self._window, Window(), self._busy
        if self.busy and not self.trial:
            self._since_trial += self._busy
        self._w0, self._busy = w, 0.0
        if not self.busy:                   # the full team, on a quiet host until now
            if share >= BUSY:               # the smaller team first: its window is what the full team's trial
                                            # is compared with
                small = max(1, min(self.full - 1, round(self.full * (1.0 - share))))
                self.busy, self.chosen, self._small, self._last, self._votes = True, small, small, None, 0
                self._since_trial = self._explore = EXPLORE_S
                self._change(small, share, idle, "busy")
        elif self.trial:
            self._judge_trial(window, window_s, share, idle)
        else:
            self._last = window
            smaller_sees_idle = self.team < self.full and idle is not None and \
                idle >= IDLE_PER_THREAD * (self.full - self.team)
            if (self.team == self.full and share < BUSY) or smaller_sees_idle:
                self.busy = False
                self._change(self.full, share, idle, "quiet")
            elif self._since_trial >= self._explore and self._last.n:
                self.trial = True
                self._change(self._small if self.chosen == self.full else self.full, share, idle, "trial")

    def _judge_trial(self, window: Window, window_s: float, share: float, idle: float | None) -> None:
        """A trial's window against the last one at the chosen size: a vote, a switch after CONFIRM votes, and the
        wait before the next trial."""
        gain = speedup(self._last, window) if self._last is not None else None
        full_gain = None if gain is None else gain if self.team == self.full else 1.0 / gain
        before, self.trial, self._since_trial = self.chosen, False, 0.0
        want = None if full_gain is None else self.full if full_gain > 1.0 + MARGIN else self._small
        self._votes = self._votes + 1 if want is not None and want != self.chosen else 0
        if self._votes >= CONFIRM:          # a switch needs CONFIRM trials in a row that ask for it
            self.chosen, self._votes = want, 0
        clear = full_gain is not None and (full_gain >= 1.0 + CLEAR if self.chosen == self.full
                                           else full_gain <= 1.0 / (1.0 + CLEAR))
        self._explore = EXPLORE_S if not clear else \
            min(MAX_EXPLORE_S, max(EXPLORE_S, window_s * (1.0 - TRIAL_SHARE) / TRIAL_SHARE))
        if self._votes:                     # one asked: the next trial comes after one window
            self._since_trial = self._explore
        if self.chosen == self.team:
            self._last = window
        self._change(self.chosen, share, idle, "kept" if self.chosen == self.team else "back", full_gain)
        if self.chosen != before:
            log.debug("%d step threads ran %.2fx as fast as %d on this busy host: %d from here on", self.full,
                      full_gain, self._small, self.chosen)

    def _change(self, team: int, share: float, idle: float | None, reason: str,
                full_gain: float | None = None) -> None:
        before, self.team = self.team, team
        self.changes.append(TeamChange(round(self._total, 3), team, round(share, 3),
                                       None if idle is None else round(idle, 2), reason,
                                       None if full_gain is None else round(full_gain, 3)))
        del self.changes[:-64]
        if reason in ("busy", "quiet") and self.spread is not None:
            self.spread(reason == "busy")
        if reason == "busy":
            log.info("the host is busy (this thread waited for a CPU %.0f%% of its step time): %d step threads "
                     "instead of %d, and a try of %d now and then, kept where it runs faster", 100 * share, team,
                     before, before)
        elif reason == "quiet":
            log.info("the host is quiet again: %d step threads", team)
        else:
            log.debug("step threads %d -> %d (%s, full team's gain %s)", before, team, reason, full_gain)
