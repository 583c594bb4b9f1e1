"""bdl_bench.orchestration.allocator: freed tensors stay in the process's heap (glibc), so the next step reuses their pages."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest
import torch

from bdl_bench.orchestration import allocator


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> _MallInfo2 | None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    fn = getattr(libc, "mallinfo2", None)  # glibc >= 2.33
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return fn()


@pytest.mark.skipif(not sys.platform.startswith("linux") or _mallinfo2() is None, reason="needs glibc >= 2.33")
def test_a_freed_16_mib_tensor_stays_in_the_heap() -> None:
    assert allocator.keep_freed_memory()
    assert allocator.keep_freed_memory()  # idempotent
    mapped_before = _mallinfo2().hblkhd
    t = torch.ones(4 << 20)  # 16 MiB: glibc's default would mmap it and unmap it on free
    assert _mallinfo2().hblkhd - mapped_before < 16 << 20  # from the heap, not an mmap of its own
    del t
    after = _mallinfo2()
    assert after.fordblks >= 16 << 20  # kept as free heap memory for the next step, not returned


def test_the_switch_keeps_glibcs_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_applied", False)
    monkeypatch.setenv(allocator.ENV_SWITCH, "system")
    assert not allocator.keep_freed_memory()
