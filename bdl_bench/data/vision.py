"""Image datasets: shared preprocessing, CIFAR-style augmentation, MNIST and notMNIST (``vision/*``).

Images are kept in memory as float32 tensors ``(N, C, H, W)`` scaled to [0, 1] — or flattened to
``(N, C·H·W)`` for MLPs (``data.flatten=true``) — optionally standardised per channel with the
statistics of the training part (``data.standardise=true``). The out-of-distribution set of a loader
(``data.ood=...``) is preprocessed with the same statistics. Validation rows are the *last* ``n_val``
rows of the official training set (SLANG Table 3: MNIST 50k / 10k; k-tied: CIFAR-100 last 10k).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from bdl_bench.data.base import Dataset, Task, register_dataset
from bdl_bench.data.idx import read_idx
from bdl_bench.data.registry_files import get_file
from bdl_bench.errors import ConfigError, DataError
from bdl_bench.registry import import_submodules, registrar


@dataclass(frozen=True)
class ImageArrays:
    """Raw images ``(N, C, H, W)`` uint8 and integer labels ``(N,)`` of one official split."""

    images: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.shape[0] != self.labels.shape[0]:
            raise ConfigError(
                f"images {self.images.shape} and labels {self.labels.shape} do not match (N, C, H, W)/(N,)"
            )


@dataclass(frozen=True)
class ImageAugmentation:
    """A random ``H × W`` crop of each image zero-padded by ``crop_padding`` pixels on each side (0: off), and a
    left-right flip with probability 1/2, per example of a ``(N, C, H, W)`` batch, or of a flattened ``(N, C·H·W)``
    one (unflattened to ``image_shape``). Randomness comes only from ``generator`` (drawn on the CPU, applied on
    ``x``'s device)."""

    crop_padding: int
    horizontal_flip: bool
    image_shape: tuple[int, int, int]

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        flat = x.dim() == 2
        if flat:
            x = x.view(x.shape[0], *self.image_shape)
        n, _, height, width = x.shape
        pad = self.crop_padding
        if pad:
            padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
            dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator).to(x.device)
            dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator).to(x.device)
            rows = (dy[:, None] + torch.arange(height, device=x.device))[:, None, :, None]  # (N, 1, H, 1)
            cols = (dx[:, None] + torch.arange(width, device=x.device))[:, None, None, :]  # (N, 1, 1, W)
            batch = torch.arange(n, device=x.device)[:, None, None, None]
            channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
            x = padded[batch, channel, rows, cols]
        if self.horizontal_flip:
            flip = (torch.rand(n, generator=generator) < 0.5).to(x.device)
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return x.flatten(1) if flat else x


def split_last(arrays: ImageArrays, n_val: int, name: str) -> tuple[ImageArrays, ImageArrays]:
    """The first ``N - n_val`` rows for training and the last ``n_val`` for validation."""
    n = arrays.images.shape[0]
    if not 0 <= n_val < n:
        raise ConfigError(f"{name}: n_val must be in [0, {n}), got {n_val}")
    cut = n - n_val
    return ImageArrays(arrays.images[:cut], arrays.labels[:cut]), ImageArrays(arrays.images[cut:], arrays.labels[cut:])


@dataclass(frozen=True)
class Preprocess:
    """uint8 images → float tensors: scale to [0, 1], optionally standardise per channel, optionally flatten."""

    mean: Tensor | None  # (C,) training-part channel means (after scaling), or None
    std: Tensor | None  # (C,)
    flatten: bool

    @staticmethod
    def fit(train_images: np.ndarray, *, standardise: bool, flatten: bool) -> Preprocess:
        if not standardise:
            return Preprocess(None, None, flatten)
        n, channels = train_images.shape[:2]
        total = np.zeros(channels)
        total_sq = np.zeros(channels)
        for start in range(0, n, 2048):  # float64 moments in blocks: no full-size float copy of the data
            block = train_images[start : start + 2048].astype(np.float64) / 255.0
            total += block.sum(axis=(0, 2, 3))
            total_sq += np.square(block).sum(axis=(0, 2, 3))
        count = n * train_images.shape[2] * train_images.shape[3]
        mean = total / count
        std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0)).clip(min=1e-8)
        return Preprocess(torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32), flatten)

    def __call__(self, images: np.ndarray) -> Tensor:
        x = torch.from_numpy(np.array(images, dtype=np.uint8)).to(torch.float32).div_(255.0)
        if self.mean is not None and self.std is not None:
            x.sub_(self.mean[None, :, None, None]).div_(self.std[None, :, None, None])
        return x.flatten(1) if self.flatten else x


def image_dataset(
    name: str,
    *,
    train: ImageArrays,
    test: ImageArrays,
    n_classes: int,
    n_val: int,
    flatten: bool,
    standardise: bool,
    ood: tuple[str, ImageArrays] | None = None,
    augmentation: tuple[int, bool] | None = None,
) -> Dataset:
    """A multiclass :class:`Dataset` of the official splits (see module docstring): the last ``n_val`` rows of
    ``train`` for validation, ``ood`` ``(name, arrays)`` preprocessed like ``test``, and ``augmentation``
    ``(crop_padding, horizontal_flip)`` for the training loop."""
    crop, flip = augmentation or (0, False)
    fit, val = split_last(train, n_val, name)
    prep = Preprocess.fit(fit.images, standardise=standardise, flatten=flatten)
    shape = tuple(train.images.shape[1:])
    if ood is not None and tuple(ood[1].images.shape[1:]) != shape:
        raise ConfigError(f"{name}: OOD set {ood[0]} has images {ood[1].images.shape[1:]}, not {shape}")

    def part(a: ImageArrays) -> tuple[Tensor, Tensor]:
        return prep(a.images), torch.from_numpy(np.asarray(a.labels, dtype=np.int64).copy())

    x_ood, y_ood = part(ood[1]) if ood is not None else (None, None)
    return Dataset(
        name,
        Task.MULTICLASS,
        *part(fit),
        *part(val),
        *part(test),
        n_classes=n_classes,
        x_ood=x_ood,
        y_ood=y_ood,
        ood_name=ood[0] if ood is not None else None,
        augmentation=ImageAugmentation(int(crop), bool(flip), shape) if crop or flip else None,  # type: ignore[arg-type]
    )


# --- OOD sets ----------------------------------------------------------------------------------------------

OOD_READERS: dict[str, Callable[[str | Path | None, str | Path | None], ImageArrays]] = {}
"""Short OOD name (``notmnist``, ``svhn``, ...) → reader of its test images; filled by the modules below."""
register_ood = registrar(OOD_READERS, "OOD set")


def check_ood(ood: str | None, allowed: tuple[str, ...], name: str) -> str | None:
    """``ood`` if it is one of ``allowed``, ``None`` for no OOD set (called before any download)."""
    if ood is None or ood in ("", "none", "null"):
        return None
    if ood not in allowed:
        raise ConfigError(f"{name}: unknown ood set {ood!r}; choose one of {', '.join(allowed)} or null")
    return ood


def read_ood(ood: str | None, root: str | Path | None, mirror: str | Path | None) -> tuple[str, ImageArrays] | None:
    """The OOD test set ``ood`` (as :func:`check_ood` returned it) as ``(dataset name, arrays)``, or ``None``."""
    if ood is None:
        return None
    import_submodules("bdl_bench.data")  # the reader may live in another module of this package
    return f"vision/{ood}", OOD_READERS[ood](root, mirror)


# --- MNIST and notMNIST ------------------------------------------------------------------------------------


def _idx_split(prefix: str, split: str, root: str | Path | None, mirror: str | Path | None) -> ImageArrays:
    """The images and labels of ``<prefix>/<split>-{images-idx3,labels-idx1}-ubyte.gz`` (split: train, t10k)."""
    images = f"{prefix}/{split}-images-idx3-ubyte.gz"
    x = read_idx(get_file(images, root=root, mirror=mirror))
    y = read_idx(get_file(f"{prefix}/{split}-labels-idx1-ubyte.gz", root=root, mirror=mirror))
    if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise DataError(f"{images}: expected (N, H, W) images and (N,) labels, got {x.shape} and {y.shape}")
    return ImageArrays(x[:, None, :, :], y.astype(np.int64))


@register_ood("notmnist")
def read_notmnist(root: str | Path | None = None, mirror: str | Path | None = None) -> ImageArrays:
    """The 10k-image IDX sample of notMNIST_small (letters A–J as labels 0–9)."""
    return _idx_split("notmnist", "t10k", root, mirror)


@register_dataset("vision/mnist")
def load_mnist(
    *,
    n_val: int = 10000,
    flatten: bool = True,
    standardise: bool = False,
    ood: str | None = "notmnist",
    root: str | Path | None = None,
    mirror: str | Path | None = None,
) -> Dataset:
    """MNIST digits, 10 classes: 60k official training images (the last ``n_val`` for validation; SLANG Table 3:
    10000, leaving 50k to train), 10k test. ``flatten``: ``(N, 784)`` rows for MLPs; ``standardise``: with the
    training part's pixel mean/std (default: pixels in [0, 1]); ``ood``: ``notmnist`` (DEF Table 1) or ``None``;
    ``root``, ``mirror`` as :func:`bdl_bench.data.cifar.load_cifar10`."""
    ood = check_ood(ood, ("notmnist",), "vision/mnist")
    return image_dataset(
        "vision/mnist",
        train=_idx_split("mnist", "train", root, mirror),
        test=_idx_split("mnist", "t10k", root, mirror),
        n_classes=10,
        n_val=n_val,
        flatten=flatten,
        standardise=standardise,
        ood=read_ood(ood, root, mirror),
    )


@register_dataset("vision/notmnist")
def load_notmnist(
    *,
    n_test: int = 2000,
    n_val: int = 0,
    flatten: bool = True,
    standardise: bool = False,
    root: str | Path | None = None,
    mirror: str | Path | None = None,
) -> Dataset:
    """notMNIST letters A–J as a 10-class task on the 10k IDX sample: the last ``n_test`` images are the
    test part, the ``n_val`` before them validation. Mostly used as MNIST's OOD set (``vision/mnist``'s
    ``ood``); see :func:`load_mnist` for the options."""
    rest, test = split_last(read_notmnist(root, mirror), n_test, "vision/notmnist")
    return image_dataset(
        "vision/notmnist", train=rest, test=test, n_classes=10, n_val=n_val, flatten=flatten, standardise=standardise
    )
