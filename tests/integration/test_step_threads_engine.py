"""Issue 8 item 5 on a real busy host: busy processes pinned one per CPU make an engine try its steps on fewer threads
(runner/step_threads.py), with the same greedy tokens, and compare the rates of the steps it recorded; when they stop,
the engine counts the host as quiet again and the steps get the full team back."""
import os
import subprocess
import sys
import time

import pytest

from tests.checkpoints import write_checkpoint
from warmstart import LLM, SamplingParams, threads

GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 9, 9]]

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat") or threads.available_cpus() < 2,
                                reason="needs Linux run-queue accounting and two CPUs")


def _ids(llm):
    return [o.output_token_ids for o in llm.generate_ids(PROMPTS, GREEDY)]


def _until(llm, cond, seconds: float = 20.0):
    """Generate until cond(governor) holds (each call adds step time to its windows); the ids of each call."""
    gov = llm.booted.engine.step_threads
    seen, t0 = [], time.monotonic()
    while not cond(gov) and time.monotonic() - t0 < seconds:
        seen.append(_ids(llm))
    return seen


def test_busy_cpus_shrink_the_steps_team_and_idle_ones_restore_it(tmp_path):
    ckpt = write_checkpoint(tmp_path / "llama", "llama", layers=4, hidden=128)
    llm = LLM(str(ckpt), kv_cache_memory=8 * 2**20, max_model_len=128, startup_plan="off", threads=2)
    gov = llm.booted.engine.step_threads
    assert gov.adaptive and gov.full == 2
    assert llm.booted.report.to_dict()["threads"]["adaptive"] is True
    quiet = _ids(llm)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=lambda c=c: os.sched_setaffinity(0, {c})) for c in cpus]
    try:
        time.sleep(0.3)
        loaded = _until(llm, lambda g: g.team < 2)
        assert gov.team == 1 and gov.busy, gov.changes
        assert gov.changes[-1].reason == "busy" and gov.changes[-1].wait_share >= 0.25
        loaded += _until(llm, lambda g: len(g.changes) >= 3)  # a trial of the full team, and its end
        assert [c.reason for c in gov.changes[1:3]] == ["trial", "kept" if gov.chosen == 2 else "back"], gov.changes
        assert gov.changes[2].full_gain is not None       # the steps' rates were compared
    finally:
        for p in load:
            p.kill()
            p.wait()
    assert all(ids == quiet for ids in loaded)            # the team size never changes a token
    again = _until(llm, lambda g: not g.busy)
    assert gov.team == 2 and not gov.busy and gov.changes[-1].reason == "quiet", gov.changes
    assert all(ids == quiet for ids in again) and _ids(llm) == quiet
