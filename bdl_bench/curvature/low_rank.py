r"""The precision :math:`P = UU^\top + \operatorname{diag}(d)` of SLANG, with U (D x L) stored column-major, for R
stacked copies (U ``(R, D, L)``, d ``(R, D)``; a single run is R = 1).

Everything SLANG needs from P besides its update (Woodbury solves, the determinant lemma, exact samples:
Mishkin et al. 2018, Algs. 2-3, written out in ``bdl_bench.gaussians.low_rank``) costs O(D L) per vector
once the L x L *capacitance* :math:`K = U^\top D^{-1} U` and the Cholesky factor R of :math:`I + K` are
known. These functions serve the training loop, which keeps U column-major and K across steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bdl_bench.curvature.gram import column_sqnorms, workspace_buffer
from bdl_bench.curvature.products import thin_matmul


@dataclass(frozen=True)
class PrecisionCache:
    """Quantities of a state's precision that the next step reuses instead of recomputing them, for R
    stacked copies: with them every solve and sample costs O(D L) per vector (Alg. 2, :func:`sample_noise`)."""

    factor_gram: Tensor  # U^T U, (R, L, L) (after an update: diag of its eigenvalues)
    factor_sqnorms: Tensor  # diag(U U^T), (R, D)
    capacitance: Tensor  # K = U^T D^{-1} U, (R, L, L)
    capacitance_chol: Tensor  # R, the lower Cholesky factor of I + K, (R, L, L)


# multiply-adds (L² x columns) per block of the weighted Gram matrix on CPU, where MKL's L x n x L products
# run fastest: 64k columns at L = 8, 4k at L = 32
_GRAM_BLOCK_WORK = 1 << 22


def weighted_gram(
    factor: Tensor, weights: Tensor, rhs: Tensor | None = None, workspace: dict[str, Tensor] | None = None
) -> tuple[Tensor, Tensor | None]:
    """:math:`U^\\top\\operatorname{diag}(w)U` ``(R, L, L)`` and, if given, :math:`U^\\top(w \\circ v)` ``(R, L)``, for
    ``factor`` U ``(R, D, L)`` and ``weights``, ``rhs`` ``(R, D)``.

    U is read column-major (as SLANG stores it), on CPU in blocks of rows of D (:data:`_GRAM_BLOCK_WORK`) so that
    no D x L temporary is allocated (the block buffer from ``workspace`` if given).
    """
    rows = factor.mT.contiguous()  # (R, L, D): free for a column-major U
    n_copies, rank, n_params = rows.shape
    cols = n_params if factor.device.type != "cpu" else max(1, _GRAM_BLOCK_WORK // (n_copies * max(rank, 1) ** 2))
    buffer = workspace_buffer(workspace, "weighted_gram", (n_copies * rank * min(cols, n_params),), factor)
    gram = proj = None
    for start in range(0, n_params, cols):
        block = rows[..., start : start + cols]
        scaled = buffer[: block.numel()].view(block.shape)
        torch.mul(block, weights[:, None, start : start + cols], out=scaled)
        gram = _add_product(gram, scaled, block.mT)
        if rhs is not None:
            proj = _add_product(proj, scaled, rhs[:, start : start + cols, None])
    assert gram is not None
    return gram, None if proj is None else proj[..., 0]


def _add_product(out: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """``out + a @ b`` of batched matrices (``a @ b`` for ``out=None``), ``out`` updated in place: one batched GEMM,
    or broadcast products for a product with one column on several copies (:func:`thin_matmul`)."""
    if out is None:
        return thin_matmul(a, b) if b.shape[-1] == 1 and a.shape[0] > 1 else a @ b
    if b.shape[-1] == 1 and a.shape[0] > 1:
        return out.add_(thin_matmul(a, b))
    return out.baddbmm_(a, b)


def capacitance_cholesky(capacitance: Tensor) -> Tensor:
    """R with :math:`RR^\\top = I + K` (lower Cholesky; positive definite for any U), of every copy."""
    eye = torch.eye(capacitance.shape[-1], dtype=capacitance.dtype, device=capacitance.device)
    return torch.linalg.cholesky(capacitance + eye)


def build_cache(prec_factor: Tensor, prec_diag: Tensor) -> PrecisionCache:
    """:class:`PrecisionCache` of ``(U, d)`` (``(R, D, L)``, ``(R, D)``) computed from scratch (O(D L²))."""
    capacitance, _ = weighted_gram(prec_factor, prec_diag.reciprocal())
    return PrecisionCache(
        factor_gram=prec_factor.mT @ prec_factor,
        factor_sqnorms=column_sqnorms(prec_factor),
        capacitance=capacitance,
        capacitance_chol=capacitance_cholesky(capacitance),
    )


def sample_noise(
    prec_factor: Tensor,
    prec_diag: Tensor,
    cache: PrecisionCache,
    n_samples: int,
    generator: torch.Generator,
    workspace: dict[str, Tensor] | None = None,
) -> Tensor:
    """Draws of :math:`\\mathcal N(0, P^{-1})`, :math:`P = UU^\\top + \\operatorname{diag}(d)`, for R stacked
    precisions (U ``(R, D, L)``, d ``(R, D)``): ``(R, n, D)``.

    :math:`z = d^{1/2}\\circ\\epsilon_1 + U\\epsilon_2` with :math:`\\epsilon_1 \\sim \\mathcal N(0, I_D)`,
    :math:`\\epsilon_2 \\sim \\mathcal N(0, I_L)` has covariance P, so :math:`P^{-1}z` has covariance
    :math:`P^{-1}PP^{-1} = P^{-1}`: exact for any U (zero columns included). By Woodbury, with
    :math:`U^\\top D^{-1} z = U^\\top(d^{-1/2}\\circ\\epsilon_1) + K\\epsilon_2`,
    :math:`P^{-1}z = d^{-1/2}\\circ\\epsilon_1 + D^{-1}U(\\epsilon_2 - C^{-1}U^\\top D^{-1} z)`: two
    passes over U for all n samples (as Alg. 3). One ``(n, D + L)`` draw of normals on the generator's device
    is shared by the copies, as a single run draws it. With ``workspace`` the draws and temporaries reuse its
    buffers, and the result lives in it (valid until the next call with the same workspace).
    """
    n_copies, n_params, rank = prec_factor.shape
    shape = (n_samples, n_params + rank)
    if generator.device == prec_diag.device:
        eps = torch.randn(shape, generator=generator, out=workspace_buffer(workspace, "noise_eps", shape, prec_diag))
    else:
        eps = torch.randn(shape, generator=generator, device=generator.device, dtype=prec_diag.dtype)
        eps = eps.to(prec_diag.device)
    # d^{-1/2} in the buffer of U coeffs below (dead by then)
    inv_sqrt = torch.rsqrt(prec_diag, out=workspace_buffer(workspace, "noise_back", prec_diag.shape, prec_diag))
    white = workspace_buffer(workspace, "noise", (n_copies, n_samples, n_params), prec_diag)
    torch.mul(eps[:, :n_params], inv_sqrt[:, None], out=white)  # d^{-1/2} e1
    low = eps[:, n_params:]  # (n, L) e2
    proj = thin_matmul(white, prec_factor) + thin_matmul(low, cache.capacitance)  # (R, n, L) rows of U^T D^{-1} z
    coeffs = low - torch.cholesky_solve(proj.mT, cache.capacitance_chol).mT  # (R, n, L): rows of proj C^{-1}
    back = workspace_buffer(workspace, "noise_back", white.shape, white)
    if rank == 1:
        torch.mul(coeffs, prec_factor.mT, out=back)
    else:
        torch.bmm(coeffs, prec_factor.mT, out=back)
    return white.addcdiv_(back, prec_diag[:, None])
