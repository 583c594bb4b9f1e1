"""Keep freed memory in the process instead of handing it back to the system (glibc's ``malloc``).

By default glibc serves a large request (from 128 KiB) with a fresh ``mmap``, unmapped when the tensor is freed,
and returns free heap beyond 128 KiB to the system, so a training step that makes megabyte-sized temporaries pays
a page fault for every 4 KiB of them at every step (a large share of a small network's stacked step).
:func:`keep_freed_memory` raises both thresholds (blocks up to 32 MiB come from the heap; up to 1 GiB of free
heap is kept), so a step's temporaries reuse the last step's pages and resident memory stays near its peak.
``BDL_BENCH_MALLOC=system`` keeps glibc's defaults; elsewhere than glibc it does nothing. The step benchmarks
(``scripts/bench_step.py``, ``bdl-bench reproduce ktied_table4``) apply it too, so they time the steps runs take.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
ENV_SWITCH = "BDL_BENCH_MALLOC"

_applied = False


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring) once per process; whether they are set."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux") or os.environ.get(ENV_SWITCH, "").lower() == "system":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt  # glibc only (musl has none)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


def malloc_setting() -> str:
    """How this process's ``malloc`` treats freed memory, for a benchmark's record: ``kept`` or ``system``."""
    return "kept" if _applied else "system"
