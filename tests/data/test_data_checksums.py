"""Shipped files are complete, small, and verified; corruption and absence raise DataFileError."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bdl_bench.data import build_dataset
from bdl_bench.data.base import default_data_root
from bdl_bench.data.checksums import check_all, compute_manifest, load_manifest, parse_manifest
from bdl_bench.errors import DataFileError

DATA = default_data_root()


def _copy_boston(tmp_path: Path) -> Path:
    shutil.copytree(DATA / "uci" / "bostonHousing", tmp_path / "uci" / "bostonHousing")
    return tmp_path / "uci" / "bostonHousing"


def test_manifest_covers_every_shipped_file() -> None:
    assert parse_manifest(compute_manifest(DATA)) == load_manifest()
    assert check_all(DATA) == []


def test_no_file_over_5mb() -> None:
    big = [p for p in DATA.rglob("*") if p.is_file() and p.stat().st_size > 5 * 2**20]
    assert big == []


def test_copy_with_root_loads(tmp_path: Path) -> None:
    _copy_boston(tmp_path)
    ds = build_dataset({"name": "uci/boston", "split": 1, "root": str(tmp_path)})
    assert ds.n_train == 455


def test_corrupted_file(tmp_path: Path) -> None:
    folder = _copy_boston(tmp_path)
    target = folder / "data.txt"
    raw = bytearray(target.read_bytes())
    raw[100] ^= 0x01
    target.write_bytes(bytes(raw))
    with pytest.raises(DataFileError, match="corrupted") as err:
        build_dataset({"name": "uci/boston", "split": 0, "root": str(tmp_path)})
    assert str(target) in str(err.value) and "data/README.md" in str(err.value)


def test_corrupted_mat_file(tmp_path: Path) -> None:
    shutil.copytree(DATA / "libsvm", tmp_path / "libsvm")
    target = tmp_path / "libsvm" / "australian_scale.mat"
    raw = bytearray(target.read_bytes())
    raw[-10] ^= 0xFF
    target.write_bytes(bytes(raw))
    with pytest.raises(DataFileError, match="australian_scale.mat"):
        build_dataset({"name": "libsvm/australian", "root": tmp_path})


def test_missing_file(tmp_path: Path) -> None:
    folder = _copy_boston(tmp_path)
    (folder / "index_test_2.txt").unlink()
    with pytest.raises(DataFileError, match="missing") as err:
        build_dataset({"name": "uci/boston", "split": 2, "root": str(tmp_path)})
    assert str(folder / "index_test_2.txt") in str(err.value)
    with pytest.raises(DataFileError, match="usps_3vs5.npz"):
        build_dataset({"name": "libsvm/usps_3vs5", "root": str(tmp_path)})
