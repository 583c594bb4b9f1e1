r"""Kronecker-factored precisions: KFAC (``KroneckerGaussian``) and EFB (``EigenKroneckerGaussian``).

Both are ``BlockGaussian``\ s (see ``blocks.py``): block b is an :math:`m\times n` matrix X read
row-major, for which :math:`(B\otimes C)\operatorname{vec}_r(X) = \operatorname{vec}_r(BXC^\top)`.

* KFAC Laplace (Ritter et al. 2018; Lee et al. eqs. 2-3): :math:`P_b = B\otimes C` with SPD
  :math:`B` (m x m) and :math:`C` (n x n). With Choleskys :math:`B = L_BL_B^\top`,
  :math:`C = L_CL_C^\top`: :math:`P_b^{-1}x = B^{-1}XC^{-1}`,
  :math:`\log|P_b| = n\log|B| + m\log|C|`, samples :math:`L_B^{-\top}EL_C^{-1}` (the matrix-normal
  sampler), variances :math:`\operatorname{diag}(B^{-1})\operatorname{diag}(C^{-1})^\top`.
  Cost O(m³ + n³) once, O(mn(m+n)) per vector.
* EFB Laplace (George et al. 2018; Lee et al. eq. 4): :math:`P_b = (Q_B\otimes Q_C)\operatorname{diag}
  (\operatorname{vec}_r\Lambda)(Q_B\otimes Q_C)^\top` with orthogonal :math:`Q_B, Q_C` and a positive
  m x n grid :math:`\Lambda`: :math:`P_b x = Q_B(\Lambda\circ Q_B^\top XQ_C)Q_C^\top`, the inverse with
  :math:`1/\Lambda`, :math:`\log|P_b| = \sum\log\Lambda`, samples :math:`Q_B(\Lambda^{-1/2}\circ E)
  Q_C^\top`, variances :math:`(Q_B\circ Q_B)\Lambda^{-1}(Q_C\circ Q_C)^\top`. O(mn(m+n)) per vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from bdl_bench.gaussians.blocks import BlockGaussian
from bdl_bench.gaussians.diag import _check_positive
from bdl_bench.gaussians.full import check_symmetric, cholesky


@dataclass(frozen=True, eq=False, repr=False)
class KroneckerGaussian(BlockGaussian):
    """KFAC precision :math:`P_b = B_b\\otimes C_b` per block (see the module docstring); a factor that is not
    positive definite raises ``ValueError`` on first use."""

    prec_out: Tensor  # (sum m^2,): the symmetric B_b (m x m), packed (``blocks.pack``)
    prec_in: Tensor  # (sum n^2,): the symmetric C_b (n x n), packed

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_param("prec_out", self.prec_out, (sum(m * m for m, _ in self.block_shapes),))
        self._check_param("prec_in", self.prec_in, (sum(n * n for _, n in self.block_shapes),))
        for name, factors in (("prec_out", self._outs), ("prec_in", self._ins)):
            for b, f in enumerate(factors):
                check_symmetric(f"{name} factor of block {b}", f)

    @cached_property
    def _outs(self) -> list[Tensor]:
        return self._unpack(self.prec_out, [(m, m) for m, _ in self.block_shapes])

    @cached_property
    def _ins(self) -> list[Tensor]:
        return self._unpack(self.prec_in, [(n, n) for _, n in self.block_shapes])

    @cached_property
    def _chols(self) -> list[tuple[Tensor, Tensor]]:
        return [
            (cholesky(b_out, f"prec_out factor of block {b}"), cholesky(c_in, f"prec_in factor of block {b}"))
            for b, (b_out, c_in) in enumerate(zip(self._outs, self._ins))
        ]

    def _block_matvec(self, b: int, x: Tensor) -> Tensor:
        return self._outs[b] @ x @ self._ins[b]

    def _block_solve(self, b: int, x: Tensor) -> Tensor:
        l_out, l_in = self._chols[b]
        left = torch.cholesky_solve(x, l_out)  # B^{-1} X
        return torch.cholesky_solve(left.mT, l_in).mT  # (C^{-1} (B^{-1}X)^T)^T

    def _block_logdet(self, b: int) -> Tensor:
        m, n = self.block_shapes[b]
        l_out, l_in = self._chols[b]
        return 2.0 * (n * l_out.diagonal().log().sum() + m * l_in.diagonal().log().sum())

    def _block_variance(self, b: int) -> Tensor:
        l_out, l_in = self._chols[b]
        return torch.cholesky_inverse(l_out).diagonal()[:, None] * torch.cholesky_inverse(l_in).diagonal()[None, :]

    def _block_sample(self, b: int, eps: Tensor) -> Tensor:
        """:math:`L_B^{-\\top}EL_C^{-1}`: covariance :math:`B^{-1}\\otimes C^{-1}`."""
        l_out, l_in = self._chols[b]
        left = torch.linalg.solve_triangular(l_out.mT, eps, upper=True)
        return torch.linalg.solve_triangular(l_in, left, upper=False, left=False)

    def _block_dense(self, b: int) -> Tensor:
        return torch.kron(self._outs[b], self._ins[b])


@dataclass(frozen=True, eq=False, repr=False)
class EigenKroneckerGaussian(BlockGaussian):
    """EFB precision :math:`(Q_B\\otimes Q_C)\\operatorname{diag}(\\Lambda)(Q_B\\otimes Q_C)^\\top` per block (the
    factors' orthogonality is not checked: that would cost O(m³ + n³) per block)."""

    eigvecs_out: Tensor  # (sum m^2,): the orthogonal Q_B (m x m), packed
    eigvecs_in: Tensor  # (sum n^2,): the orthogonal Q_C (n x n), packed
    eigenvalues: Tensor  # (D,): the grids Lambda_b > 0 (m x n), packed, i.e. in blocked order

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_param("eigvecs_out", self.eigvecs_out, (sum(m * m for m, _ in self.block_shapes),))
        self._check_param("eigvecs_in", self.eigvecs_in, (sum(n * n for _, n in self.block_shapes),))
        self._check_param("eigenvalues", self.eigenvalues, (self.dim,))
        _check_positive("eigenvalues", self.eigenvalues)

    @cached_property
    def _outs(self) -> list[Tensor]:
        return self._unpack(self.eigvecs_out, [(m, m) for m, _ in self.block_shapes])

    @cached_property
    def _ins(self) -> list[Tensor]:
        return self._unpack(self.eigvecs_in, [(n, n) for _, n in self.block_shapes])

    @cached_property
    def _eigs(self) -> list[Tensor]:
        return self._unpack(self.eigenvalues, self.block_shapes)

    def _rotate_scale_back(self, b: int, x: Tensor, scale: Tensor) -> Tensor:
        q_out, q_in = self._outs[b], self._ins[b]
        return q_out @ (scale * (q_out.mT @ x @ q_in)) @ q_in.mT

    def _block_matvec(self, b: int, x: Tensor) -> Tensor:
        return self._rotate_scale_back(b, x, self._eigs[b])

    def _block_solve(self, b: int, x: Tensor) -> Tensor:
        return self._rotate_scale_back(b, x, self._eigs[b].reciprocal())

    def _block_logdet(self, b: int) -> Tensor:
        return self._eigs[b].log().sum()

    def _block_variance(self, b: int) -> Tensor:
        return self._outs[b].square() @ self._eigs[b].reciprocal() @ self._ins[b].square().mT

    def _block_sample(self, b: int, eps: Tensor) -> Tensor:
        """:math:`Q_B(\\Lambda^{-1/2}\\circ E)Q_C^\\top`."""
        return self._outs[b] @ (self._eigs[b].rsqrt() * eps) @ self._ins[b].mT

    def _block_dense(self, b: int) -> Tensor:
        vectors = torch.kron(self._outs[b], self._ins[b])
        return (vectors * self._eigs[b].reshape(-1)) @ vectors.mT


@dataclass(frozen=True, eq=False, repr=False)
class ScaledEigenKroneckerGaussian(EigenKroneckerGaussian):
    """EFB with a diagonal scaling of the input side: :math:`P_b = (Q_B\\otimes SQ_C)\\operatorname{diag}(\\Lambda)
    (Q_B\\otimes SQ_C)^\\top`, :math:`S = \\operatorname{diag}(s_b) > 0`.

    This is KFAC with a prior that differs within a layer (a bias prior): :math:`NG\\otimes A + I\\otimes T`
    with :math:`T = \\operatorname{diag}(t)` equals :math:`(I\\otimes T^{1/2})(NG\\otimes A' + I)(I\\otimes T^{1/2})`,
    :math:`A' = T^{-1/2}AT^{-1/2}`, so with :math:`G = Q_BS_GQ_B^\\top`, :math:`A' = Q_CS_{A'}Q_C^\\top` it is the
    above with :math:`s = t^{1/2}` and :math:`\\Lambda = Ns_Gs_{A'}^\\top + 1`, exactly. Since :math:`(SQ_C)^{-\\top}
    = S^{-1}Q_C`: :math:`P_b^{-1}` is the same form with :math:`1/s` and :math:`1/\\Lambda`,
    :math:`\\log|P_b| = \\sum\\log\\Lambda + 2m\\sum\\log s`, samples :math:`Q_B(\\Lambda^{-1/2}\\circ E)Q_C^\\top S^{-1}`.
    """

    in_scale: Tensor  # (sum n,): the s_b > 0 (n per block), packed

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_param("in_scale", self.in_scale, (sum(n for _, n in self.block_shapes),))
        _check_positive("in_scale", self.in_scale)

    @cached_property
    def _scales(self) -> list[Tensor]:
        return self._unpack(self.in_scale, [(n,) for _, n in self.block_shapes])

    def _block_matvec(self, b: int, x: Tensor) -> Tensor:
        s = self._scales[b]
        return self._rotate_scale_back(b, x * s, self._eigs[b]) * s

    def _block_solve(self, b: int, x: Tensor) -> Tensor:
        s = self._scales[b]
        return self._rotate_scale_back(b, x / s, self._eigs[b].reciprocal()) / s

    def _block_logdet(self, b: int) -> Tensor:
        m, _ = self.block_shapes[b]
        return self._eigs[b].log().sum() + 2 * m * self._scales[b].log().sum()

    def _block_variance(self, b: int) -> Tensor:
        return super()._block_variance(b) / self._scales[b].square()

    def _block_sample(self, b: int, eps: Tensor) -> Tensor:
        return super()._block_sample(b, eps) / self._scales[b]

    def _block_dense(self, b: int) -> Tensor:
        s = self._scales[b].repeat(self.block_shapes[b][0])
        return super()._block_dense(b) * s[:, None] * s[None, :]
