"""Ctrl-C and SIGTERM while heavy modules import.

Python's own handlers raise (KeyboardInterrupt; SIGTERM's SystemExit, __main__.py) at the next bytecode, and during
`import torch` that bytecode can run inside torch's C++ initialisation calling back into Python (pybind11): the
exception cannot unwind through it, and the process aborted ("terminate called after throwing an instance of
'pybind11::error_already_set' ... KeyboardInterrupt", SIGABRT) or hung. Nothing that needs cleaning up has started
at that point, so while such imports run these signals end the process at once with the exit codes the commands
use anyway: 130 for SIGINT, 0 for SIGTERM. Main thread only (signal.signal)."""
from __future__ import annotations

import contextlib
import os
import signal

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 0}


def _exit_now(signum: int, frame) -> None:
    os._exit(EXIT_CODES[signum])   # no unwinding, no teardown racing a half-initialised extension


@contextlib.contextmanager
def exit_at_once_on_signals():
    """SIGINT/SIGTERM inside the block exit the process immediately (130 / 0); the previous handlers come back
    after it."""
    # Also when the process was started with them ignored (a background job of a non-interactive shell inherits
    # SIGINT ignored): uvicorn's handlers stop the server on SIGINT later either way, so it does so from the start.
    previous = {sig: signal.signal(sig, _exit_now) for sig in EXIT_CODES}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
