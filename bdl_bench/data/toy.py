"""Synthetic 1-D regression ``toy/cubic``: y = x^3 + noise, with a wider test grid to show extrapolation."""

from __future__ import annotations

import numpy as np
import torch

from bdl_bench.data.base import Dataset, register_dataset
from bdl_bench.data.splits import SplitIndices, carve_validation, check_seed, check_split
from bdl_bench.data.standardise import regression_dataset


def make_cubic(
    *,
    n_train: int = 20,
    n_test: int = 200,
    noise_std: float = 3.0,
    train_bound: float = 4.0,
    test_bound: float = 6.0,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)`` in original units, float64, ``x_*`` ``(N, 1)`` and ``y_*`` ``(N,)``.

    Training inputs are ``Uniform[-train_bound, train_bound]``; test inputs are an even grid over
    ``[-test_bound, test_bound]``; every target is ``x**3 + noise_std * N(0, 1)``. All draws (train x, train
    noise, test noise, in that order) come from ``torch.Generator().manual_seed(seed)``.
    """
    generator = torch.Generator().manual_seed(check_seed(seed, "seed", "toy/cubic"))
    x_train = (torch.rand(n_train, generator=generator, dtype=torch.float64) * 2 - 1) * train_bound
    y_train = x_train**3 + noise_std * torch.randn(n_train, generator=generator, dtype=torch.float64)
    x_test = torch.linspace(-test_bound, test_bound, n_test, dtype=torch.float64)
    y_test = x_test**3 + noise_std * torch.randn(n_test, generator=generator, dtype=torch.float64)
    return x_train[:, None].numpy(), y_train.numpy(), x_test[:, None].numpy(), y_test.numpy()


@register_dataset("toy/cubic")
def load_cubic(
    *,
    split: int = 0,
    n_train: int = 20,
    n_test: int = 200,
    noise_std: float = 3.0,
    train_bound: float = 4.0,
    test_bound: float = 6.0,
    val_fraction: float = 0.0,
    seed: int = 0,
    standardise: bool | None = None,
) -> Dataset:
    """The ``toy/cubic`` regression task of :func:`make_cubic`, standardised with training statistics like the UCI
    sets (``standardise: false``: in original units, as the SLANG authors' 1-D toy; ``None``: standardised).
    ``split`` must be 0 (vary ``seed`` for new draws); ``seed`` also seeds the choice of the ``val_fraction``
    validation points."""
    check_split(split, 1, "toy/cubic")
    x_tr, y_tr, x_te, y_te = make_cubic(
        n_train=n_train, n_test=n_test, noise_std=noise_std, train_bound=train_bound, test_bound=test_bound, seed=seed
    )
    train, val = carve_validation(np.arange(n_train), val_fraction, seed, "toy/cubic")
    test = np.arange(n_train, n_train + n_test)
    idx = SplitIndices(train=train, val=val, test=test)
    x, y = np.concatenate([x_tr, x_te]), np.concatenate([y_tr, y_te])
    return regression_dataset("toy/cubic", x, y, idx, standardise=standardise is not False)
