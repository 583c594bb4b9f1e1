"""FullGaussian: construction and errors (the shared methods are in test_base)."""

from __future__ import annotations

import pytest
import torch

from bdl_bench.gaussians import FullGaussian

from .conftest import DIM, MakeGaussian


def test_to_dense_is_itself(make_gaussian: MakeGaussian) -> None:
    g = make_gaussian("full")
    assert g.to_dense() is g


def test_rejects_bad_precision() -> None:
    mean = torch.zeros(DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(7, 7\).*got \(7, 6\)"):
        FullGaussian(mean, torch.ones(DIM, DIM - 1, dtype=torch.float64))
    asym = torch.eye(DIM, dtype=torch.float64)
    asym[0, 1] = 0.5
    with pytest.raises(ValueError, match="symmetric"):
        FullGaussian(mean, asym)
    indefinite = torch.eye(DIM, dtype=torch.float64)
    indefinite[3, 3] = -1.0
    g = FullGaussian(mean, indefinite)  # checked lazily, on the first factorisation
    with pytest.raises(ValueError, match="not positive definite"):
        g.logdet_precision()
