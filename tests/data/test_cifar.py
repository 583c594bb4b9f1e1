"""Our CIFAR binary-format parser and the CIFAR loaders on tiny generated tarballs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from _archives import write_tar_gz

from bdl_bench.data import build_dataset, registry_files
from bdl_bench.data.cifar import CIFAR10, CIFAR100, parse_cifar_records, read_cifar_archive
from bdl_bench.data.download import RemoteFile


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never contact the canonical URLs: files come from generated mirrors or ../shared only."""
    monkeypatch.setenv("BDL_BENCH_OFFLINE", "1")


def _records(n: int, label_bytes: int, seed: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=(n, label_bytes), dtype=np.uint8)
    images = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
    raw = b"".join(labels[i].tobytes() + images[i].tobytes() for i in range(n))  # R plane, G plane, B plane
    return raw, labels, images


def test_parse_one_label_byte() -> None:
    raw, labels, images = _records(3, 1, seed=0)
    arrays = parse_cifar_records(raw, label_bytes=1)
    np.testing.assert_array_equal(arrays.images, images)
    np.testing.assert_array_equal(arrays.labels, labels[:, 0])
    assert arrays.images.shape == (3, 3, 32, 32) and arrays.labels.dtype == np.int64


def test_parse_channel_planes_and_pixel_order() -> None:
    record = bytearray([4]) + bytes(3072)
    record[1 + 0 * 1024 + 0 * 32 + 1] = 10  # red, row 0, column 1
    record[1 + 1 * 1024 + 2 * 32 + 0] = 20  # green, row 2, column 0
    record[1 + 2 * 1024 + 31 * 32 + 31] = 30  # blue, last pixel
    image = parse_cifar_records(bytes(record), label_bytes=1).images[0]
    assert (image[0, 0, 1], image[1, 2, 0], image[2, 31, 31]) == (10, 20, 30)
    assert int(image.sum()) == 60


def test_parse_two_label_bytes_coarse_and_fine() -> None:
    raw, labels, _ = _records(4, 2, seed=1)
    np.testing.assert_array_equal(parse_cifar_records(raw, label_bytes=2).labels, labels[:, 1])
    np.testing.assert_array_equal(parse_cifar_records(raw, label_bytes=2, label_index=0).labels, labels[:, 0])


def test_parse_refuses_partial_records() -> None:
    raw, _, _ = _records(2, 1, seed=2)
    with pytest.raises(ValueError, match="not a whole number of 3073-byte CIFAR records"):
        parse_cifar_records(raw[:-1], label_bytes=1)
    with pytest.raises(ValueError, match="label_index 2 out of range"):
        parse_cifar_records(raw, label_bytes=1, label_index=2)


def _cifar10write_tar_gz(path: Path, n_per_batch: int = 2) -> Path:
    members = {}
    for i, member in enumerate((*CIFAR10.train_members, *CIFAR10.test_members)):
        members[member] = _records(n_per_batch, 1, seed=10 + i)[0]
    return write_tar_gz(path, members)


def test_read_archive_joins_the_training_batches(tmp_path: Path) -> None:
    train, test = read_cifar_archive(_cifar10write_tar_gz(tmp_path / "c10.tar.gz"), CIFAR10)
    assert train.images.shape == (10, 3, 32, 32) and test.images.shape == (2, 3, 32, 32)
    np.testing.assert_array_equal(train.images[:2], _records(2, 1, seed=10)[2])


def test_read_archive_reports_missing_members(tmp_path: Path) -> None:
    archive = write_tar_gz(tmp_path / "c100.tar.gz", {"cifar-100-binary/train.bin": _records(2, 2, 0)[0]})
    with pytest.raises(ValueError, match="missing member.*cifar-100-binary/test.bin"):
        read_cifar_archive(archive, CIFAR100)
    with pytest.raises(ValueError, match="label must be one of"):
        read_cifar_archive(archive, CIFAR100, label="medium")


def test_cifar10_loader_from_a_mirror_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    archive = _cifar10write_tar_gz(mirror / "cifar-10-binary.tar.gz", n_per_batch=4)
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    monkeypatch.setitem(registry_files.FILES, CIFAR10.key, RemoteFile(CIFAR10.key, urls=(), sha256=sha))
    data = build_dataset(
        {
            "name": "vision/cifar10",
            "n_val": 5,
            "flatten": False,
            "standardise": True,
            "crop_padding": 4,
            "horizontal_flip": True,
            "ood": None,
            "root": str(tmp_path / "cache"),
            "mirror": str(mirror),
        }
    )
    assert data.n_classes == 10 and data.input_shape == (3, 32, 32) and data.n_features == 3
    assert (data.n_train, data.x_val.shape[0], data.x_test.shape[0]) == (15, 5, 4)
    means = data.x_train.mean(dim=(0, 2, 3))
    torch.testing.assert_close(means, torch.zeros(3), atol=1e-5, rtol=0)  # standardised with training stats
    assert data.augmentation is not None and data.x_ood is None
    out = data.augmentation(data.x_train, torch.Generator().manual_seed(0))
    assert out.shape == data.x_train.shape
    assert (tmp_path / "cache" / CIFAR10.key).is_file()
