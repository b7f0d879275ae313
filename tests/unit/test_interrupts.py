"""Signals during the heavy imports (warmstart/interrupts.py): they end the process at once with the commands' exit
codes, and the handlers from before come back after the block. Real processes and real signals."""
import signal
import subprocess
import sys
import time

import pytest

PROLOGUE = "import os, signal, time\nfrom warmstart.interrupts import exit_at_once_on_signals\n"


def _run(body: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", PROLOGUE + body], capture_output=True, text=True, timeout=60)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_a_signal_inside_the_block_exits_at_once(sig, code):
    r, took = _run("with exit_at_once_on_signals():\n"
                   f"    os.kill(os.getpid(), {int(sig)})\n"
                   "    time.sleep(30)\n"
                   "print('not reached')\n")
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert took < 20                                        # not the 30 s sleep


def test_the_previous_handlers_come_back_after_the_block():
    # Set the "previous" handler explicitly: a process started in the background by a non-interactive shell (as CI
    # runs) inherits SIGINT ignored, and Python then leaves it ignored instead of installing KeyboardInterrupt.
    r, _ = _run("signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                "with exit_at_once_on_signals():\n"
                "    pass\n"
                "try:\n"
                "    os.kill(os.getpid(), signal.SIGINT)\n"
                "    time.sleep(30)\n"
                "except KeyboardInterrupt:\n"
                "    print('KeyboardInterrupt, as before')\n")
    assert r.returncode == 0 and r.stdout.strip() == "KeyboardInterrupt, as before", (r.returncode, r.stderr)



def test_a_signal_the_process_inherited_ignored_still_exits_inside_the_block():
    r, _ = _run("signal.signal(signal.SIGINT, signal.SIG_IGN)\n"           # a background job of a script
                "with exit_at_once_on_signals():\n"
                "    os.kill(os.getpid(), signal.SIGINT)\n"
                "    time.sleep(30)\n")
    assert r.returncode == 130, (r.returncode, r.stderr)
