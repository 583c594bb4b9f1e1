r"""DEF: the Kronecker-preserving low-rank approximation (Alg. 1) and the diagonal correction (eq. 5).

Lee et al., "Representing model uncertainty of neural networks in sparse information form", Sec. 2.2
and 2.3. Per layer, with the EFB eigenbasis :math:`U_G` (m x m), :math:`U_A` (n x n) and the refitted
eigenvalue grid :math:`\Lambda` (m x n; entry :math:`(\beta,\zeta)` belongs to
:math:`u_{G,\beta}\otimes u_{A,\zeta}`, augmented row-major order as in
:mod:`bdl_bench.curvature.pseudo_grads`):

* Alg. 1 (:func:`sparsify`): take the top K entries of :math:`\Lambda`; keep the rows
  :math:`\beta` and columns :math:`\zeta` they use (g rows, a columns); keep the whole
  g x a sub-grid :math:`\Lambda_{1:L}`, L = g·a >= K (the "top K plus J additional" eigenvalues), so
  that the kept eigenvectors are :math:`U_{G,1:g}\otimes U_{A,1:a}` and never need to be formed.
* Eq. 14 / App. B.1 (:func:`kron_diag`): the diagonal of
  :math:`(U_{G,1:g}\otimes U_{A,1:a})\Lambda_{1:L}(\cdot)^\top` is the grid
  :math:`(U_{G,1:g}\circ U_{G,1:g})\,\Lambda_{1:L}\,(U_{A,1:a}\circ U_{A,1:a})^\top`, O(m g a + m a n).
* Eq. 5 (:func:`diagonal_correction`): :math:`D = \operatorname{diag}(\mathbf I) -
  \operatorname{diag}((U\otimes U)\Lambda(U\otimes U)^\top)`, so that the DEF matrix
  :math:`\hat{\mathbf I}_{def} = (U_{G,1:g}\otimes U_{A,1:a})\Lambda_{1:L}(\cdot)^\top + D` has the exact
  diagonal (Prop. 1). D may have negative entries (Lemma 3 names the condition under which it does
  not); the Laplace posterior clips them (``bdl_bench.methods.laplace``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bdl_bench.curvature.pseudo_grads import KronSlot


@dataclass(frozen=True)
class KronLowRank:
    """One layer's kept eigen-structure :math:`(U_{G,1:g}\\otimes U_{A,1:a})\\Lambda_{1:L}(\\cdot)^\\top`."""

    slot: KronSlot
    factor_out: Tensor  # U_{G,1:g}, (m, g)
    factor_in: Tensor  # U_{A,1:a}, (n, a)
    eigenvalues: Tensor  # Lambda_{1:L}, (g, a)
    rows: Tensor  # indices of the kept columns of U_G, (g,)
    cols: Tensor  # indices of the kept columns of U_A, (a,)

    @property
    def rank(self) -> int:
        """L = g·a, the number of kept eigenvalues."""
        return self.eigenvalues.numel()

    def dense(self) -> Tensor:
        """The low-rank matrix :math:`(U_G\\otimes U_A)\\Lambda(U_G\\otimes U_A)^\\top`, ``(m·n, m·n)``."""
        vectors = torch.kron(self.factor_out, self.factor_in)  # (mn, L)
        return (vectors * self.eigenvalues.reshape(-1)) @ vectors.mT


def sparsify(
    slot: KronSlot, eigvecs_out: Tensor, eigvecs_in: Tensor, eigenvalues: Tensor, rank: int | None
) -> KronLowRank:
    """Lee et al., Alg. 1: keep the top K = ``rank`` eigenvalues of the ``(m, n)`` grid :math:`\\Lambda` (all for
    ``None``) with their Kronecker structure, L = g·a >= K. Rows and columns keep the order of first appearance
    in the descending sort, so :math:`\\Lambda_{1:L}` starts with the largest eigenvalue."""
    m, n = eigenvalues.shape
    if rank is not None and rank < 1:
        raise ValueError(f"rank must be >= 1 or None, got {rank}")
    if rank is None or rank >= m * n:
        rows = torch.arange(m, device=eigenvalues.device)
        cols = torch.arange(n, device=eigenvalues.device)
    else:
        top = torch.topk(eigenvalues.reshape(-1), rank).indices  # step 1
        beta, zeta = top // n, top % n  # step 2 (Definition 2, 0-based)
        rows = _unique_in_order(beta)  # step 3
        cols = _unique_in_order(zeta)
    kept = eigenvalues[rows][:, cols]  # steps 4-5: the whole g x a sub-grid
    return KronLowRank(slot, eigvecs_out[:, rows], eigvecs_in[:, cols], kept, rows, cols)


def _unique_in_order(values: Tensor) -> Tensor:
    """Distinct entries of a 1-D integer tensor in order of first appearance."""
    return torch.tensor(list(dict.fromkeys(values.tolist())), dtype=torch.long, device=values.device)


def kron_diag(factor_out: Tensor, factor_in: Tensor, eigenvalues: Tensor) -> Tensor:
    """Diagonal of :math:`(U_G\\otimes U_A)\\Lambda(U_G\\otimes U_A)^\\top` as an ``(m, n)`` grid (eq. 14), for
    :math:`U_G` ``(m, g)``, :math:`U_A` ``(n, a)``, :math:`\\Lambda` ``(g, a)``."""
    return factor_out.square() @ eigenvalues @ factor_in.square().mT


def diagonal_correction(exact_diag: Tensor, low_rank: KronLowRank) -> Tensor:
    """Eq. 5: :math:`D = \\operatorname{diag}(\\mathbf I) - \\operatorname{diag}(\\text{low rank})`, ``(m, n)``, from the
    layer's exact diagonal as an ``(m, n)`` grid (augmented order)."""
    return exact_diag - kron_diag(low_rank.factor_out, low_rank.factor_in, low_rank.eigenvalues)
