r"""The structured Gaussian interface, with the maths written once.

A ``StructuredGaussian`` is :math:`\mathcal{N}(\mu, \Sigma)` over a flat parameter vector of size
D, held through its *precision* :math:`P = \Sigma^{-1}` in some structured form. Each subclass fills
in the structure-specific pieces:

* ``precision_matvec(v)`` = :math:`P v`, ``solve(v)`` = :math:`\Sigma v = P^{-1} v` (v ``(D,)`` or ``(D, K)``),
* ``logdet_precision()`` = :math:`\log|P|`, ``variance()`` = :math:`\operatorname{diag}\Sigma`,
* ``_sample_transform(eps)`` = :math:`\mu + A\epsilon` for some :math:`A` with :math:`AA^\top=\Sigma`,
* ``to_dense()`` (a ``FullGaussian``, for tests and the dense KL fallback).

From these the base writes ``rsample``, ``linear_moments`` (the mean and variance of :math:`Xw` under
:math:`w\sim p`) and the KL divergences, which dispatch on the pair of classes (``bdl_bench.gaussians.kl``).

Instances are frozen dataclasses; factorisations are ``functools.cached_property``: an update
builds a new object, so no cached factor goes stale. Nothing here picks a device or a dtype: every
tensor is created like ``mean``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from bdl_bench.gaussians.full import FullGaussian


class LinearMoments(NamedTuple):
    r"""Moments of :math:`f = Xw` for :math:`w \sim \mathcal N(\mu, \Sigma)`, one row of X each."""

    mean: Tensor  # (N,) X mu
    variance: Tensor  # (N,) diag(X Sigma X^T)


@dataclass(frozen=True, eq=False, repr=False)
class StructuredGaussian(ABC):
    r"""Abstract Gaussian :math:`\mathcal N(\mu, P^{-1})` over a flat vector of size D; subclasses add their
    precision parameters as dataclass fields after ``mean`` (whose dtype and device everything shares)."""

    mean: Tensor  # (D,)

    def __post_init__(self) -> None:
        if not isinstance(self.mean, Tensor):
            raise ValueError(f"mean must be a torch.Tensor, got {type(self.mean).__name__}")
        if self.mean.ndim != 1 or self.mean.shape[0] < 1:
            raise ValueError(f"mean must have shape (D,) with D >= 1, got {tuple(self.mean.shape)}")
        if not self.mean.is_floating_point():
            raise ValueError(f"mean must be floating point, got dtype {self.mean.dtype}")

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.mean.dtype

    @property
    def device(self) -> torch.device:
        return self.mean.device

    def __repr__(self) -> str:
        return f"{type(self).__name__}(D={self.dim}, dtype={self.dtype}, device={self.device})"

    def _check_param(self, name: str, value: Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(value, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} to match mean {tuple(self.mean.shape)}, got {tuple(value.shape)}"
            )
        if value.dtype != self.dtype or value.device != self.device:
            raise ValueError(
                f"{name} must have mean's dtype and device ({self.dtype}, {self.device}), "
                f"got ({value.dtype}, {value.device})"
            )

    def _check_rhs(self, v: Tensor) -> None:
        if v.ndim not in (1, 2) or v.shape[0] != self.dim:
            raise ValueError(f"expected shape (D,) or (D, K) with D={self.dim}, got {tuple(v.shape)}")

    def _on_columns(self, v: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """``fn`` of ``v`` ``(D,)`` or ``(D, K)`` (checked) taken as ``(D, K)`` columns, in ``v``'s shape."""
        self._check_rhs(v)
        out = fn(v if v.ndim == 2 else v[:, None])
        return out if v.ndim == 2 else out[:, 0]

    @abstractmethod
    def precision_matvec(self, v: Tensor) -> Tensor:
        r""":math:`P v` for ``v`` ``(D,)`` or ``(D, K)``."""

    @abstractmethod
    def solve(self, v: Tensor) -> Tensor:
        r""":math:`\Sigma v = P^{-1} v` for ``v`` ``(D,)`` or ``(D, K)``."""

    @abstractmethod
    def logdet_precision(self) -> Tensor:
        r""":math:`\log|P|`, a scalar tensor."""

    @abstractmethod
    def variance(self) -> Tensor:
        r"""Marginal variances :math:`\operatorname{diag}\Sigma`, shape ``(D,)``."""

    @abstractmethod
    def _sample_transform(self, eps: Tensor) -> Tensor:
        r"""Standard-normal rows ``(n, D)`` to samples :math:`\mu + A\epsilon_k`, for a fixed :math:`A` with
        :math:`AA^\top = \Sigma` (so ``_sample_transform(I) - mean`` is :math:`A^\top`; the tests check this)."""

    @abstractmethod
    def to_dense(self) -> FullGaussian:
        """The same distribution as a ``FullGaussian`` (dense D x D precision)."""

    def rsample(self, n_samples: int, generator: torch.Generator | None = None) -> Tensor:
        r"""``(n_samples, D)`` reparameterised samples :math:`\mu + A\epsilon`, differentiable in the
        parameters; ``generator`` (on ``mean``'s device, ``None``: torch's default) is the only randomness."""
        if n_samples < 0:
            raise ValueError(f"n_samples must be >= 0, got {n_samples}")
        eps = torch.randn((n_samples, self.dim), generator=generator, dtype=self.dtype, device=self.device)
        return self._sample_transform(eps)

    def linear_moments(self, x: Tensor) -> LinearMoments:
        r"""Mean :math:`X\mu` and variances :math:`\operatorname{diag}(X\Sigma X^\top)` of :math:`Xw` for the
        design matrix X ``(N, D)`` (quadrature over logistic-regression logits). This generic version calls
        ``solve`` on :math:`X^\top`; subclasses override it where cheaper."""
        self._check_design(x)
        return LinearMoments(x @ self.mean, (x * self.solve(x.mT).mT).sum(1))

    def _check_design(self, x: Tensor) -> None:
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected X of shape (N, D) with D={self.dim}, got {tuple(x.shape)}")

    def kl(self, other: StructuredGaussian) -> Tensor:
        r""":math:`\mathrm{KL}(self \,\|\, other)`, via the pair registry in ``gaussians.kl``."""
        from bdl_bench.gaussians.kl import kl

        return kl(self, other)

    def sym_kl(self, other: StructuredGaussian) -> Tensor:
        r""":math:`\mathrm{KL}(self\,\|\,other) + \mathrm{KL}(other\,\|\,self)`."""
        from bdl_bench.gaussians.kl import sym_kl

        return sym_kl(self, other)
