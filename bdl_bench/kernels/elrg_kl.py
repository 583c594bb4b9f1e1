r"""ELRG's KL of a low-rank-plus-diagonal Gaussian to a diagonal prior by the matrix determinant lemma
(Tomczak et al. 2020, Lemma 2; :func:`elrg_kl_blocks`), and its gradients (:func:`add_factor_grad`,
:func:`diag_grad`) for the hand-written backward of :class:`~bdl_bench.kernels.elrg_terms.ElrgTerms`: for
:math:`\mathrm{KL}(\mathcal N(\mu, \alpha V V^\top + \operatorname{diag} c) \,\|\,
\mathcal N(0, \operatorname{diag}\lambda^{-1}))` with :math:`G = I_K + \alpha V^\top C^{-1} V`,
:math:`\partial/\partial\mu = \lambda\mu`,
:math:`\partial/\partial V = \alpha(\lambda \circ V - C^{-1} V G^{-1})` and
:math:`\partial/\partial c_d = \tfrac12(\lambda_d - 1/c_d + \alpha\, v_d^\top G^{-1} v_d / c_d^2)`
(:math:`v_d` the d-th row of V).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KLBlock:
    """One block of coordinates of a layer (its weights, or its bias) in Lemma 2's KL (:func:`lemma2`)."""

    mean: Tensor  # (D_b,)
    factor: Tensor  # (K, D_b)
    diag: Tensor | float  # (D_b,) or constant
    lam: Tensor | float  # (D_b,) or constant
    scaled: Tensor | None = None  # factor / diag when diag is a tensor
    lam_factor: Tensor | None = None
    lam_mean: Tensor | None = None


def lemma2(blocks: list[KLBlock], alpha: float) -> tuple[Tensor, Tensor]:
    r"""Lemma 2's KL of one layer whose coordinates come in ``blocks`` that share one low-rank term (the
    Gram matrix :math:`V^\top C^{-1} V` is a sum over blocks), and :math:`G^{-1}`,
    :math:`G = I_K + \alpha V^\top C^{-1} V`. Keeps on each block what its gradient needs."""
    first = blocks[0].factor
    rank = first.shape[0]
    gram = torch.zeros(rank, rank, dtype=first.dtype, device=first.device)
    total = torch.zeros((), dtype=first.dtype, device=first.device)
    for b in blocks:
        dim = b.mean.numel()
        if isinstance(b.diag, Tensor):
            b.scaled = b.factor / b.diag  # V^T C^{-1}
            gram = gram + b.scaled @ b.factor.T
            trace_diag = torch.dot(b.lam, b.diag) if isinstance(b.lam, Tensor) else b.lam * b.diag.sum()
            logdet_diag = torch.log(b.diag).sum()
        else:
            gram = gram + (b.factor @ b.factor.T) / b.diag
            trace_diag = b.diag * (b.lam.sum() if isinstance(b.lam, Tensor) else b.lam * dim)
            logdet_diag = dim * math.log(b.diag)
        flat = b.factor.reshape(-1)
        if isinstance(b.lam, Tensor):
            b.lam_factor, b.lam_mean = b.factor * b.lam, b.mean * b.lam
            trace_low, maha = torch.dot(b.lam_factor.reshape(-1), flat), torch.dot(b.lam_mean, b.mean)
            log_lam = torch.log(b.lam).sum()
        else:
            trace_low, maha = b.lam * torch.dot(flat, flat), b.lam * torch.dot(b.mean, b.mean)
            log_lam = dim * math.log(b.lam)
        total = total + trace_diag + alpha * trace_low + maha - dim - log_lam - logdet_diag
    eye = torch.eye(rank, dtype=first.dtype, device=first.device)
    chol = torch.linalg.cholesky(eye + alpha * gram)
    logdet_gram = 2.0 * torch.log(torch.diagonal(chol)).sum()
    return 0.5 * (total - logdet_gram), torch.cholesky_inverse(chol)


def add_factor_grad(b: KLBlock, gram_inv: Tensor, scale: float | Tensor, out: Tensor) -> Tensor:
    r"""``out += scale·(λ∘V^T − G^{-1} V^T C^{-1})`` in place, ``(K, D_b)``: Lemma 2's
    :math:`\partial\mathrm{KL}/\partial V^\top` is this with ``scale`` = α (module docstring). A 0-dim
    tensor ``scale`` (a weight on the device, never read on the host) scales the unit-weight gradient."""
    if isinstance(scale, Tensor):
        return out.add_(add_factor_grad(b, gram_inv, 1.0, torch.zeros_like(out)).mul_(scale))
    if b.scaled is None and b.lam_factor is None:  # constant diagonal and prior: one (K, K) x (K, D_b) product
        eye = torch.eye(gram_inv.shape[0], dtype=gram_inv.dtype, device=gram_inv.device)
        return out.addmm_((b.lam * eye - gram_inv / b.diag) * scale, b.factor)
    if b.scaled is not None:
        out.addmm_(gram_inv, b.scaled, alpha=-scale)
    else:
        out.addmm_(gram_inv, b.factor, alpha=-scale / b.diag)
    if b.lam_factor is not None:
        return out.add_(b.lam_factor, alpha=scale)
    return out.add_(b.factor, alpha=scale * b.lam)


def diag_grad(b: KLBlock, gram_inv: Tensor, alpha: float, g: float | Tensor) -> Tensor:
    r"""Lemma 2's :math:`g\,\partial\mathrm{KL}/\partial c = \tfrac g2(\lambda - 1/c + \alpha\,
    \operatorname{diag}(C^{-1} V G^{-1} V^\top C^{-1}))` of a block with a learned diagonal, ``(D_b,)``."""
    curvature = (gram_inv @ b.scaled).mul_(b.scaled).sum(0)
    return curvature.mul_(alpha).sub_(b.diag.reciprocal()).add_(b.lam).mul_(0.5 * g)


def elrg_kl_blocks(blocks: list[tuple[Tensor, Tensor, Tensor | float, Tensor | float]], alpha: float) -> Tensor:
    """Lemma 2's KL of a Gaussian whose coordinates come in blocks ``(mean (D_b,), factor V^T (K, D_b), diag,
    prior_precision)`` (diagonal and prior ``(D_b,)`` or one number; e.g. a layer's weights and its bias), without
    concatenating them: the Gram matrix is a sum over blocks."""
    return lemma2([KLBlock(*block) for block in blocks], float(alpha))[0]
