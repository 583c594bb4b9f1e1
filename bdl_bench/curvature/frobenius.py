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

from collections.abc import Iterable

import pandas as pd
import torch
from torch import Tensor

from bdl_bench.curvature.def_lowrank import diagonal_correction, sparsify
from bdl_bench.curvature.exact import exact_blocks
from bdl_bench.curvature.kron import KronEigenbasis, KronFactors, eigenbasis, kron_factors
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


def efb_grid(exact: Tensor, basis: KronEigenbasis) -> Tensor:
    r"""EFB's eigenvalues (eq. 4) from a layer's exact block: its diagonal in the Kronecker eigenbasis
    :math:`Q = U_G\otimes U_A`, :math:`\operatorname{diag}(Q^\top\mathbf IQ)` (the mean squared projection of
    the pseudo-gradients onto each basis vector), as the ``(m, n)`` grid of Alg. 1."""
    q = torch.kron(basis.eigvecs_out, basis.eigvecs_in)
    return (q.mT @ exact @ q).diagonal().reshape(basis.eigvecs_out.shape[0], -1)


def def_information(exact: Tensor, basis: KronEigenbasis, rank: int | None) -> tuple[Tensor, int]:
    """DEF's sparse information form of one layer (eq. 8) as a dense ``(P, P)`` matrix: Alg. 1's top-``rank``
    Kronecker-preserving low-rank part of EFB plus eq. 5's diagonal correction, so its diagonal is exact
    (Prop. 1); returns (matrix, L kept)."""
    lam = efb_grid(exact, basis)
    low = sparsify(basis.slot, basis.eigvecs_out, basis.eigvecs_in, lam, rank)
    return low.dense() + torch.diag(diagonal_correction(exact.diagonal().reshape(lam.shape), low).reshape(-1)), low.rank


def block_approximations(exact: Tensor, factors: KronFactors, ranks: Iterable[int] | None = None) -> pd.DataFrame:
    """Errors of Diag, KFAC, EFB and DEF(K) against one layer's exact block ``(P, P)`` (augmented row-major order)
    given its KFAC ``factors``: one row per approximation (``method``, ``rank`` K and ``kept`` L for DEF, and
    :data:`ERRORS`), DEF at each K of ``ranks`` (every K = 1 … P by default)."""
    basis = eigenbasis([factors])[0]
    q = torch.kron(basis.eigvecs_out, basis.eigvecs_in)
    rows = [
        {"method": "Diag", "rank": None, **frobenius_errors(exact, torch.diag(exact.diagonal()))},
        {"method": "KFAC", "rank": None, **frobenius_errors(exact, factors.dense())},
        {
            "method": "EFB",
            "rank": None,
            **frobenius_errors(exact, q @ torch.diag(efb_grid(exact, basis).reshape(-1)) @ q.mT),
        },
    ]
    for k in range(1, exact.shape[0] + 1) if ranks is None else ranks:
        approx, kept = def_information(exact, basis, k)
        rows.append({"method": "DEF", "rank": k, "kept": kept, **frobenius_errors(exact, approx)})
    return pd.DataFrame(rows)


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
    """:func:`block_approximations` for every K on weight layer ``layer`` (0 = the first) of ``model`` at
    ``theta`` on ``(x, y)``; returns (table, eigenvalues of I). The pseudo-gradients are drawn once (a fixed
    sample for ``fisher``), so every approximation and the exact block describe the same matrix."""
    theta = theta.detach().double()
    batch = pseudo_grads(model, theta, x.double(), y, likelihood, kind=kind, n_samples=n_samples, generator=generator)
    exact = exact_blocks([batch])[layer]
    return block_approximations(exact, kron_factors([batch])[layer]), torch.linalg.eigvalsh(exact)
