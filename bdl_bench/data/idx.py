"""Reading the IDX format of MNIST-style files (LeCun's ``*-idx3-ubyte``), plain or gzipped.

Layout (big-endian): two zero bytes, one type byte, one byte ``n_dims``, then ``n_dims`` unsigned
32-bit sizes, then the values row-major. Type bytes: 0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
0x0D float32, 0x0E float64.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from bdl_bench.errors import DataError

IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


class IdxFormatError(DataError):
    """Bytes that are not a well-formed IDX file."""


def parse_idx(raw: bytes, *, name: str = "<bytes>") -> np.ndarray:
    """A read-only native-endian array of IDX bytes (gunzipped first when they start with the gzip magic)."""
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise IdxFormatError(f"{name}: corrupt gzip stream: {err}") from err
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise IdxFormatError(f"{name}: not an IDX file (magic {raw[:4].hex() or 'empty'})")
    type_code, n_dims = raw[2], raw[3]
    if type_code not in IDX_TYPES:
        raise IdxFormatError(f"{name}: unknown IDX type byte 0x{type_code:02x}; known: {sorted(IDX_TYPES)}")
    header = 4 + 4 * n_dims
    if len(raw) < header:
        raise IdxFormatError(f"{name}: header says {n_dims} dimensions but the file has {len(raw)} bytes")
    shape = struct.unpack(f">{n_dims}I", raw[4:header])
    dtype = IDX_TYPES[type_code]
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise IdxFormatError(f"{name}: shape {shape} of {dtype} needs {expected} bytes, the file has {len(raw)}")
    array = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    array = array.astype(dtype.newbyteorder("="), copy=False)
    array.flags.writeable = False
    return array


def read_idx(path: str | Path) -> np.ndarray:
    """:func:`parse_idx` of a file on disk (``.gz`` or not: the content decides)."""
    path = Path(path)
    return parse_idx(path.read_bytes(), name=str(path))
