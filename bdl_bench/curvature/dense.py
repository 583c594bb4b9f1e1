r"""Dense twins of the fast paths, for tests on small D.

:func:`per_example_gradients` materialises G (D x P) with ``torch.func.vmap(grad)`` on
:func:`bdl_bench.models.params.forward_with`, independently of the layer-by-layer factors;
:func:`dense_low_rank_update` forms the D x D matrix :math:`w_0UU^\top + w_1GG^\top` and takes its
top-L eigenpairs with ``torch.linalg.eigh`` (Mishkin et al. 2018, eqs. 6-7 and 10 as written).
Both refuse D above ``MAX_DENSE_DIM``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from bdl_bench.likelihoods import Likelihood
from bdl_bench.models.params import forward_with

MAX_DENSE_DIM = 4096


def _check_dim(n_params: int) -> None:
    if n_params > MAX_DENSE_DIM:
        raise ValueError(f"dense reference refused: D={n_params} > {MAX_DENSE_DIM}")


def per_example_gradients(model: nn.Module, theta: Tensor, x: Tensor, y: Tensor, likelihood: Likelihood) -> Tensor:
    """G with columns :math:`\\nabla_\\theta \\ell(f(x_i;\\theta_s), y_i)`, ordered ``s * M + i``.

    Args:
        model: any model ``forward_with`` can evaluate.
        theta: ``(D,)`` or ``(S, D)``.
        x: inputs ``(M, ...)``.
        y: targets ``(M,)``.
        likelihood: the per-example loss.

    Returns:
        G, shape ``(D, S·M)``.
    """
    thetas = theta.detach().reshape(-1, theta.shape[-1])
    _check_dim(thetas.shape[1])

    def loss(th: Tensor, xi: Tensor, yi: Tensor) -> Tensor:
        return likelihood.nll(forward_with(model, th, xi.unsqueeze(0)), yi.unsqueeze(0)).sum()

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    grads = vmap(per_example, in_dims=(0, None, None))(thetas, x.to(thetas.dtype), y)  # (S, M, D)
    return grads.reshape(-1, thetas.shape[1]).mT


def dense_low_rank_update(
    grads: Tensor, prec_factor: Tensor, *, old_weight: float, new_weight: float
) -> tuple[Tensor, Tensor]:
    """Top-L eigenpairs of :math:`w_0UU^\\top + w_1GG^\\top` by a dense eigendecomposition.

    Args:
        grads: G, ``(D, P)``.
        prec_factor: U, ``(D, L)``.
        old_weight: :math:`w_0`.
        new_weight: :math:`w_1`.

    Returns:
        ``(U_new, diag_residual)``: :math:`Q_{1:L}\\Lambda_{1:L}^{1/2}` ``(D, L)`` and
        :math:`\\operatorname{diag}(w_0UU^\\top + w_1GG^\\top - U_{new}U_{new}^\\top)` ``(D,)``.
    """
    _check_dim(grads.shape[0])
    rank = prec_factor.shape[1]
    matrix = old_weight * prec_factor @ prec_factor.mT + new_weight * grads @ grads.mT
    evals, evecs = torch.linalg.eigh(matrix)
    new_factor = evecs[:, -rank:] * evals[-rank:].clamp_min(0.0).sqrt()
    return new_factor, matrix.diagonal() - new_factor.square().sum(1)
