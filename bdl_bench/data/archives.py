"""Safe reading of downloaded tar archives, never extracted: every member is checked before it is read, and an
absolute path, a ``..`` component, a link or a special file is refused (:class:`UnsafeArchiveError`)."""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from bdl_bench.errors import DataError


class UnsafeArchiveError(DataError):
    """An archive member would land outside the destination (absolute path, ``..``, link, device)."""


def check_member(member: tarfile.TarInfo) -> None:
    """Refuse (naming it) a member with an absolute path, a ``..`` component, or that is not a file or folder."""
    name = member.name
    path = PurePosixPath(name)
    if name.startswith(("/", "\\")) or path.is_absolute() or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchiveError(f"archive member {name!r} has an absolute path; refusing to extract")
    if ".." in path.parts or ".." in PurePosixPath(name.replace("\\", "/")).parts:
        raise UnsafeArchiveError(f"archive member {name!r} contains '..'; refusing to extract")
    if not (member.isfile() or member.isdir()):
        raise UnsafeArchiveError(f"archive member {name!r} is a link or special file; refusing to extract")


def iter_tar_files(archive: Path, select: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """``(name, bytes)`` of each regular member whose name ``select`` accepts, in archive order.

    Reads sequentially (fast for ``.tar.gz``); every member is checked as in :func:`check_member`.
    """
    with tarfile.open(archive, mode="r:*") as tar:
        for member in tar:
            check_member(member)
            if member.isfile() and select(member.name):
                handle = tar.extractfile(member)
                assert handle is not None
                yield member.name, handle.read()
