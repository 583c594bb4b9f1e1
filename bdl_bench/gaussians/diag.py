r"""Mean-field Gaussian: diagonal precision :math:`P = \operatorname{diag}(d)`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bdl_bench.gaussians.base import LinearMoments, StructuredGaussian
from bdl_bench.gaussians.full import FullGaussian


def _check_positive(name: str, value: Tensor) -> None:
    """Raise ``ValueError`` unless every entry of ``value`` is > 0 (NaN fails too)."""
    if not bool((value > 0).all()):
        raise ValueError(f"{name} must be positive everywhere, got min {value.min().item():.3g}")


@dataclass(frozen=True, eq=False, repr=False)
class DiagGaussian(StructuredGaussian):
    r""":math:`\mathcal N(\mu, \operatorname{diag}(d)^{-1})`; every operation is O(D)."""

    prec_diag: Tensor  # d > 0, (D,)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_param("prec_diag", self.prec_diag, (self.dim,))
        _check_positive("prec_diag", self.prec_diag)

    def precision_matvec(self, v: Tensor) -> Tensor:
        return self._on_columns(v, lambda cols: self.prec_diag[:, None] * cols)

    def solve(self, v: Tensor) -> Tensor:
        return self._on_columns(v, lambda cols: self.prec_diag.reciprocal()[:, None] * cols)

    def logdet_precision(self) -> Tensor:
        return self.prec_diag.log().sum()

    def variance(self) -> Tensor:
        return self.prec_diag.reciprocal()

    def _sample_transform(self, eps: Tensor) -> Tensor:
        r""":math:`\mu + d^{-1/2} \odot \epsilon` row-wise (:math:`A = \operatorname{diag}(d)^{-1/2}`)."""
        return self.mean + eps * self.prec_diag.rsqrt()

    def linear_moments(self, x: Tensor) -> LinearMoments:
        r"""O(ND): :math:`\operatorname{diag}(X\Sigma X^\top) = (X \odot X)\, d^{-1}`."""
        self._check_design(x)
        return LinearMoments(x @ self.mean, x.square() @ self.prec_diag.reciprocal())

    def to_dense(self) -> FullGaussian:
        return FullGaussian(self.mean, torch.diag(self.prec_diag))
