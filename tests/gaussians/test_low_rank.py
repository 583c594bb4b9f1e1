"""LowRankPlusDiagGaussian: SLANG's Algs. 2-3, rank handling and errors.

The methods shared by every class are checked against dense algebra in test_base.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from bdl_bench.gaussians import LowRankPlusDiagGaussian
from bdl_bench.gaussians.low_rank import _alg3_core, _eigh_core

from .conftest import DIM, RANK


def make(generator: torch.Generator, factor: torch.Tensor | None = None) -> LowRankPlusDiagGaussian:
    mean = torch.randn(DIM, generator=generator, dtype=torch.float64)
    if factor is None:
        factor = torch.randn(DIM, RANK, generator=generator, dtype=torch.float64)
    prec_diag = torch.rand(DIM, generator=generator, dtype=torch.float64) + 0.5
    return LowRankPlusDiagGaussian(mean, factor, prec_diag)


def dense_covariance(g: LowRankPlusDiagGaussian) -> torch.Tensor:
    return torch.linalg.inv(g.prec_factor @ g.prec_factor.mT + torch.diag(g.prec_diag))


def sample_matrix(g: LowRankPlusDiagGaussian, core: torch.Tensor) -> torch.Tensor:
    """A = D^{-1/2} (I - V K V^T) for a given core K."""
    v = g._scaled_factor
    eye = torch.eye(g.dim, dtype=g.dtype)
    return (eye - v @ core @ v.mT) * g.prec_diag.rsqrt()[:, None]


def test_to_dense_precision(generator: torch.Generator) -> None:
    g = make(generator)
    expected = g.prec_factor @ g.prec_factor.mT + torch.diag(g.prec_diag)
    assert_close(g.to_dense().precision, expected)
    assert g.rank == RANK


def test_solve_is_paper_alg2(generator: torch.Generator) -> None:
    """Alg. 2 written out literally: y = d^-1 g - d^-1 U A U^T d^-1 g, A = (I + U^T d^-1 U)^-1."""
    g = make(generator)
    rhs = torch.randn(DIM, generator=generator, dtype=torch.float64)
    u, d_inv = g.prec_factor, g.prec_diag.reciprocal()
    a = torch.linalg.inv(torch.eye(RANK, dtype=torch.float64) + u.mT @ (d_inv[:, None] * u))
    y = d_inv * rhs - d_inv * (u @ (a @ (u.mT @ (d_inv * rhs))))
    assert_close(g.solve(rhs), y)


def test_full_rank_factor_samples_with_alg3(generator: torch.Generator) -> None:
    g = make(generator)
    assert torch.equal(g._sample_core, _alg3_core(g._gram))


def test_alg3_and_eigh_cores_are_both_exact(generator: torch.Generator) -> None:
    g = make(generator)
    cov = dense_covariance(g)
    alg3 = _alg3_core(g._gram)
    assert alg3 is not None
    for core in (alg3, _eigh_core(g._gram)):
        a = sample_matrix(g, core)
        assert_close(a @ a.mT, cov)
    # The eigendecomposition gives the symmetric root of (I + V V^T)^{-1}, Alg. 3 another root.
    eigh_root = sample_matrix(g, _eigh_core(g._gram)) * g.prec_diag.sqrt()[:, None]
    assert_close(eigh_root, eigh_root.mT)


@pytest.mark.parametrize("case", ["zero_column", "all_zero", "dependent_columns", "near_dependent"])
def test_rank_deficient_factor_falls_back_exactly(generator: torch.Generator, case: str) -> None:
    factor = torch.randn(DIM, RANK, generator=generator, dtype=torch.float64)
    if case == "zero_column":
        factor[:, 1] = 0.0
    elif case == "all_zero":
        factor.zero_()
    elif case == "dependent_columns":
        factor[:, 1] = 2.0 * factor[:, 0]
    else:
        factor[:, 1] = factor[:, 0] + 1e-10 * factor[:, 1]
    g = make(generator, factor)
    assert _alg3_core(g._gram) is None and torch.equal(g._sample_core, _eigh_core(g._gram))
    cov = dense_covariance(g)
    a_transposed = g._sample_transform(torch.eye(DIM, dtype=torch.float64)) - g.mean
    assert_close(a_transposed.mT @ a_transposed, cov)
    assert torch.isfinite(g.rsample(5, generator)).all()
    assert_close(g.variance(), cov.diagonal())
    assert_close(g.logdet_precision(), -torch.logdet(cov))
    rhs = torch.randn(DIM, generator=generator, dtype=torch.float64)
    assert_close(g.solve(rhs), cov @ rhs)


def test_rank_deficient_factor_float32(generator: torch.Generator) -> None:
    factor = torch.randn(DIM, RANK, generator=generator)
    factor[:, 0] = 0.0
    g = LowRankPlusDiagGaussian(torch.zeros(DIM), factor, torch.ones(DIM))
    a_transposed = g._sample_transform(torch.eye(DIM)) - g.mean
    expected = torch.linalg.inv(factor @ factor.mT + torch.eye(DIM))
    assert_close(a_transposed.mT @ a_transposed, expected)


@pytest.mark.parametrize("rank", [0, DIM, DIM + 2])
def test_rank_out_of_range_is_refused(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"L={rank} .*1 <= L < D={DIM}"):
        LowRankPlusDiagGaussian(
            torch.zeros(DIM, dtype=torch.float64),
            torch.zeros(DIM, rank, dtype=torch.float64),
            torch.ones(DIM, dtype=torch.float64),
        )


def test_rejects_bad_shapes_and_values() -> None:
    mean = torch.zeros(DIM, dtype=torch.float64)
    factor = torch.ones(DIM, RANK, dtype=torch.float64)
    prec_diag = torch.ones(DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"prec_factor must have shape \(D, L\).*got \(6, 2\)"):
        LowRankPlusDiagGaussian(mean, factor[1:], prec_diag)
    with pytest.raises(ValueError, match=r"got \(7,\)"):
        LowRankPlusDiagGaussian(mean, factor[:, 0], prec_diag)
    with pytest.raises(ValueError, match=r"prec_diag must have shape \(7,\).*got \(6,\)"):
        LowRankPlusDiagGaussian(mean, factor, prec_diag[1:])
    with pytest.raises(ValueError, match="dtype"):
        LowRankPlusDiagGaussian(mean, factor.float(), prec_diag)
    with pytest.raises(ValueError, match="prec_diag must be positive"):
        LowRankPlusDiagGaussian(mean, factor, -prec_diag)
