r"""Eigenpairs for SLANG's top-L step (Mishkin et al. 2018, eqs. 5-7): the top eigenpairs of R stacked symmetric
PSD matrices (the (L+P) x (L+P) Gram matrices :math:`B^\top B` of :mod:`bdl_bench.curvature.gram`), stored whole or
by their lower blocks, and the sign convention that makes SLANG's samples independent of the eigensolver."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.linalg import get_lapack_funcs
from torch import Tensor

from bdl_bench.curvature.products import thin_matmul


@dataclass(frozen=True)
class LowerStored:
    """Symmetric matrices ``(R, K, K)`` of which ``data`` holds the rows ``[0, split)`` up to column ``split``
    and the rows ``[split, K)`` whole: the block above-right of ``split`` is the transpose of the one below-left,
    and is not stored (``split = K``: all of it is)."""

    data: Tensor
    split: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __matmul__(self, vectors: Tensor) -> Tensor:
        """The product with ``vectors`` ``(R, K, b)``: three batched GEMMs on the stored blocks."""
        s, data = self.split, self.data
        if s == data.shape[-1]:
            return data @ vectors
        # as (V^T A)^T, every block read row by row: V^T A's first s columns from the stored blocks left of the
        # split, the rest as (A_2 V)^T from the whole rows A_2 below it; b x K products of a column-major V (QR's)
        # run faster than K x b ones
        rows = vectors.mT  # (R, b, K)
        left = torch.bmm(rows[:, :, :s], data[:, :s, :s]).add_(torch.bmm(rows[:, :, s:], data[:, s:, :s]))
        return torch.cat([left, torch.bmm(rows, data[:, s:].mT)], dim=2).mT

    def dense(self, copies: Tensor | None = None) -> Tensor:
        """The whole matrices (of the ``copies`` given, else of all), the unstored block filled in."""
        matrix = self.data if copies is None else self.data[copies]
        s = self.split
        if s == matrix.shape[-1]:  # stored whole
            return matrix
        matrix = matrix.clone()
        matrix[:, :s, s:] = matrix[:, s:, :s].mT
        return matrix

    def stored_sums(self) -> Tensor:
        """Each copy's sum over the stored entries ``(R,)`` (finite exactly when the whole matrix is)."""
        s, data = self.split, self.data
        return data[:, :s, :s].sum((1, 2)) + data[:, s:].sum((1, 2))


_OVERSAMPLING = 4  # extra vectors in the subspace iteration of top_eigenpairs
_MAX_ITERATIONS = 60


def top_eigenpairs(
    matrix: Tensor | LowerStored, rank: int, *, tol: float | None = None, start: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""The top-``rank`` eigenpairs of symmetric PSD matrices ``(R, K, K)`` (whole, or their lower part:
    :class:`LowerStored`), largest first: eigenvalues ``(R, L)`` and unit eigenvectors ``(R, K, L)``. A whole
    ``matrix`` may be overwritten (it is scratch to the caller).

    One matrix (R = 1): on the host LAPACK's ``?syevr`` (SciPy's) computes only these L pairs (MRRR after the
    tridiagonal reduction), elsewhere ``torch.linalg.eigh``. A stack: block subspace iteration with Rayleigh-Ritz (Saad, *Numerical Methods
    for Large Eigenvalue Problems*, Alg. 5.2) on ``rank + 4`` vectors, batched over the copies, started from
    ``start`` ``(R, K, L)`` (default: the first ``rank`` coordinates, SLANG's U block, whose directions change
    little from step to step; a copy's all-zero start falls back to them) and fixed pseudo-random vectors,
    run until every copy's residual :math:`\|AV - V\Theta\|_F` is below ``tol`` times its largest eigenvalue
    (default: 100 machine epsilons, the accuracy of ``torch.linalg.eigh`` itself). Copies not converged after
    60 iterations (nearly equal eigenvalues at the L-th place) are decomposed by ``torch.linalg.eigh``.
    """
    if not isinstance(matrix, LowerStored):
        matrix = LowerStored(matrix, matrix.shape[-1])
    n_copies, size, _ = matrix.shape
    like = matrix.data
    if n_copies == 1 and like.device.type == "cpu" and like.dtype in (torch.float32, torch.float64):
        values, vectors = _syevr_top(matrix.dense()[0], rank)
        return values[None], vectors[None]
    if n_copies == 1 or size <= rank + _OVERSAMPLING:  # one matrix on a device: eigh, which never waits for it
        evals, evecs = torch.linalg.eigh(matrix.dense())
        return evals[:, -rank:].flip(-1), evecs[:, :, -rank:].flip(-1)
    tol = 100 * torch.finfo(like.dtype).eps if tol is None else tol
    block = rank + _OVERSAMPLING
    noise = torch.randn(size, block, generator=torch.Generator().manual_seed(0), dtype=like.dtype).to(like.device)
    vectors = noise.expand(n_copies, size, block).clone()
    vectors[..., :rank] += 10.0 * torch.eye(size, rank, dtype=like.dtype, device=like.device)
    if start is not None:  # the given directions exactly (a copy's all-zero start keeps the coordinates)
        norms = start.norm(dim=1, keepdim=True)
        vectors[..., :rank] = torch.where(
            norms > 0, start / norms.clamp_min(torch.finfo(start.dtype).tiny), vectors[..., :rank]
        )
    basis = torch.linalg.qr(vectors).Q
    for _ in range(_MAX_ITERATIONS):
        image = matrix @ basis  # one product per iteration: A Q serves the Ritz step and the next basis
        ritz_values, ritz_vectors = torch.linalg.eigh(basis.mT @ image)  # ascending, (R, b)
        values = ritz_values[:, -rank:].flip(-1)
        top = ritz_vectors[:, :, -rank:].flip(-1)
        vectors = thin_matmul(basis, top)
        residual = (thin_matmul(image, top) - vectors * values[:, None, :]).norm(dim=(1, 2))
        done = residual <= tol * values[:, 0].abs().clamp_min(torch.finfo(like.dtype).tiny)
        if bool(done.all()):
            return values, vectors
        basis = torch.linalg.qr(image).Q
    stuck = (~done).nonzero()[:, 0]
    evals, evecs = torch.linalg.eigh(matrix.dense(stuck))
    values, vectors = values.clone(), vectors.clone()
    values[stuck], vectors[stuck] = evals[:, -rank:].flip(-1), evecs[:, :, -rank:].flip(-1)
    return values, vectors


def _syevr_top(matrix: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest eigenpairs of one symmetric host ``matrix`` ``(n, n)`` by LAPACK's ``?syevr``, which
    overwrites it: ``(k,)`` decreasing and unit eigenvectors ``(n, k)``."""
    n = matrix.shape[-1]
    if not matrix.is_contiguous():
        matrix = matrix.contiguous()
    array = matrix.numpy().T  # Fortran order, no copy (the matrix is symmetric)
    (syevr,) = get_lapack_funcs(("syevr",), (array,))
    values, vectors, found, _, info = syevr(array, compute_v=1, range="I", il=n - k + 1, iu=n, overwrite_a=1)
    if info != 0 or found != k:
        raise FloatingPointError(f"LAPACK ?syevr failed (info={info}, {found} of {k} eigenpairs)")
    return torch.from_numpy(values[:k][::-1].copy()), torch.from_numpy(vectors[:, ::-1].copy())


def canonical_signs(vectors: Tensor, sums: Tensor | None = None) -> Tensor:
    r"""Eigenvectors ``(..., K, L)`` of :math:`B^\top B` with each column's sign chosen so that its
    entries sum to >= 0.

    An eigenvector's sign is arbitrary (LAPACK picks one), but SLANG's samples
    :math:`d^{1/2}\epsilon_1 + U\epsilon_2` depend on the sign of U's columns: with one convention
    the dense path and the Gram path (with either eigensolver) draw the same samples from the same noise, so
    their runs agree up to rounding, on any LAPACK.
    In terms of :math:`v = Bw/\sqrt\lambda`, the rule is :math:`(B\mathbf 1)^\top v \ge 0`; a B with
    merged columns (:func:`bdl_bench.curvature.gram.merge_samples`) keeps it by passing ``sums`` = :math:`B^\top b` ``(..., K)``
    for :math:`b = B_{\text{unmerged}}\mathbf 1`: each column's sign then makes ``sums @ column`` >= 0.
    The D x D path passes eigenvectors v of :math:`BB^\top` with ``sums`` = b itself (the same rule).
    """
    if sums is None:
        signs = torch.where(vectors.sum(-2, keepdim=True) < 0, -1.0, 1.0).to(vectors.dtype)
    else:
        signs = torch.where((sums.unsqueeze(-2) @ vectors) < 0, -1.0, 1.0).to(vectors.dtype)
    return vectors * signs
