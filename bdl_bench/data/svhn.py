"""SVHN cropped digits (``vision/svhn``), from the format-2 ``.mat`` files (MATLAB v5, ``scipy.io.loadmat``).

Each file holds ``X``: ``(32, 32, 3, N)`` uint8 and ``y``: ``(N, 1)`` with labels 1–10, where 10 means
the digit 0 (Netzer et al., 2011); labels here are 0–9. Also CIFAR-10's OOD set in DEF Table 1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.io

from bdl_bench.data.base import Dataset, register_dataset
from bdl_bench.data.registry_files import get_file
from bdl_bench.data.vision import ImageArrays, check_ood, image_dataset, read_ood, register_ood
from bdl_bench.errors import DataError

_OOD_CHOICES = ("cifar10", "cifar100")


def read_svhn_mat(path: str | Path) -> ImageArrays:
    """Images ``(N, 3, 32, 32)`` uint8 and labels ``(N,)`` in 0–9 from one SVHN ``.mat`` file."""
    mat = scipy.io.loadmat(str(path), variable_names=["X", "y"])
    if "X" not in mat or "y" not in mat:
        raise DataError(f"{path}: expected variables X and y, found {sorted(k for k in mat if not k.startswith('__'))}")
    x, y = np.asarray(mat["X"]), np.asarray(mat["y"]).reshape(-1).astype(np.int64)
    if x.ndim != 4 or x.shape[:3] != (32, 32, 3) or x.shape[3] != y.shape[0]:
        raise DataError(f"{path}: X has shape {x.shape} and y {y.shape}; expected (32, 32, 3, N) and (N, 1)")
    if y.size and (y.min() < 0 or y.max() > 10):
        raise DataError(f"{path}: labels outside 0..10 (min {y.min()}, max {y.max()})")
    y[y == 10] = 0
    return ImageArrays(np.ascontiguousarray(x.transpose(3, 2, 0, 1)).astype(np.uint8, copy=False), y)


@register_ood("svhn")
def read_svhn_test(root: str | Path | None = None, mirror: str | Path | None = None) -> ImageArrays:
    """SVHN's 26,032 test digits."""
    return read_svhn_mat(get_file("svhn/test_32x32.mat", root=root, mirror=mirror))


@register_dataset("vision/svhn")
def load_svhn(
    *,
    use_extra: bool = False,
    n_val: int = 0,
    flatten: bool = False,
    standardise: bool = True,
    crop_padding: int = 0,
    horizontal_flip: bool = False,
    ood: str | None = None,
    root: str | Path | None = None,
    mirror: str | Path | None = None,
) -> Dataset:
    """SVHN: 73,257 training digits (+531,131 with ``use_extra``; the last ``n_val`` for validation),
    26,032 test digits, 10 classes. Options as :func:`bdl_bench.data.cifar.load_cifar10`
    (``ood``: ``cifar10``, ``cifar100`` or ``None``); flips are off by default (digits are not symmetric)."""
    ood = check_ood(ood, _OOD_CHOICES, "vision/svhn")
    train = read_svhn_mat(get_file("svhn/train_32x32.mat", root=root, mirror=mirror))
    if use_extra:
        extra = read_svhn_mat(get_file("svhn/extra_32x32.mat", root=root, mirror=mirror))
        train = ImageArrays(np.concatenate([train.images, extra.images]), np.concatenate([train.labels, extra.labels]))
    return image_dataset(
        "vision/svhn",
        train=train,
        test=read_svhn_test(root, mirror),
        n_classes=10,
        n_val=n_val,
        flatten=flatten,
        standardise=standardise,
        ood=read_ood(ood, root, mirror),
        augmentation=(crop_padding, horizontal_flip),
    )
