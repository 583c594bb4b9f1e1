"""Keep freed memory in the process instead of handing it back to the system (glibc's ``malloc``).

PyTorch's CPU tensors come from ``malloc``. By default glibc serves a large request (from 128 KiB, a
threshold that rises only as far as the largest block freed so far) with a fresh ``mmap`` and unmaps it when
the tensor is freed, and it returns free memory at the top of the heap to the system beyond 128 KiB. A
training step that makes megabyte-sized temporaries then pays a page fault for every 4 KiB of them at every
step, a large share of a small network's step (e.g. the stacked UCI jobs of SLANG Table 2: 100 copies of a
1x50 network, batch 100).

:func:`keep_freed_memory` raises both thresholds (``mallopt``: blocks up to 32 MiB come from the heap, and up
to 1 GiB of free heap is kept), so a step's temporaries reuse the pages of the last step's. A process's
resident memory then stays near its peak until it exits. ``bdl-bench`` calls it at the start of every job;
``BDL_BENCH_MALLOC=system`` keeps glibc's defaults. Elsewhere than glibc (macOS, musl) it does nothing.
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
