"""The column-major precision helpers against dense linear algebra."""

from __future__ import annotations

import pytest
import torch

from bdl_bench.curvature import gram, low_rank

F64 = torch.float64


def _factor_and_diag(generator: torch.Generator, n_params: int = 9, rank: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """U ``(1, D, L)`` column-major and d ``(1, D)``: a stack of one copy."""
    factor = gram.empty_columns_first(1, n_params, rank, like=torch.zeros(1, dtype=F64))
    factor.copy_(torch.randn(1, n_params, rank, generator=generator, dtype=F64))
    return factor, torch.rand(1, n_params, generator=generator, dtype=F64) + 0.5


@pytest.mark.parametrize("block", [None, 36])  # 36 = L² x 4 columns: blocks of 4, 4 and 1
def test_weighted_gram_and_cache(
    block: int | None, generator: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block is not None:
        monkeypatch.setattr(low_rank, "_GRAM_BLOCK_WORK", block)  # several blocks of rows
    factor, diag = _factor_and_diag(generator)
    rhs = torch.randn(1, 9, generator=generator, dtype=F64)
    weights = diag.reciprocal()
    gram_matrix, proj = low_rank.weighted_gram(factor, weights, rhs)
    u, w = factor[0], weights[0]
    torch.testing.assert_close(gram_matrix[0], u.mT @ torch.diag(w) @ u)
    torch.testing.assert_close(proj[0], u.mT @ (w * rhs[0]))
    cache = low_rank.build_cache(factor, diag)
    torch.testing.assert_close(cache.factor_gram[0], u.mT @ u)
    torch.testing.assert_close(cache.factor_sqnorms[0], u.square().sum(1))
    chol = cache.capacitance_chol[0]
    torch.testing.assert_close(chol @ chol.mT, torch.eye(3, dtype=F64) + gram_matrix[0])


def test_sample_noise_is_exactly_the_posterior_covariance(generator: torch.Generator) -> None:
    """noise = P^{-1}(d^{1/2} e1 + U e2), whose covariance P^{-1}[diag d + U U^T]P^{-1} = P^{-1}."""
    factor, diag = _factor_and_diag(generator, n_params=6, rank=2)
    cache = low_rank.build_cache(factor, diag)
    noise = low_rank.sample_noise(factor, diag, cache, 5, torch.Generator().manual_seed(7))
    eps = torch.randn((5, 8), generator=torch.Generator().manual_seed(7), dtype=F64).mT  # the same draws
    factor, diag = factor[0], diag[0]
    precision = factor @ factor.mT + torch.diag(diag)
    transform = torch.linalg.solve(precision, torch.cat([torch.diag(diag.sqrt()), factor], 1))
    torch.testing.assert_close(noise[0], (transform @ eps).mT)
    torch.testing.assert_close(transform @ transform.mT, torch.linalg.inv(precision))


def test_sample_noise_with_a_zero_factor(generator: torch.Generator) -> None:
    """SLANG starts from U = 0: the draws are then d^{-1/2} e1."""
    diag = torch.rand(1, 6, generator=generator, dtype=F64) + 0.5
    factor = torch.zeros(1, 2, 6, dtype=F64).mT
    noise = low_rank.sample_noise(factor, diag, low_rank.build_cache(factor, diag), 3, torch.Generator().manual_seed(1))
    eps = torch.randn((3, 8), generator=torch.Generator().manual_seed(1), dtype=F64)[:, :6]
    torch.testing.assert_close(noise[0], eps * diag[0].rsqrt())


def test_sample_noise_with_a_workspace_draws_the_same(generator: torch.Generator) -> None:
    """The workspace path (the training loop's) gives the plain path's draws, call after call."""
    factor, diag = _factor_and_diag(generator, n_params=7, rank=2)
    cache = low_rank.build_cache(factor, diag)
    plain, reused = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    workspace: dict[str, torch.Tensor] = {}
    for n_samples in (2, 2, 3):
        expected = low_rank.sample_noise(factor, diag, cache, n_samples, plain)
        drawn = low_rank.sample_noise(factor, diag, cache, n_samples, reused, workspace)
        torch.testing.assert_close(drawn, expected, rtol=1e-12, atol=1e-12)
    assert "noise" in workspace
