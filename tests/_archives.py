"""Small generated archives for the loader tests (importable from any test module: tests/ is on sys.path)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def write_tar_gz(path: Path, members: dict[str, bytes]) -> Path:
    """A ``.tar.gz`` at ``path`` holding regular files ``name → bytes``; returns ``path``."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
