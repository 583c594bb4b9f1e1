"""Failed writes into a results folder (a full disk, a quota, a read-only or vanished folder) as one-line user
errors naming the file, the cause and the free space (:func:`write_error`): every file is written whole or not at
all (:func:`bdl_bench.results.atomic_write_bytes`), so the files written before are intact.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from bdl_bench.errors import UserError

CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.ENOENT: "the folder vanished",
    errno.ESTALE: "the folder vanished on the file server (stale file handle)",
    errno.EIO: "input/output error",
}
"""The ``errno`` values of a failed write that the user, not the code, must fix."""


class WriteError(UserError, OSError):
    """A results folder that cannot be written to (the message names it, the cause and the free space)."""


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def free_space(folder: Path) -> str | None:
    """``"<free> free of <total>"`` on the file system of ``folder`` (or of its nearest existing parent)."""
    for path in (Path(folder), *Path(folder).parents):
        if path.exists():
            try:
                usage = shutil.disk_usage(path)
            except OSError:
                return None
            return f"{_size(usage.free)} free of {_size(usage.total)}"
    return None


def write_error(error: BaseException, folder: Path | None = None) -> WriteError | None:
    """The :class:`WriteError` for ``error`` when it is a failed write into ``folder`` (an ``OSError`` whose
    ``errno`` is in :data:`CAUSES`; a missing file counts only once ``folder`` itself is gone, as a missing
    input file is another error), else ``None``. ``folder`` defaults to the failed file's folder."""
    if isinstance(error, WriteError):
        return error
    if not isinstance(error, OSError) or error.errno not in CAUSES or isinstance(error, UserError):
        return None
    filename = Path(error.filename) if error.filename else None
    if folder is None:
        if filename is None:
            return None
        folder = filename.parent
    folder = Path(folder)
    if error.errno == errno.ENOENT and folder.is_dir():
        return None
    free = free_space(folder) if error.errno in (errno.ENOSPC, errno.EDQUOT) else None
    what = f"cannot write {filename}" if filename is not None else f"cannot write to {folder}"
    return WriteError(
        f"{what}: {CAUSES[error.errno]}" + (f" ({free})" if free else "") + "; the files "
        "written before are intact (the last checkpoint too): make room, or choose another results_root=..., "
        "and run the same command again to resume"
    )
