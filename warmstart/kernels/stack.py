"""The decoder's layer loop over the kernels, in one call (csrc/decoder_stack.cpp); warmstart/models/native.py
decides when a model and a step may use it."""
from __future__ import annotations

from warmstart.kernels.loader import load_native

_stack, STACK_UNAVAILABLE_REASON = load_native("_stack")


def native_stack():
    """The compiled decoder-stack module (its Stack, Layer and Linear classes), or None."""
    return _stack
