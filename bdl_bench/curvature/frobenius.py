r"""How well Diag, KFAC, EFB and DEF match one layer's exact information matrix (Lee et al. 2020, Fig. 5).

For one layer's exact mean curvature block :math:`\mathbf I` (GGN, or the sampled-label Fisher) and an
approximation :math:`\hat{\mathbf I}` of it, the normalised Frobenius errors

.. math::

    e_{diag} = \frac{\|\operatorname{diag}(\mathbf I - \hat{\mathbf I})\|}{\|\operatorname{diag}\mathbf I\|},\quad
    e_{off} = \frac{\|\operatorname{off}(\mathbf I - \hat{\mathbf I})\|_F}{\|\operatorname{off}\mathbf I\|_F},\quad
    e = \frac{\|\mathbf I - \hat{\mathbf I}\|_F}{\|\mathbf I\|_F}

(0 = exact; "normalised from 0 to 1" in the paper, 1 being the error of the zero matrix). The approximations
(:func:`layer_approximations`): Diag (the exact diagonal), KFAC (:math:`G\otimes A`), EFB (eq. 4: the Kronecker
eigenbasis with refitted eigenvalues) and DEF (eq. 8: Alg. 1's Kronecker-preserving top-K low-rank part of EFB,
L = g·a >= K eigenvalues kept, plus eq. 5's diagonal correction) for every K. All are ratios, so a scalar factor
of the curvature (the noise precision, MSE's factor 2) leaves them unchanged.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import Tensor

from bdl_bench.curvature.def_lowrank import diagonal_correction, sparsify
from bdl_bench.curvature.exact import exact_blocks
from bdl_bench.curvature.kron import efb_eigenvalues, eigenbasis, flat_to_grid, kron_factors
from bdl_bench.curvature.pseudo_grads import CurvatureKind, pseudo_grads

ERRORS = ("err_diag", "err_offdiag", "err_total")


def frobenius_errors(exact: Tensor, approx: Tensor) -> dict[str, float]:
    """Normalised errors of ``approx`` against ``exact`` (both ``(P, P)``): diagonal, off-diagonal, total.
    A part of ``exact`` that is all zero gives the unnormalised norm of the error there."""
    diff = exact - approx
    off = ~torch.eye(exact.shape[0], dtype=torch.bool, device=exact.device)

    def ratio(num: Tensor, den: Tensor) -> float:
        return float(num.norm() / den.norm()) if float(den.norm()) > 0 else float(num.norm())

    return {
        "err_diag": ratio(diff.diagonal(), exact.diagonal()),
        "err_offdiag": ratio(diff[off], exact[off]),
        "err_total": ratio(diff, exact),
    }


def layer_approximations(
    model: torch.nn.Module,
    theta: Tensor,
    x: Tensor,
    y: Tensor,
    likelihood,
    *,
    layer: int = 0,
    kind: CurvatureKind | str = CurvatureKind.GGN,
    n_samples: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[pd.DataFrame, Tensor]:
    """Errors of Diag, KFAC, EFB and DEF(K) for every K on weight layer ``layer`` (0 = the first); returns
    (table, eigenvalues of I).

    The table has one row per approximation: ``method``, ``rank`` (K, DEF only), ``kept`` (L, DEF only) and
    :data:`ERRORS`. The pseudo-gradients are drawn once (a fixed sample for ``fisher``), so every
    approximation and the exact block describe the same matrix.
    """
    theta = theta.detach().double()
    batch = pseudo_grads(model, theta, x.double(), y, likelihood, kind=kind, n_samples=n_samples, generator=generator)
    exact = exact_blocks([batch])[layer]
    all_factors = kron_factors([batch])
    factors, bases = all_factors[layer], eigenbasis(all_factors)
    eigs, diag = efb_eigenvalues([batch], bases)
    basis, lam = bases[layer], eigs[layer]
    vectors = torch.kron(basis.eigvecs_out, basis.eigvecs_in)
    rows = [
        {"method": "Diag", "rank": None, **frobenius_errors(exact, torch.diag(exact.diagonal()))},
        {"method": "KFAC", "rank": None, **frobenius_errors(exact, factors.dense())},
        {"method": "EFB", "rank": None, **frobenius_errors(exact, vectors @ torch.diag(lam.reshape(-1)) @ vectors.mT)},
    ]
    exact_diag = flat_to_grid(diag, basis.slot)
    for k in range(1, lam.numel() + 1):
        low = sparsify(basis.slot, basis.eigvecs_out, basis.eigvecs_in, lam, k)
        approx = low.dense() + torch.diag(diagonal_correction(exact_diag, low).reshape(-1))
        rows.append({"method": "DEF", "rank": k, "kept": low.rank, **frobenius_errors(exact, approx)})
    return pd.DataFrame(rows), torch.linalg.eigvalsh(exact)
