"""FullGaussian: construction, from_covariance and errors (the shared methods are in test_base)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from bdl_bench.gaussians import FullGaussian

from .conftest import DIM, MakeGaussian


def test_from_covariance_round_trip(generator: torch.Generator) -> None:
    root = torch.randn(DIM, DIM, generator=generator, dtype=torch.float64)
    cov = root @ root.mT + torch.eye(DIM, dtype=torch.float64)
    mean = torch.randn(DIM, generator=generator, dtype=torch.float64)
    g = FullGaussian.from_covariance(mean, cov)
    assert_close(g.precision, torch.linalg.inv(cov))
    assert_close(g.covariance, cov)
    assert_close(g.variance(), cov.diagonal())
    v = torch.randn(DIM, 2, generator=generator, dtype=torch.float64)
    assert_close(g.solve(v), cov @ v)


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


def test_from_covariance_rejects_bad_covariance() -> None:
    mean = torch.zeros(DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match="square"):
        FullGaussian.from_covariance(mean, torch.ones(DIM, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="not positive definite"):
        FullGaussian.from_covariance(mean, -torch.eye(DIM, dtype=torch.float64))
