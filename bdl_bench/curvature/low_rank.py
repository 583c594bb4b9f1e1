r"""The precision :math:`P = UU^\top + \operatorname{diag}(d)` of SLANG, with U (D x L) stored column-major.

Everything SLANG needs from P besides its update costs O(D L) per vector once the L x L
*capacitance* :math:`K = U^\top D^{-1} U` and the Cholesky factor R of :math:`I + K` are known
(Mishkin et al. 2018, Algs. 2-3):

* Woodbury (Alg. 2): :math:`P^{-1}v = D^{-1}v - D^{-1}U(I+K)^{-1}U^\top D^{-1}v`;
* determinant lemma: :math:`\log|P| = \sum_i \log d_i + 2\sum_j \log R_{jj}`;
* exact samples of :math:`\mathcal N(0, P^{-1})` (:func:`sample_noise`, two passes over U).

:func:`weighted_gram` forms K (and :math:`U^\top D^{-1} v`) in blocks of about 1 MB on CPU, so no D x L
temporary is allocated. ``bdl_bench.gaussians.LowRankPlusDiagGaussian`` is the same distribution as
an object; these functions serve the training loop, which keeps U column-major and K across steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bdl_bench.curvature.gram import column_sqnorms, workspace_buffer
from bdl_bench.curvature.products import thin_matmul


@dataclass(frozen=True)
class PrecisionCache:
    """Quantities of a state's precision that the next step reuses instead of recomputing them.

    With :math:`K = U^\\top D^{-1} U` and :math:`C = I_L + K = RR^\\top` (the Woodbury capacitance,
    Alg. 2), every solve and sample costs O(D L) per vector (Alg. 2 and :func:`sample_noise`).

    Attributes:
        factor_gram: :math:`U^\\top U` ``(L, L)`` (after an update: ``diag`` of its eigenvalues).
        factor_sqnorms: :math:`\\operatorname{diag}(UU^\\top)`, ``(D,)``.
        capacitance: K, ``(L, L)``.
        capacitance_chol: R, the lower Cholesky factor of :math:`I + K`, ``(L, L)``.
    """

    factor_gram: Tensor  # (L, L)
    factor_sqnorms: Tensor  # (D,)
    capacitance: Tensor  # (L, L)
    capacitance_chol: Tensor  # (L, L)


# multiply-adds (L² x columns) per block of the weighted Gram matrix on CPU: 64k columns (2 MB) at L = 8,
# 4k (512 KB) at L = 32; MKL's L x n x L products run fastest at about these sizes
_GRAM_BLOCK_WORK = 1 << 22


def weighted_gram(
    factor: Tensor, weights: Tensor, rhs: Tensor | None = None, workspace: dict[str, Tensor] | None = None
) -> tuple[Tensor, Tensor | None]:
    """:math:`U^\\top\\operatorname{diag}(w)U` ``(L, L)`` and, if given, :math:`U^\\top(w \\circ v)` ``(L,)``.

    U is read column-major (as SLANG stores it), on CPU in blocks of rows of D (:data:`_GRAM_BLOCK_WORK`),
    so that no D x L temporary is allocated (the block buffer is taken from ``workspace`` if given:
    :func:`bdl_bench.curvature.gram.workspace_buffer`).
    """
    rows = factor.mT if factor.mT.is_contiguous() else factor.mT.contiguous()  # (L, D)
    rank, n_params = rows.shape
    cols = n_params if factor.device.type != "cpu" else max(1, _GRAM_BLOCK_WORK // max(rank, 1) ** 2)
    gram = torch.zeros(rank, rank, dtype=factor.dtype, device=factor.device)
    proj = None if rhs is None else torch.zeros(rank, dtype=factor.dtype, device=factor.device)
    buffer = workspace_buffer(workspace, "weighted_gram", (rank * min(cols, n_params),), factor)
    for start in range(0, n_params, cols):
        block = rows[:, start : start + cols]
        scaled = buffer[: block.numel()].view(block.shape)
        torch.mul(block, weights[start : start + cols], out=scaled)
        gram.addmm_(scaled, block.mT)
        if proj is not None and rhs is not None:
            proj.addmv_(scaled, rhs[start : start + cols])
    return gram, proj


def capacitance_cholesky(capacitance: Tensor) -> Tensor:
    """R with :math:`RR^\\top = I + K` (lower Cholesky; positive definite for any U)."""
    eye = torch.eye(capacitance.shape[-1], dtype=capacitance.dtype, device=capacitance.device)
    return torch.linalg.cholesky(capacitance + eye)  # also for a stack (..., L, L)


def build_cache(prec_factor: Tensor, prec_diag: Tensor) -> PrecisionCache:
    """:class:`SlangCache` of ``(U, d)`` computed from scratch (O(D L²))."""
    capacitance, _ = weighted_gram(prec_factor, prec_diag.reciprocal())
    return PrecisionCache(
        factor_gram=prec_factor.mT @ prec_factor,
        factor_sqnorms=column_sqnorms(prec_factor),
        capacitance=capacitance,
        capacitance_chol=capacitance_cholesky(capacitance),
    )


def _chol_solve_rows(rows: Tensor, chol: Tensor) -> Tensor:
    """:math:`x C^{-1}` for rows x ``(K, L)`` and :math:`C = RR^\\top` (C symmetric)."""
    return torch.cholesky_solve(rows.mT, chol).mT


def sample_noise(
    prec_factor: Tensor,
    prec_diag: Tensor,
    cache: PrecisionCache,
    n_samples: int,
    generator: torch.Generator,
    workspace: dict[str, Tensor] | None = None,
) -> Tensor:
    """Draws of :math:`\\mathcal N(0, P^{-1})`, :math:`P = UU^\\top + \\operatorname{diag}(d)`: ``(n, D)``.

    :math:`z = d^{1/2}\\circ\\epsilon_1 + U\\epsilon_2` with :math:`\\epsilon_1 \\sim \\mathcal N(0, I_D)`,
    :math:`\\epsilon_2 \\sim \\mathcal N(0, I_L)` has covariance P, so :math:`P^{-1}z` has covariance
    :math:`P^{-1}PP^{-1} = P^{-1}`: exact for any U (zero columns included). By Woodbury, with
    :math:`U^\\top D^{-1} z = U^\\top(d^{-1/2}\\circ\\epsilon_1) + K\\epsilon_2`,
    :math:`P^{-1}z = d^{-1/2}\\circ\\epsilon_1 + D^{-1}U(\\epsilon_2 - C^{-1}U^\\top D^{-1} z)`: two
    passes over U for all n samples (as Alg. 3). The normals are drawn on the generator's device.

    For R stacked precisions (U ``(R, D, L)``, d ``(R, D)``, cache entries with a leading R; the stacked
    splits of :mod:`bdl_bench.orchestration.stacked`) the draws are ``(R, n, D)``: one ``(n, D + L)`` draw of normals,
    shared by the copies, as a single run draws it.

    With ``workspace`` (:func:`bdl_bench.curvature.gram.workspace_buffer`) the draws and temporaries
    reuse its buffers, and the result lives in it (valid until the next call with the same workspace);
    it is ignored for stacked precisions and for a generator on another device than ``prec_diag``.
    """
    n_params, rank = prec_factor.shape[-2:]
    shape = (n_samples, n_params + rank)
    if workspace is not None and prec_factor.ndim == 2 and generator.device == prec_diag.device:
        eps = torch.randn(shape, generator=generator, out=workspace_buffer(workspace, "noise_eps", shape, prec_diag))
        # d^{-1/2} in the buffer of U coeffs below (dead by then)
        inv_sqrt = torch.rsqrt(prec_diag, out=workspace_buffer(workspace, "noise_back", (n_params,), prec_diag))
        white = workspace_buffer(workspace, "noise", (n_samples, n_params), prec_diag)
        torch.mul(eps[:, :n_params], inv_sqrt, out=white)  # d^{-1/2} e1
        low = eps[:, n_params:]  # (n, L) e2
        proj = (white @ prec_factor).add_(low @ cache.capacitance)  # (n, L) rows of U^T D^{-1} z
        coeffs = low - _chol_solve_rows(proj, cache.capacitance_chol)  # (n, L)
        back = torch.mm(coeffs, prec_factor.mT, out=workspace_buffer(workspace, "noise_back", white.shape, white))
        return white.addcdiv_(back, prec_diag)
    eps = torch.randn(shape, generator=generator, device=generator.device, dtype=prec_diag.dtype)
    eps = eps.to(prec_diag.device)
    diag = prec_diag.unsqueeze(-2)  # (1, D) or (R, 1, D)
    white = eps[:, :n_params] * diag.rsqrt()  # (..., n, D) d^{-1/2} e1
    low = eps[:, n_params:]  # (n, L) e2
    proj = thin_matmul(white, prec_factor) + thin_matmul(low, cache.capacitance)  # (..., n, L) rows of U^T D^{-1} z
    coeffs = low - _chol_solve_rows(proj, cache.capacitance_chol)  # (..., n, L)
    return white.addcdiv_(thin_matmul(coeffs, prec_factor.mT), diag)
