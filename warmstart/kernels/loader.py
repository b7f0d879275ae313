"""Loads the compiled kernel modules (built by `make venv` via setup.py): each as (module, None), or (None, the
reason it cannot run here), so every caller keeps a pure-torch path."""
from __future__ import annotations

import importlib
import os
import platform

_REQUIRED_X86_FLAGS = ("avx2", "fma", "f16c")   # the kernel is compiled for x86-64-v3's vector ISA (see setup.py)


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def load_native(name: str):
    """Returns (module, None) or (None, reason). Checks the CPU before loading: the .so holds AVX2/FMA/F16C code."""
    if os.environ.get("WARMSTART_NO_NATIVE_KERNELS"):
        return None, "disabled by WARMSTART_NO_NATIVE_KERNELS"
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags = _cpu_flags()
        if flags is None:
            return None, "cannot read /proc/cpuinfo to check for avx2/fma/f16c"
        missing = [f for f in _REQUIRED_X86_FLAGS if f not in flags]
        if missing:
            return None, f"CPU lacks {', '.join(missing)} (the kernel is built for x86-64-v3)"
    try:
        native = importlib.import_module(f"{__package__}.{name}")
    except ImportError as e:
        reason = f"extension not built ({e})"
        for err in (f"_build_error_{name}.txt", "_build_error.txt"):   # this module's own build, or all four's
            err = os.path.join(os.path.dirname(__file__), err)
            if os.path.exists(err):
                with open(err) as f:
                    reason += f"; last build: {f.read().strip()}"
                break
        return None, reason
    return native, None
