r"""Full-covariance Gaussian held by its dense precision :math:`P = LL^\top` (Cholesky)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from bdl_bench.gaussians.base import LinearMoments, StructuredGaussian


def check_symmetric(name: str, matrix: Tensor) -> None:
    """Raise ``ValueError`` unless ``matrix == matrix.T`` up to sqrt(eps) times its largest entry."""
    scale = matrix.abs().max().item() if matrix.numel() else 0.0
    atol = (torch.finfo(matrix.dtype).eps ** 0.5) * max(scale, 1.0)
    if not torch.allclose(matrix, matrix.mT, rtol=0.0, atol=atol):
        raise ValueError(f"{name} must be symmetric")


def cholesky(matrix: Tensor, what: str) -> Tensor:
    """The lower Cholesky factor of ``matrix``; ``ValueError`` naming ``what`` unless it is positive definite."""
    chol, info = torch.linalg.cholesky_ex(matrix)
    if int(info) != 0:
        raise ValueError(f"{what} is not positive definite (Cholesky failed at column {int(info)})")
    return chol


@dataclass(frozen=True, eq=False, repr=False)
class FullGaussian(StructuredGaussian):
    r""":math:`\mathcal N(\mu, P^{-1})` with a dense symmetric positive definite precision.

    Every operation goes through the lower Cholesky factor :math:`P = LL^\top`, computed once on
    first use (O(D^3)); afterwards ``solve`` and sampling cost O(D^2) per vector. The covariance is
    :math:`\Sigma = L^{-\top}L^{-1}` and samples are :math:`\mu + L^{-\top}\epsilon`. A precision that is not
    positive definite raises ``ValueError`` on first use.
    """

    precision: Tensor  # (D, D), symmetric

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_param("precision", self.precision, (self.dim, self.dim))
        check_symmetric("precision", self.precision)

    @cached_property
    def _chol(self) -> Tensor:
        return cholesky(self.precision, "precision")

    @cached_property
    def covariance(self) -> Tensor:
        r""":math:`\Sigma = P^{-1}`, ``(D, D)``, cached."""
        return torch.cholesky_inverse(self._chol)

    def precision_matvec(self, v: Tensor) -> Tensor:
        self._check_rhs(v)
        return self.precision @ v

    def solve(self, v: Tensor) -> Tensor:
        r""":math:`\Sigma v` by two triangular solves with L."""
        return self._on_columns(v, lambda rhs: torch.cholesky_solve(rhs, self._chol))

    def logdet_precision(self) -> Tensor:
        r""":math:`\log|P| = 2\sum_i \log L_{ii}`."""
        return 2.0 * self._chol.diagonal().log().sum()

    def variance(self) -> Tensor:
        r""":math:`\Sigma_{ii} = \|L^{-1}e_i\|^2`: column norms of :math:`L^{-1}`, shape ``(D,)``."""
        return self._chol_inv.square().sum(0)

    @cached_property
    def _chol_inv(self) -> Tensor:
        """:math:`L^{-1}`, ``(D, D)`` lower triangular."""
        eye = torch.eye(self.dim, dtype=self.dtype, device=self.device)
        return torch.linalg.solve_triangular(self._chol, eye, upper=False)

    def _sample_transform(self, eps: Tensor) -> Tensor:
        r"""Rows :math:`\mu + L^{-\top}\epsilon` (:math:`A = L^{-\top}`, :math:`AA^\top = \Sigma`)."""
        # (L^{-T} eps^T)^T = eps L^{-1}: solve X L = eps for X.
        return self.mean + torch.linalg.solve_triangular(self._chol, eps, upper=False, left=False)

    def linear_moments(self, x: Tensor) -> LinearMoments:
        r""":math:`x^\top\Sigma x = \|L^{-1}x\|^2`: one triangular solve with :math:`X^\top`."""
        self._check_design(x)
        z = torch.linalg.solve_triangular(self._chol, x.mT, upper=False)  # (D, N)
        return LinearMoments(x @ self.mean, z.square().sum(0))

    def to_dense(self) -> FullGaussian:
        return self
