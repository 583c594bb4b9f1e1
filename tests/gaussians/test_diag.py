"""DiagGaussian: construction checks and its dense twin (the shared methods are in test_base)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from bdl_bench.gaussians import DiagGaussian

from .conftest import DIM


def test_to_dense_is_diagonal_precision(generator: torch.Generator) -> None:
    mean = torch.randn(DIM, generator=generator, dtype=torch.float64)
    prec_diag = torch.rand(DIM, generator=generator, dtype=torch.float64) + 0.1
    dense = DiagGaussian(mean, prec_diag).to_dense()
    assert_close(dense.precision, torch.diag(prec_diag))
    assert_close(dense.mean, mean)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_rejects_non_positive_precision(bad: float) -> None:
    prec_diag = torch.ones(DIM, dtype=torch.float64)
    prec_diag[2] = bad
    with pytest.raises(ValueError, match="prec_diag must be positive"):
        DiagGaussian(torch.zeros(DIM, dtype=torch.float64), prec_diag)


def test_rejects_bad_shapes_and_dtypes() -> None:
    mean = torch.zeros(DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(7,\).*got \(6,\)"):
        DiagGaussian(mean, torch.ones(DIM - 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype"):
        DiagGaussian(mean, torch.ones(DIM, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"mean must have shape \(D,\)"):
        DiagGaussian(torch.zeros(1, DIM), torch.ones(DIM))
    with pytest.raises(ValueError, match="floating point"):
        DiagGaussian(torch.zeros(DIM, dtype=torch.int64), torch.ones(DIM))
