"""Standardisation with training statistics (constant columns are left centred, not divided by ~0)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bdl_bench.data.base import Dataset, Task, as_float
from bdl_bench.data.splits import SplitIndices


@dataclass(frozen=True)
class Standardiser:
    """Per-column affine map ``(x - mean) / std`` fitted on a training part."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray) -> Standardiser:
        """Fit on ``x`` (``(N, D)`` or ``(N,)``) in float64, population std (ddof = 0).

        A column that is constant on ``x`` (max == min; e.g. two of naval's inputs) gets ``std = 1`` and
        ``mean`` equal to its value, so it standardises to exactly 0 instead of amplifying rounding noise.
        """
        x = np.asarray(x, dtype=np.float64)
        mean, std = x.mean(axis=0), x.std(axis=0)
        constant = x.max(axis=0) == x.min(axis=0)
        mean = np.where(constant, x[0], mean)
        std = np.where(constant, 1.0, std)
        return cls(mean=np.asarray(mean), std=np.asarray(std))

    def transform(self, x: np.ndarray) -> np.ndarray:
        """Standardise ``x`` (float64 result)."""
        return (np.asarray(x, dtype=np.float64) - self.mean) / self.std


def regression_dataset(
    name: str, x: np.ndarray, y: np.ndarray, idx: SplitIndices, *, standardise: bool = True
) -> Dataset:
    """A regression :class:`Dataset` of the rows ``idx`` of ``x`` ``(N, D)`` and ``y`` ``(N,)``, inputs and targets
    standardised with the training part's statistics (``standardise=False``: in original units);
    ``y_mean``/``y_std`` map back to original units."""
    if standardise:
        x_scaler, y_scaler = Standardiser.fit(x[idx.train]), Standardiser.fit(y[idx.train])
    else:
        x_scaler = Standardiser(mean=np.zeros(x.shape[1]), std=np.ones(x.shape[1]))
        y_scaler = Standardiser(mean=np.zeros(()), std=np.ones(()))

    def part(rows: np.ndarray) -> tuple:
        return as_float(x_scaler.transform(x[rows])), as_float(y_scaler.transform(y[rows]))

    return Dataset(
        name,
        Task.REGRESSION,
        *part(idx.train),
        *part(idx.val),
        *part(idx.test),
        y_mean=float(y_scaler.mean),
        y_std=float(y_scaler.std),
    )
