"""CIFAR-10 and CIFAR-100 from the *binary* tarballs (``vision/cifar10``, ``vision/cifar100``).

The python-version tarballs hold pickles, which are never loaded from the network here. In the
binary version each record is ``label_bytes`` label bytes followed by 3072 pixel bytes: the 1024 red
values of the 32×32 image row-major, then green, then blue (Krizhevsky's CIFAR page). CIFAR-10 has
one label byte (class 0–9) in ``cifar-10-batches-bin/data_batch_{1..5}.bin`` and ``test_batch.bin``;
CIFAR-100 two (coarse 0–19, fine 0–99) in ``cifar-100-binary/train.bin`` and ``test.bin``. Members
are read straight from the verified tarball (every member name checked), never extracted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bdl_bench.data.archives import iter_tar_files
from bdl_bench.data.base import Dataset, register_dataset
from bdl_bench.data.registry_files import get_file
from bdl_bench.data.vision import ImageArrays, check_ood, image_dataset, read_ood, register_ood
from bdl_bench.errors import ConfigError, DataError

IMAGE_SHAPE = (3, 32, 32)
_OOD_CHOICES = ("svhn", "cifar10", "cifar100")
PIXELS = 3 * 32 * 32


@dataclass(frozen=True)
class CifarLayout:
    """Where a CIFAR variant keeps its records inside the tarball, and how labels are stored."""

    name: str  # dataset name
    key: str  # cache key of the tarball (registry_files.FILES)
    train_members: tuple[str, ...]
    test_members: tuple[str, ...]
    label_bytes: int
    n_classes: dict[str, int]  # label kind -> number of classes

    def label_index(self, label: str) -> int:
        """Which label byte of a record holds the label kind ``label``."""
        if label not in self.n_classes:
            raise ConfigError(f"{self.name}: label must be one of {', '.join(self.n_classes)}, got {label!r}")
        return 0 if label == "coarse" else self.label_bytes - 1


CIFAR10 = CifarLayout(
    name="vision/cifar10",
    key="cifar10/cifar-10-binary.tar.gz",
    train_members=tuple(f"cifar-10-batches-bin/data_batch_{i}.bin" for i in range(1, 6)),
    test_members=("cifar-10-batches-bin/test_batch.bin",),
    label_bytes=1,
    n_classes={"fine": 10},
)
CIFAR100 = CifarLayout(
    name="vision/cifar100",
    key="cifar100/cifar-100-binary.tar.gz",
    train_members=("cifar-100-binary/train.bin",),
    test_members=("cifar-100-binary/test.bin",),
    label_bytes=2,
    n_classes={"coarse": 20, "fine": 100},
)


def parse_cifar_records(
    raw: bytes, *, label_bytes: int, label_index: int | None = None, name: str = "<bytes>"
) -> ImageArrays:
    """``(N, 3, 32, 32)`` uint8 images and ``(N,)`` int64 labels of concatenated ``label_bytes + 3072``-byte
    records; ``label_index`` picks the label byte (default: the last, i.e. CIFAR-100's fine label)."""
    record = label_bytes + PIXELS
    if len(raw) == 0 or len(raw) % record:
        raise DataError(f"{name}: {len(raw)} bytes is not a whole number of {record}-byte CIFAR records")
    index = label_bytes - 1 if label_index is None else label_index
    if not 0 <= index < label_bytes:
        raise DataError(f"{name}: label_index {label_index} out of range for {label_bytes} label byte(s)")
    table = np.frombuffer(raw, dtype=np.uint8).reshape(-1, record)
    labels = table[:, index].astype(np.int64)
    images = table[:, label_bytes:].reshape(-1, *IMAGE_SHAPE)
    return ImageArrays(images, labels)


def read_cifar_archive(archive: Path, layout: CifarLayout, label: str = "fine") -> tuple[ImageArrays, ImageArrays]:
    """The training and test splits of a CIFAR binary tarball (a missing member is a :class:`DataError`)."""
    label_index = layout.label_index(label)
    wanted = set(layout.train_members) | set(layout.test_members)
    found = {
        name.removeprefix("./"): data
        for name, data in iter_tar_files(archive, lambda n: n.removeprefix("./") in wanted)
    }
    missing = sorted(wanted - set(found))
    if missing:
        raise DataError(f"{archive}: missing member(s) {', '.join(missing)}")

    def join(members: tuple[str, ...]) -> ImageArrays:
        parts = [
            parse_cifar_records(found[m], label_bytes=layout.label_bytes, label_index=label_index, name=m)
            for m in members
        ]
        return ImageArrays(np.concatenate([p.images for p in parts]), np.concatenate([p.labels for p in parts]))

    return join(layout.train_members), join(layout.test_members)


def _load(
    layout: CifarLayout, label: str, ood: str | None, root: str | Path | None, mirror: str | Path | None, **options: Any
) -> Dataset:
    """``layout``'s dataset with ``label``'s classes; ``options`` are :func:`image_dataset`'s."""
    ood = check_ood(ood, _OOD_CHOICES, layout.name)  # bad options fail before the download
    layout.label_index(label)
    train, test = read_cifar_archive(get_file(layout.key, root=root, mirror=mirror), layout, label)
    n_classes = layout.n_classes[label]
    return image_dataset(
        layout.name, train=train, test=test, n_classes=n_classes, ood=read_ood(ood, root, mirror), **options
    )


@register_dataset("vision/cifar10")
def load_cifar10(
    *,
    n_val: int = 0,
    flatten: bool = False,
    standardise: bool = True,
    crop_padding: int = 4,
    horizontal_flip: bool = True,
    ood: str | None = "svhn",
    root: str | Path | None = None,
    mirror: str | Path | None = None,
) -> Dataset:
    """CIFAR-10: 50k training images (the last ``n_val`` for validation), 10k test, 10 classes.

    ``flatten``: ``(N, 3072)`` rows instead of ``(N, 3, 32, 32)`` images; ``standardise``: each channel with the
    training part's mean and std; training augmentation: a random 32×32 crop of the image zero-padded by
    ``crop_padding`` (0: off) and a random left-right flip; ``ood``: DEF Table 1's ``svhn``, ``cifar100`` or
    ``None``; ``root``: cache folder (default ``$BDL_BENCH_DATA`` or ``~/.cache/bdl-bench``); ``mirror``: folder
    or base URL holding the tarball, tried before the canonical URL.
    """
    options = dict(n_val=n_val, flatten=flatten, standardise=standardise, augmentation=(crop_padding, horizontal_flip))
    return _load(CIFAR10, "fine", ood, root, mirror, **options)


@register_dataset("vision/cifar100")
def load_cifar100(
    *,
    label: str = "fine",
    n_val: int = 10000,
    flatten: bool = False,
    standardise: bool = True,
    crop_padding: int = 0,
    horizontal_flip: bool = False,
    ood: str | None = None,
    root: str | Path | None = None,
    mirror: str | Path | None = None,
) -> Dataset:
    """CIFAR-100: 50k training images (k-tied: the last 10k for validation), 10k test; ``label`` is
    ``fine`` (100 classes) or ``coarse`` (20). Other options as :func:`load_cifar10`."""
    options = dict(n_val=n_val, flatten=flatten, standardise=standardise, augmentation=(crop_padding, horizontal_flip))
    return _load(CIFAR100, label, ood, root, mirror, **options)


def _test_split(layout: CifarLayout, root: str | Path | None = None, mirror: str | Path | None = None) -> ImageArrays:
    return read_cifar_archive(get_file(layout.key, root=root, mirror=mirror), layout)[1]


register_ood("cifar10")(partial(_test_split, CIFAR10))
register_ood("cifar100")(partial(_test_split, CIFAR100))
