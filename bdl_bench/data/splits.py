"""Row-index bookkeeping shared by the loaders: split checks, random halves, validation carving."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bdl_bench.errors import ConfigError


@dataclass(frozen=True)
class SplitIndices:
    """Disjoint row ids (into the loader's raw table) of the parts; ``train`` and ``val`` (empty when no
    validation part was asked for) come from the original training part."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


def check_split(split: int, n_splits: int, dataset: str) -> int:
    """``split`` as an ``int`` if it indexes one of the dataset's ``n_splits`` fixed splits, else a ConfigError."""
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)) or not 0 <= split < n_splits:
        valid = "0" if n_splits == 1 else f"0..{n_splits - 1}"
        raise ConfigError(f"{dataset}: split={split!r} is out of range; valid splits are {valid} ({n_splits} in all)")
    return int(split)


def check_seed(value: int, what: str, dataset: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{dataset}: {what}={value!r} must be a non-negative integer")
    return int(value)


def permutation(n: int, seed: int) -> np.ndarray:
    """Deterministic permutation of ``range(n)`` from ``torch.Generator().manual_seed(seed)``."""
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randperm(n, generator=generator).numpy().astype(np.int64)


def random_halves(n: int, split: int) -> tuple[np.ndarray, np.ndarray]:
    """Random 50/50 ``(train, test)`` row ids of ``n`` rows in permutation order (``len(train) == n // 2``); split
    ``i`` is the permutation of ``torch.Generator().manual_seed(i)``."""
    perm = permutation(n, split)
    return perm[: n // 2], perm[n // 2 :]


def carve_validation(train: np.ndarray, val_fraction: float, seed: int, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: ``round(val_fraction * len(train))`` of the training rows ``train`` (at least one when
    ``val_fraction`` in ``[0, 1)`` is positive), chosen by a permutation seeded with ``seed``, move to ``val``;
    both keep ``train``'s relative order."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"{dataset}: val_fraction={val_fraction!r} must be a number in [0, 1)")
    seed = check_seed(seed, "seed", dataset)
    n = len(train)
    if val_fraction == 0:
        return train, train[:0]
    n_val = max(1, round(val_fraction * n))
    if n_val >= n:
        raise ConfigError(
            f"{dataset}: val_fraction={val_fraction!r} of {n} training rows leaves no training data; use a smaller value"
        )
    perm = permutation(n, seed)
    return train[np.sort(perm[n_val:])], train[np.sort(perm[:n_val])]
