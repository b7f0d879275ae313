"""Builds warmstart's compiled CPU kernels: paged attention (warmstart.kernels._paged), quantized linears
(warmstart.kernels._qlinear), the decode step's fused glue (warmstart.kernels._fused) and the decoder's layer loop
over them (warmstart.kernels._stack).

All package metadata lives in pyproject.toml; setuptools reads both. This file only adds the extension, and it never
makes an install fail: without torch importable (pip's build isolation: torch is deliberately not a build requirement,
so pip never downloads it here) the extension is skipped, and a compile error is logged and recorded in
warmstart/kernels/_build_error.txt. Either way warmstart.kernels falls back to pure torch and says why.

Set-up: the Makefile runs `python setup.py build_ext --inplace -q` after the editable install, once per module side
by side (WARMSTART_KERNELS below), so the .so lands next to warmstart/kernels/__init__.py (tests run from the
tree)."""
from __future__ import annotations

import os
import glob
import platform
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = {"_paged": ["warmstart/kernels/csrc/paged_attention.cpp"],
           "_qlinear": ["warmstart/kernels/csrc/qlinear.cpp"],
           "_fused": ["warmstart/kernels/csrc/fused.cpp"],
           "_stack": ["warmstart/kernels/csrc/decoder_stack.cpp"]}
# WARMSTART_KERNELS=_paged (a comma-separated list) builds only those modules: the Makefile starts one build per
# module at once, because setuptools builds extensions one after another and each is a single long compile (on 2
# cores the four took 7m51s in a row and about 3 minutes side by side). Each such build records its failure in a file
# of its own, so one module's success does not erase another's error.
ONLY = [k.strip() for k in os.environ.get("WARMSTART_KERNELS", "").split(",") if k.strip()]
unknown = sorted(set(ONLY) - set(SOURCES))
if unknown:
    sys.exit(f"WARMSTART_KERNELS names unknown modules {unknown}; known: {sorted(SOURCES)}")
if ONLY:
    SOURCES = {k: v for k, v in SOURCES.items() if k in ONLY}
ERROR_FILE = os.path.join(HERE, "warmstart", "kernels",
                          f"_build_error{'_' + '_'.join(sorted(SOURCES)) if ONLY else ''}.txt")

# Compile flags. On x86-64 the kernel targets the x86-64-v3 vector ISA (AVX2 + FMA + F16C): every x86 host this
# project runs on has it (the AVX2-only EPYCs as well as the AVX-512 ones), so one binary serves all of them; AVX-512
# would not run on the former. warmstart/kernels/__init__.py checks /proc/cpuinfo for avx2/fma/f16c before loading
# the .so and uses the pure-torch path otherwise. Other architectures build the kernel's scalar code paths.
CXX_FLAGS = ["-O3", "-fno-math-errno", "-DNDEBUG"]
# OpenMP: at::parallel_for is a header template, so it runs threads only when *this* file is compiled with OpenMP;
# without -fopenmp it silently runs every kernel on one thread. libgomp.so.1 then resolves to the copy torch already
# loaded (same soname), so the kernels share torch's thread pool and its OMP_* settings. Not on macOS (no libgomp in
# Apple's clang; those builds stay single-threaded).
OPENMP = [] if sys.platform == "darwin" else ["-fopenmp"]
CXX_FLAGS += OPENMP
if platform.machine().lower() in ("x86_64", "amd64"):
    CXX_FLAGS += ["-mavx2", "-mfma", "-mf16c"]


def _record_error(msg: str | None) -> None:
    try:
        if msg is None:
            if os.path.exists(ERROR_FILE):
                os.remove(ERROR_FILE)
        else:
            with open(ERROR_FILE, "w") as f:
                f.write(msg + "\n")
    except OSError:
        pass


ext_modules, cmdclass = [], {}
try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except Exception as e:  # noqa: BLE001 - no torch in this build environment: no extension, never a failed install
    print(f"warmstart: torch not importable here ({e!r}); skipping the paged-attention kernel", file=sys.stderr)
else:
    class SafeBuildExtension(BuildExtension):
        """A compile failure (or no usable compiler) degrades to the pure-torch fallback instead of failing."""

        def build_extension(self, ext):
            # Each extension in its own temp dir: torch's ninja build writes build.ninja and the header-dependency log
            # (.ninja_deps) into the temp dir, and one shared log keeps only the last-built extension's entries, so
            # an edited header rebuilt that one and left the other objects stale.
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

        def run(self):
            try:
                super().run()
            except Exception as e:  # noqa: BLE001
                msg = f"building warmstart.kernels failed: {type(e).__name__}: {e}"
                print(f"warmstart: {msg}; the pure-torch paged attention will be used", file=sys.stderr)
                _record_error(msg)
            else:
                _record_error(None)

    # depends: setuptools rebuilds an extension only when a listed file is newer than its .so; the sources include
    # these headers, so without them an edited header left a stale .so beside a rebuilt one (two builds of the same
    # inline code in one process: a crash once a shared type's layout changed).
    HEADERS = sorted(glob.glob("warmstart/kernels/csrc/*.h"))
    ext_modules = [CppExtension(f"warmstart.kernels.{name}", src, depends=HEADERS,
                                 extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=OPENMP)
                   for name, src in SOURCES.items()]
    cmdclass = {"build_ext": SafeBuildExtension.with_options(use_ninja=True)}

if os.environ.get("WARMSTART_SKIP_KERNEL_BUILD"):
    # The Makefile's editable install sets this and then builds the kernels once, with `setup.py build_ext
    # --inplace`: pip's editable build compiled all four in a temp dir of its own that the in-place build could not
    # reuse, so every fresh set-up (CI's included) compiled them twice, about 6 minutes on 2 cores.
    ext_modules = []

setup(ext_modules=ext_modules, cmdclass=cmdclass)
