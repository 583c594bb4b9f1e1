"""Fixtures for the structured-Gaussian tests: small problems (D=7, L=2) in float64."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bdl_bench.gaussians import (
    DiagGaussian,
    FullGaussian,
    LowRankPlusDiagGaussian,
    StructuredGaussian,
)

DIM = 7
RANK = 2
KINDS = ("diag", "low_rank", "full")

MakeGaussian = Callable[..., StructuredGaussian]


@pytest.fixture
def generator() -> torch.Generator:
    """The only source of randomness in these tests."""
    return torch.Generator().manual_seed(20180611)


@pytest.fixture
def make_gaussian(generator: torch.Generator) -> MakeGaussian:
    """Factory ``make(kind, dim=7, rank=2, dtype=float64)`` of random, well-conditioned Gaussians."""

    def make(kind: str, dim: int = DIM, rank: int = RANK, dtype: torch.dtype = torch.float64) -> StructuredGaussian:
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=generator, dtype=dtype)

        mean = randn(dim)
        prec_diag = torch.rand(dim, generator=generator, dtype=dtype) + 0.5
        if kind == "diag":
            return DiagGaussian(mean, prec_diag)
        if kind == "low_rank":
            return LowRankPlusDiagGaussian(mean, randn(dim, rank), prec_diag)
        if kind == "full":
            root = randn(dim, dim)
            return FullGaussian(mean, root @ root.mT / dim + torch.diag(prec_diag))
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")

    return make


@pytest.fixture(params=KINDS)
def gaussian(request: pytest.FixtureRequest, make_gaussian: MakeGaussian) -> StructuredGaussian:
    """One Gaussian of each class, in float64."""
    return make_gaussian(request.param)
