"""Small generated archives and IDX files for the loader tests (importable from any test module: tests/ is on sys.path)."""

from __future__ import annotations

import gzip
import io
import struct
import tarfile
from pathlib import Path

import numpy as np

from bdl_bench.data.idx import IDX_TYPES


def write_tar_gz(path: Path, members: dict[str, bytes]) -> Path:
    """A ``.tar.gz`` at ``path`` holding regular files ``name → bytes``; returns ``path``."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def encode_idx(array: np.ndarray) -> bytes:
    """IDX bytes of ``array`` (dtype one of :data:`~bdl_bench.data.idx.IDX_TYPES`' kinds)."""
    array = np.asarray(array)
    for code, dtype in IDX_TYPES.items():
        if array.dtype.kind == dtype.kind and array.dtype.itemsize == dtype.itemsize:
            header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
            return header + np.ascontiguousarray(array, dtype=dtype).tobytes()
    raise ValueError(f"no IDX type for dtype {array.dtype}")


def write_idx(array: np.ndarray, path: Path) -> Path:
    """Write ``array`` as IDX to ``path``, gzipped when its name ends in ``.gz``."""
    data = encode_idx(array)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path
