"""Vision loaders: MNIST / notMNIST from the shared copy used as a mirror, SVHN .mat parsing,
preprocessing and the CIFAR-style augmentation."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from _archives import write_svhn_mat

from bdl_bench.data import build_dataset, registry_files
from bdl_bench.data.base import Task
from bdl_bench.data.download import RemoteFile
from bdl_bench.data.svhn import read_svhn_mat
from bdl_bench.data.vision import ImageArrays, ImageAugmentation, Preprocess, load_mnist, load_notmnist

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(
    not (SHARED / "mnist").is_dir(), reason="../shared/data (the test mirror) is not beside the checkout"
)


@needs_shared
def test_mnist_loads_from_the_shared_copy_as_mirror(tmp_path: Path) -> None:
    data = load_mnist(n_val=10000, flatten=True, standardise=False, ood=None, root=tmp_path, mirror=SHARED / "mnist")
    assert data.task is Task.MULTICLASS and data.n_classes == 10
    assert (data.n_train, data.x_val.shape[0], data.x_test.shape[0]) == (50000, 10000, 10000)
    assert data.x_train.shape == (50000, 784) and data.x_train.dtype == torch.float32
    assert 0.0 <= float(data.x_train.min()) and float(data.x_train.max()) == 1.0
    assert data.y_train.dtype == torch.long
    # Label counts of the official test set (shared/data/mnist/README.md).
    counts = torch.bincount(data.y_test, minlength=10).tolist()
    assert counts == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert sorted(p.name for p in (tmp_path / "mnist").glob("*.gz")) == sorted(
        p.name for p in (SHARED / "mnist").glob("*.gz")
    )


@needs_shared
def test_mnist_images_with_notmnist_ood_from_the_shared_root(tmp_path: Path) -> None:
    """One mirror folder holding both sets: files are found by cache key (mnist/..., notmnist/...)."""
    data = build_dataset(
        {"name": "vision/mnist", "n_val": 0, "flatten": False, "standardise": True, "ood": "notmnist",
         "root": str(tmp_path), "mirror": str(SHARED)}
    )  # fmt: skip
    assert data.input_shape == (1, 28, 28) and data.n_features == 1 and data.x_val.shape == (0, 1, 28, 28)
    assert data.x_ood is not None and data.x_ood.shape == (10000, 1, 28, 28) and data.ood_name == "vision/notmnist"
    assert abs(float(data.x_train.mean())) < 1e-3  # standardised with training statistics...
    assert 0.9 < float(data.x_ood.mean()) < 1.0  # ...which leave the brighter letters off (pixel mean 109 vs 33)
    notmnist = load_notmnist(n_test=2000, n_val=1000, flatten=True, standardise=False, root=tmp_path, mirror=SHARED)
    assert (notmnist.n_train, notmnist.x_val.shape[0], notmnist.x_test.shape[0]) == (7000, 1000, 2000)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never contact the canonical URLs: files come from generated mirrors or ../shared only."""
    monkeypatch.setenv("BDL_BENCH_OFFLINE", "1")


def test_mnist_without_a_source_names_the_mirror_option(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"(?s)mnist/train-images-idx3-ubyte\.gz.*data\.mirror="):
        load_mnist(ood=None, root=tmp_path, mirror=tmp_path / "empty")


def test_preprocess_statistics_and_flattening() -> None:
    images = np.stack([np.zeros((2, 3, 3), np.uint8), np.full((2, 3, 3), 255, np.uint8)])  # (2, 2, 3, 3)
    images[:, 1] = 51
    prep = Preprocess.fit(images, standardise=True, flatten=False)
    torch.testing.assert_close(prep.mean, torch.tensor([0.5, 0.2]))
    torch.testing.assert_close(prep.std, torch.tensor([0.5, 1e-8]))
    x = Preprocess.fit(images, standardise=False, flatten=True)(images)
    assert x.shape == (2, 18) and float(x.max()) == 1.0
    assert prep(images[:0]).shape == (0, 2, 3, 3) and Preprocess(None, None, True)(images[:0]).shape == (0, 18)


def test_augmentation_is_a_crop_and_flip_driven_by_the_generator() -> None:
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4) + 1
    flip_only = ImageAugmentation(crop_padding=0, horizontal_flip=True, image_shape=(3, 4, 4))
    out = flip_only(x, torch.Generator().manual_seed(0))
    for i in range(2):
        assert torch.equal(out[i], x[i]) or torch.equal(out[i], x[i].flip(-1))
    crop = ImageAugmentation(crop_padding=2, horizontal_flip=False, image_shape=(3, 4, 4))
    a = crop(x, torch.Generator().manual_seed(1))
    b = crop(x, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == x.shape
    for i in range(2):  # every output is a 4x4 window of the zero-padded input, same window for all channels
        padded = torch.nn.functional.pad(x[i], (2, 2, 2, 2))
        windows = [padded[:, r : r + 4, c : c + 4] for r in range(5) for c in range(5)]
        assert any(torch.equal(a[i], w) for w in windows)
    flat = crop(x.reshape(2, -1), torch.Generator().manual_seed(1))
    assert torch.equal(flat, a.reshape(2, -1))


def test_svhn_mat_layout_and_label_ten_is_zero(tmp_path: Path) -> None:
    x, y = write_svhn_mat(tmp_path / "test_32x32.mat", 5, seed=0)
    arrays = read_svhn_mat(tmp_path / "test_32x32.mat")
    assert arrays.images.shape == (5, 3, 32, 32)
    assert arrays.images[2, 1, 4, 7] == x[4, 7, 1, 2]  # X[row, column, channel, example]
    expected = y.ravel().astype(np.int64)
    expected[expected == 10] = 0
    np.testing.assert_array_equal(arrays.labels, expected)
    assert arrays.labels[0] == 0 and arrays.labels.max() <= 9
    scipy.io.savemat(tmp_path / "bad.mat", {"X": x[:, :, :, :2], "y": y})
    with pytest.raises(ValueError, match="expected"):
        read_svhn_mat(tmp_path / "bad.mat")


def test_svhn_loader_from_a_mirror_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name, n in (("train_32x32.mat", 6), ("test_32x32.mat", 3)):
        write_svhn_mat(mirror / name, n, seed=n)
        sha = hashlib.sha256((mirror / name).read_bytes()).hexdigest()
        monkeypatch.setitem(registry_files.FILES, f"svhn/{name}", RemoteFile(f"svhn/{name}", urls=(), sha256=sha))
    data = build_dataset(
        {"name": "vision/svhn", "use_extra": False, "n_val": 2, "flatten": True, "standardise": False,
         "crop_padding": 0, "horizontal_flip": False, "ood": None, "root": str(tmp_path / "c"), "mirror": str(mirror)}
    )  # fmt: skip
    assert data.x_train.shape == (4, 3072) and data.x_val.shape == (2, 3072) and data.x_test.shape == (3, 3072)
    assert data.augmentation is None


def test_ood_set_must_match_the_image_shape() -> None:
    from bdl_bench.data.vision import image_dataset

    rng = np.random.default_rng(0)
    train = ImageArrays(rng.integers(0, 256, (4, 1, 8, 8), dtype=np.uint8), np.arange(4))
    ood = ImageArrays(rng.integers(0, 256, (2, 3, 8, 8), dtype=np.uint8), np.arange(2))
    with pytest.raises(ValueError, match="OOD set vision/x has images"):
        image_dataset("t", train=train, test=train, n_classes=4, n_val=0, flatten=False, standardise=False,
                      ood=("vision/x", ood))  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown ood set 'svhn'; choose one of notmnist"):
        load_mnist(ood="svhn", mirror=None)
