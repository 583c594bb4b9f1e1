r"""SLANG's Gaussian: low-rank-plus-diagonal precision :math:`P = UU^\top + \operatorname{diag}(d)`.

Mishkin et al. (2018), "SLANG: Fast Structured Covariance Approximations for Bayesian Deep
Learning with Natural Gradient", Sec. 3 and Algs. 2-3. With U of shape (D, L), L << D, every
operation below costs O(D L^2) (plus O(D L) per extra right-hand side); nothing D x D is formed.

Notation used throughout: :math:`V = D^{-1/2}U` (with :math:`D = \operatorname{diag}(d)`), the
L x L Gram matrix :math:`G = V^\top V = U^\top D^{-1} U`, and the lower Cholesky factor
:math:`R R^\top = I_L + G` of the "capacity" matrix, which is always positive definite (>= I), even
when U is rank-deficient. Then :math:`P = D^{1/2}(I + VV^\top)D^{1/2}` and

* Woodbury identity: :math:`\Sigma = P^{-1} = D^{-1/2}\,[I - V(I+G)^{-1}V^\top]\,D^{-1/2}`
  (``solve``, ``variance``, ``linear_moments``; Alg. 2 ``fast_inverse``);
* matrix determinant lemma: :math:`\log|P| = \sum_i \log d_i + \log|I_L + G|
  = \sum_i\log d_i + 2\sum_j \log R_{jj}` (``logdet_precision``);
* sampling (Alg. 3 ``fast_sample``): :math:`\theta = \mu + D^{-1/2}(I - VKV^\top)\epsilon` with an
  L x L core K such that :math:`(I - VKV^\top)(I - VKV^\top)^\top = (I + VV^\top)^{-1}`, so that
  :math:`AA^\top = \Sigma` for :math:`A = D^{-1/2}(I - VKV^\top)`. See ``_alg3_core``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from bdl_bench.gaussians.base import LinearMoments, StructuredGaussian
from bdl_bench.gaussians.diag import _check_positive
from bdl_bench.gaussians.full import FullGaussian


def _alg3_core(gram: Tensor) -> Tensor | None:
    r"""The L x L core K of ``fast_sample`` (Mishkin et al. 2018, Alg. 3), or ``None``.

    Alg. 3 builds the factor of Ambikasaran et al. (2014): with :math:`A A^\top = G = V^\top V`
    and :math:`BB^\top = I + A^\top A` (two L x L Choleskys) and
    :math:`C = A^{-\top}(B - I)A^{-1}`, the matrix :math:`W = I + VCV^\top` satisfies
    :math:`WW^\top = I + VV^\top`; hence, by Woodbury,
    :math:`W^{-\top} = I - V(C^{-\top} + V^\top V)^{-1}V^\top` is a factor of
    :math:`(I + VV^\top)^{-1}`, and ``K`` :math:`= (C^{-\top} + G)^{-1} = (I + C^\top G)^{-1}C^\top`.

    This follows the authors' reference code (``torchutils/low_rank.py``: ``factCore``, ``invFactMult``);
    the listing printed in the paper differs in lines 4, 6 and 7 and does not give :math:`AA^\top = \Sigma`.

    Step 3 needs :math:`G` positive definite (U of full column rank; not so at an initialisation with zero
    columns): ``None`` when its Cholesky fails or signals a condition number above about 1/sqrt(eps), and
    the caller falls back to ``_eigh_core``. K is not symmetric in general.
    """
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    a, info = torch.linalg.cholesky_ex(gram)  # line 3: A A^T = V^T V
    a_diag = a.diagonal()
    tol = torch.finfo(gram.dtype).eps ** 0.5
    well_posed = (info == 0) & (a_diag.min().square() > tol * a_diag.max().square())
    if not bool(well_posed):
        return None
    b = torch.linalg.cholesky(eye + a.mT @ a)  # line 4: B B^T = I + A^T A
    a_inv = torch.linalg.solve_triangular(a, eye, upper=False)
    c = a_inv.mT @ (b - eye) @ a_inv  # line 5
    return torch.linalg.solve(eye + c.mT @ gram, c.mT)  # line 6: (C^{-T} + V^T V)^{-1}


def _eigh_core(gram: Tensor) -> Tensor:
    r"""Core K of the symmetric square root :math:`(I + VV^\top)^{-1/2} = I - VKV^\top`.

    With :math:`G = V^\top V = Q\Lambda Q^\top` (``eigh``, L x L) and
    :math:`s_j = \sqrt{1 + \lambda_j}`, :math:`K = Q\operatorname{diag}(1/(s_j(s_j+1)))Q^\top`:
    on the column space of V the eigenvalues :math:`1+\lambda_j` of :math:`I+VV^\top` become
    :math:`1 - \lambda_j/(s_j(s_j+1)) = 1/s_j`. Unlike Alg. 3 it needs no inverse of G, so it is
    exact for rank-deficient U (a zero eigenvalue gives a finite weight 1/2 on a direction that
    V maps to zero).
    """
    evals, evecs = torch.linalg.eigh(gram)
    s = evals.clamp_min(0.0).add(1.0).sqrt()
    return (evecs * (s * (s + 1.0)).reciprocal()) @ evecs.mT


def sample_core(gram: Tensor) -> Tensor:
    """Alg. 3's core K ``(L, L)`` of :math:`G = V^\\top V` when G is well conditioned, else the eigendecomposition
    fallback's."""
    core = _alg3_core(gram)
    return _eigh_core(gram) if core is None else core


@dataclass(frozen=True, eq=False, repr=False)
class LowRankPlusDiagGaussian(StructuredGaussian):
    r""":math:`\mathcal N(\mu, (UU^\top + \operatorname{diag}(d))^{-1})`, SLANG's posterior (module docstring)."""

    prec_factor: Tensor  # U, (D, L), 1 <= L < D (columns may be zero or dependent)
    prec_diag: Tensor  # d > 0, (D,)

    def __post_init__(self) -> None:
        super().__post_init__()
        factor = self.prec_factor
        if not isinstance(factor, Tensor) or factor.ndim != 2 or factor.shape[0] != self.dim:
            shape = tuple(factor.shape) if isinstance(factor, Tensor) else type(factor).__name__
            raise ValueError(
                f"prec_factor must have shape (D, L) with D={self.dim} from mean {tuple(self.mean.shape)}, got {shape}"
            )
        rank = factor.shape[1]
        if not 1 <= rank < self.dim:
            raise ValueError(
                f"rank L={rank} of prec_factor must satisfy 1 <= L < D={self.dim}; use "
                "DiagGaussian for L=0 and FullGaussian for L >= D"
            )
        self._check_param("prec_factor", factor, (self.dim, rank))
        self._check_param("prec_diag", self.prec_diag, (self.dim,))
        _check_positive("prec_diag", self.prec_diag)

    @property
    def rank(self) -> int:
        return self.prec_factor.shape[1]

    @cached_property
    def _rsqrt_diag(self) -> Tensor:
        return self.prec_diag.rsqrt()

    @cached_property
    def _scaled_factor(self) -> Tensor:
        r""":math:`V = D^{-1/2}U`, ``(D, L)``."""
        return self.prec_factor * self._rsqrt_diag[:, None]

    @cached_property
    def _gram(self) -> Tensor:
        r""":math:`G = V^\top V = U^\top D^{-1}U`, ``(L, L)``."""
        return self._scaled_factor.mT @ self._scaled_factor

    @cached_property
    def _capacity_chol(self) -> Tensor:
        r"""Lower Cholesky R of :math:`I_L + G` (positive definite for any U), ``(L, L)``."""
        eye = torch.eye(self.rank, dtype=self.dtype, device=self.device)
        return torch.linalg.cholesky(eye + self._gram)

    @cached_property
    def _sample_core(self) -> Tensor:
        return sample_core(self._gram)

    def precision_matvec(self, v: Tensor) -> Tensor:
        r""":math:`U(U^\top v) + d\odot v`, O(D L) per column."""
        self._check_rhs(v)
        diag_part = self.prec_diag * v if v.ndim == 1 else self.prec_diag[:, None] * v
        return self.prec_factor @ (self.prec_factor.mT @ v) + diag_part

    def solve(self, v: Tensor) -> Tensor:
        r""":math:`\Sigma v` by the Woodbury identity (Alg. 2, ``fast_inverse``).

        :math:`\Sigma v = D^{-1}v - D^{-1}U(I + U^\top D^{-1}U)^{-1}U^\top D^{-1}v`, evaluated as
        :math:`D^{-1/2}[w - V(I+G)^{-1}V^\top w]` with :math:`w = D^{-1/2}v`: O(D L^2) once, then
        O(D L) per column.
        """
        self._check_rhs(v)
        rhs = v if v.ndim == 2 else v[:, None]
        w = rhs * self._rsqrt_diag[:, None]  # (D, K)
        v_mat = self._scaled_factor
        inner = torch.cholesky_solve(v_mat.mT @ w, self._capacity_chol)  # (L, K)
        out = (w - v_mat @ inner) * self._rsqrt_diag[:, None]
        return out if v.ndim == 2 else out[:, 0]

    def logdet_precision(self) -> Tensor:
        r"""Matrix determinant lemma: :math:`\sum_i \log d_i + 2\sum_j \log R_{jj}`."""
        return self.prec_diag.log().sum() + 2.0 * self._capacity_chol.diagonal().log().sum()

    def variance(self) -> Tensor:
        r""":math:`\Sigma_{ii} = (1 - \|R^{-1}v_i\|^2)/d_i` (diagonal of Woodbury), O(D L^2)."""
        z = torch.linalg.solve_triangular(self._capacity_chol, self._scaled_factor.mT, upper=False)  # (L, D)
        return (1.0 - z.square().sum(0)) * self.prec_diag.reciprocal()

    def _sample_transform(self, eps: Tensor) -> Tensor:
        r"""Rows :math:`\mu + D^{-1/2}(\epsilon - VKV^\top\epsilon)` (Alg. 3), O(D L) per row, K from
        :attr:`_sample_core`."""
        v_mat = self._scaled_factor
        core = self._sample_core
        # Row form of eps - V K V^T eps: eps - eps V K^T V^T.
        return self.mean + (eps - (eps @ v_mat) @ core.mT @ v_mat.mT) * self._rsqrt_diag

    def linear_moments(self, x: Tensor) -> LinearMoments:
        r"""O(N D L): :math:`x^\top\Sigma x = \|D^{-1/2}x\|^2 - \|R^{-1}V^\top D^{-1/2}x\|^2`."""
        self._check_design(x)
        xs = x * self._rsqrt_diag  # (N, D)
        z = torch.linalg.solve_triangular(self._capacity_chol, (xs @ self._scaled_factor).mT, upper=False)  # (L, N)
        return LinearMoments(x @ self.mean, xs.square().sum(1) - z.square().sum(0))

    def to_dense(self) -> FullGaussian:
        precision = self.prec_factor @ self.prec_factor.mT + torch.diag(self.prec_diag)
        return FullGaussian(self.mean, precision)
