"""Our IDX parser (bdl_bench.data.idx) on tiny generated files."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from _archives import encode_idx, write_idx

from bdl_bench.data.idx import IdxFormatError, parse_idx, read_idx


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_round_trip(tmp_path: Path, dtype: type, suffix: str) -> None:
    array = (np.arange(2 * 3 * 4) - 5).astype(dtype).reshape(2, 3, 4)
    path = write_idx(array, tmp_path / f"x-idx3{suffix}")
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".gz")
    back = read_idx(path)
    np.testing.assert_array_equal(back, array)
    assert back.dtype == np.dtype(dtype) and not back.flags.writeable


def test_known_mnist_style_bytes() -> None:
    # Labels file: magic 0x00000801, 3 items; images file: magic 0x00000803, 1 image of 2x2.
    labels = bytes([0, 0, 8, 1]) + struct.pack(">I", 3) + bytes([7, 2, 1])
    images = bytes([0, 0, 8, 3]) + struct.pack(">III", 1, 2, 2) + bytes([0, 255, 128, 1])
    np.testing.assert_array_equal(parse_idx(labels), [7, 2, 1])
    np.testing.assert_array_equal(parse_idx(gzip.compress(images)), [[[0, 255], [128, 1]]])
    assert encode_idx(np.array([7, 2, 1], dtype=np.uint8)) == labels


def test_big_endian_values() -> None:
    raw = bytes([0, 0, 0x0C, 1]) + struct.pack(">I", 2) + struct.pack(">ii", 1, -2)
    np.testing.assert_array_equal(parse_idx(raw), [1, -2])


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"", "not an IDX file"),
        (b"PK\x03\x04rest", "not an IDX file"),
        (bytes([0, 0, 0x07, 1]) + struct.pack(">I", 1) + b"\0", "unknown IDX type"),
        (bytes([0, 0, 8, 3]) + struct.pack(">I", 1), "header says 3 dimensions"),
        (bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + b"abc", "needs 13 bytes, the file has 11"),
        (bytes([0, 0, 8, 1]) + struct.pack(">I", 1) + b"ab", "needs 9 bytes, the file has 10"),
        (b"\x1f\x8b\x08\x00garbage", "corrupt gzip"),
    ],
)
def test_malformed_files_are_refused(raw: bytes, match: str) -> None:
    with pytest.raises(IdxFormatError, match=match):
        parse_idx(raw)
