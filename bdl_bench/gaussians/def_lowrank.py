r"""DEF's sparse information form: Kronecker-structured low rank plus diagonal precision per block.

Lee et al. (2020), eqs. 8-10 and App. B.2. Block b (an m x n matrix X, row-major; see
``blocks.py``) has precision

.. math::

    P_b = (U_B\otimes U_C)\operatorname{diag}(\operatorname{vec}_r\Lambda)(U_B\otimes U_C)^\top + \operatorname{diag}(d)
        = WW^\top + \operatorname{diag}(d),\qquad W = (U_B\otimes U_C)\Lambda^{1/2},

with :math:`U_B` (m x g) and :math:`U_C` (n x a) orthonormal columns, :math:`\Lambda \ge 0` a g x a
grid (L = g·a kept eigenvalues) and d > 0. Nothing of size m·n x L is formed:
:math:`W^\top x = \Lambda^{1/2}\circ U_B^\top XU_C` and :math:`Wc = U_B(\Lambda^{1/2}\circ C)U_C^\top`.
The L x L matrix :math:`H = W^\top D^{-1}W = \Lambda^{1/2}(U_B\otimes U_C)^\top D^{-1}(U_B\otimes U_C)
\Lambda^{1/2}` is built in O(m n a² + m g² a²) by summing over n first and m second (or the other
way round, whichever intermediate, m a² or n g², is smaller). Then, with the
Cholesky :math:`RR^\top = I_L + H`:

* Woodbury: :math:`P_b^{-1} = D^{-1} - D^{-1}W(I_L+H)^{-1}W^\top D^{-1}` (``solve``, ``variance``);
* determinant lemma: :math:`\log|P_b| = \sum\log d + 2\sum\log R_{jj}`;
* sampler (App. B.2): :math:`\theta = \mu + D^{-1/2}(\epsilon - V_sKV_s^\top\epsilon)` with
  :math:`V_s = D^{-1/2}W` (so :math:`V_s^\top V_s = H`) and the L x L core K of Ambikasaran &
  O'Neil's symmetric factor :math:`I + V_sCV_s^\top` of :math:`I + V_sV_s^\top`, computed by
  ``low_rank.sample_core`` (two L x L Choleskys; an L x L eigendecomposition when H is singular,
  e.g. zero eigenvalues). Cost O(L³) once per block. The core is :math:`(C^{-\top} + H)^{-1}`, not eq. 18's
  :math:`(C^{-1} + V_s^\top V_s)^{-1}`, which does not reproduce the covariance (as SLANG's Alg. 3 in
  ``low_rank.py``; the tests check :math:`AA^\top = \Sigma`).

``prec_diag`` is stored in *flat* order (so a per-parameter prior precision is just added to it);
the Kronecker parts are in blocked order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from bdl_bench.gaussians.blocks import BlockGaussian, _check_long
from bdl_bench.gaussians.diag import _check_positive
from bdl_bench.gaussians.full import cholesky
from bdl_bench.gaussians.low_rank import sample_core


@dataclass(frozen=True, eq=False, repr=False)
class KroneckerLowRankPlusDiagGaussian(BlockGaussian):
    """DEF precision :math:`(U_B\\otimes U_C)\\Lambda(U_B\\otimes U_C)^\\top + \\operatorname{diag}(d)` per block
    (orthonormality of the factors is not checked)."""

    ranks: Tensor  # (B, 2) long: kept ranks (g, a), 1 <= g <= m, 1 <= a <= n
    factor_out: Tensor  # (sum m g,): U_B (m x g), packed
    factor_in: Tensor  # (sum n a,): U_C (n x a), packed
    eigenvalues: Tensor  # (sum g a,): the grids Lambda >= 0 (g x a), packed
    prec_diag: Tensor  # (D,): d > 0, in flat order

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_long("ranks", self.ranks, 2)
        if tuple(self.ranks.shape) != tuple(self.shapes.shape) or self.ranks.device != self.device:
            raise ValueError(f"ranks must have shape {tuple(self.shapes.shape)} on {self.device}")
        if bool((self.ranks < 1).any()) or bool((self.ranks > self.shapes).any()):
            raise ValueError(
                f"ranks {self.ranks.tolist()} must lie between 1 and the block shapes {self.shapes.tolist()}"
            )
        self._check_param("factor_out", self.factor_out, (sum(m * g for (m, _), (g, _) in self._pairs),))
        self._check_param("factor_in", self.factor_in, (sum(n * a for (_, n), (_, a) in self._pairs),))
        self._check_param("eigenvalues", self.eigenvalues, (sum(g * a for _, (g, a) in self._pairs),))
        self._check_param("prec_diag", self.prec_diag, (self.dim,))
        if not bool((self.eigenvalues >= 0).all()):
            raise ValueError(f"eigenvalues must be >= 0, got min {self.eigenvalues.min().item():.3g}")
        _check_positive("prec_diag", self.prec_diag)

    @cached_property
    def _pairs(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        return list(zip(self.block_shapes, [(int(g), int(a)) for g, a in self.ranks.tolist()]))

    @cached_property
    def _outs(self) -> list[Tensor]:
        return self._unpack(self.factor_out, [(m, g) for (m, _), (g, _) in self._pairs])

    @cached_property
    def _ins(self) -> list[Tensor]:
        return self._unpack(self.factor_in, [(n, a) for (_, n), (_, a) in self._pairs])

    @cached_property
    def _sqrt_eigs(self) -> list[Tensor]:
        return [e.sqrt() for e in self._unpack(self.eigenvalues, [r for _, r in self._pairs])]

    @cached_property
    def _diags(self) -> list[Tensor]:  # d of every block as an (m, n) grid
        return [self.prec_diag[idx].view(m, n) for idx, (m, n) in zip(self._block_index, self.block_shapes)]

    def _w_t(self, b: int, x: Tensor) -> Tensor:
        """:math:`W^\\top x` for ``x`` (K, m, n) → (K, g, a)."""
        return self._sqrt_eigs[b] * (self._outs[b].mT @ x @ self._ins[b])

    def _w(self, b: int, c: Tensor) -> Tensor:
        """:math:`Wc` for ``c`` (K, g, a) → (K, m, n)."""
        return self._outs[b] @ (self._sqrt_eigs[b] * c) @ self._ins[b].mT

    @cached_property
    def _grams(self) -> list[Tensor]:
        """:math:`H_b = W^\\top D^{-1}W`, ``(L, L)`` with L indexed (row of g, column of a) row-major."""
        out = []
        for b, d in enumerate(self._diags):
            u_out, u_in, s = self._outs[b], self._ins[b], self._sqrt_eigs[b].reshape(-1)
            (m, n), (g, a) = self._pairs[b]
            if m * a * a <= n * g * g:  # sum over the n columns first: an (m, a, a) intermediate
                inner = torch.einsum("rc,cz,cy->rzy", d.reciprocal(), u_in, u_in)
                gram = torch.einsum("rb,rx,rzy->bzxy", u_out, u_out, inner)  # (g, a, g, a)
            else:  # sum over the m rows first: an (n, g, g) intermediate
                inner = torch.einsum("rc,rb,rx->cbx", d.reciprocal(), u_out, u_out)
                gram = torch.einsum("cz,cy,cbx->bzxy", u_in, u_in, inner)
            size = s.shape[0]
            out.append(s[:, None] * gram.reshape(size, size) * s[None, :])
        return out

    @cached_property
    def _capacity_chols(self) -> list[Tensor]:
        eye = [torch.eye(h.shape[0], dtype=self.dtype, device=self.device) for h in self._grams]
        return [cholesky(i + h, f"capacity matrix of block {b}") for b, (i, h) in enumerate(zip(eye, self._grams))]

    @cached_property
    def _sample_cores(self) -> list[Tensor]:
        """The App. B.2 core K of every block: Alg. 3's when H is well conditioned, else eigh's."""
        return [sample_core(gram) for gram in self._grams]

    def _block_matvec(self, b: int, x: Tensor) -> Tensor:
        return self._w(b, self._w_t(b, x)) + self._diags[b] * x

    def _block_solve(self, b: int, x: Tensor) -> Tensor:
        """Woodbury: :math:`D^{-1}x - D^{-1}W(I+H)^{-1}W^\\top D^{-1}x`."""
        d_inv = self._diags[b].reciprocal()
        y = d_inv * x
        wty = self._w_t(b, y)  # (K, g, a)
        n_cols = x.shape[0]
        inner = torch.cholesky_solve(wty.reshape(n_cols, -1).mT, self._capacity_chols[b]).mT.reshape(wty.shape)
        return y - d_inv * self._w(b, inner)

    def _block_logdet(self, b: int) -> Tensor:
        """Determinant lemma: :math:`\\sum\\log d + 2\\sum_j\\log R_{jj}`."""
        return self._diags[b].log().sum() + 2.0 * self._capacity_chols[b].diagonal().log().sum()

    def _block_variance(self, b: int) -> Tensor:
        """:math:`d^{-1} - d^{-2}\\,(u_r\\otimes u_c)^\\top K(u_r\\otimes u_c)` with
        :math:`K = \\Lambda^{1/2}(I+H)^{-1}\\Lambda^{1/2}`, contracted over m and n separately."""
        (m, n), (g, a) = self._pairs[b]
        s = self._sqrt_eigs[b].reshape(-1)
        core = s[:, None] * torch.cholesky_inverse(self._capacity_chols[b]) * s[None, :]
        core = core.reshape(g, a, g, a)
        u_out, u_in = self._outs[b], self._ins[b]
        half = torch.einsum("rb,bzxy,rx->rzy", u_out, core, u_out)  # (m, a, a)
        quad = torch.einsum("cz,rzy,cy->rc", u_in, half, u_in)  # (m, n)
        d_inv = self._diags[b].reciprocal()
        return d_inv - d_inv.square() * quad

    def _block_sample(self, b: int, eps: Tensor) -> Tensor:
        """App. B.2: :math:`D^{-1/2}\\epsilon - D^{-1}WK\\,W^\\top D^{-1/2}\\epsilon`, O(L²) per sample after the core."""
        rsqrt_d = self._diags[b].rsqrt()
        eps_d = rsqrt_d * eps
        coeffs = self._w_t(b, eps_d)  # (K, g, a)
        n_cols = eps.shape[0]
        coeffs = (coeffs.reshape(n_cols, -1) @ self._sample_cores[b].mT).reshape(coeffs.shape)
        return eps_d - rsqrt_d.square() * self._w(b, coeffs)

    def _block_dense(self, b: int) -> Tensor:
        w = torch.kron(self._outs[b], self._ins[b]) * self._sqrt_eigs[b].reshape(-1)
        return w @ w.mT + torch.diag(self._diags[b].reshape(-1))
