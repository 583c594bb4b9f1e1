r"""Dense references for small D, independent of the layer-by-layer code in ``bdl_bench.curvature``.

:func:`per_example_gradients` materialises G (D x P) with ``torch.func.vmap(grad)`` on ``forward_with``;
:func:`dense_low_rank_update` takes the top-L eigenpairs of the D x D matrix :math:`w_0UU^\top + w_1GG^\top`
(Mishkin et al. 2018, eqs. 6-7 and 10 as written); :func:`ggn_by_autograd` forms the mean GGN from full
Jacobians (``jacrev``) and the likelihood's output Hessian (``hessian``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import grad, hessian, jacrev, vmap

from bdl_bench.likelihoods import Likelihood
from bdl_bench.models.params import forward_with

MAX_DIM = 8192


def _check_dim(n_params: int) -> None:
    assert n_params <= MAX_DIM, f"dense reference refused: D={n_params} > {MAX_DIM}"


def per_example_gradients(model: nn.Module, theta: Tensor, x: Tensor, y: Tensor, likelihood: Likelihood) -> Tensor:
    """G ``(D, S·M)`` with columns :math:`\\nabla_\\theta \\ell(f(x_i;\\theta_s), y_i)`, ordered ``s * M + i``;
    ``theta`` is ``(D,)`` or ``(S, D)``."""
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
    """``(U_new, diag_residual)`` for G ``(D, P)`` and U ``(D, L)``: :math:`Q_{1:L}\\Lambda_{1:L}^{1/2}` ``(D, L)``
    of :math:`w_0UU^\\top + w_1GG^\\top` and the diagonal of what it leaves out ``(D,)``."""
    _check_dim(grads.shape[0])
    rank = prec_factor.shape[1]
    matrix = old_weight * prec_factor @ prec_factor.mT + new_weight * grads @ grads.mT
    evals, evecs = torch.linalg.eigh(matrix)
    new_factor = evecs[:, -rank:] * evals[-rank:].clamp_min(0.0).sqrt()
    return new_factor, matrix.diagonal() - new_factor.square().sum(1)


def ggn_by_autograd(model: nn.Module, theta: Tensor, x: Tensor, y: Tensor, likelihood: Likelihood) -> Tensor:
    """Mean GGN :math:`\\frac1N\\sum_i J_i^\\top\\,\\partial^2_f\\ell(f_i, y_i)\\,J_i`, ``(D, D)``."""
    theta = theta.detach()
    _check_dim(theta.numel())

    def f_single(th: Tensor, xi: Tensor) -> Tensor:
        return forward_with(model, th, xi.unsqueeze(0))[0]  # (out,)

    def loss_single(fi: Tensor, yi: Tensor) -> Tensor:
        return likelihood.nll(fi.unsqueeze(0), yi.unsqueeze(0)).sum()

    x = x.to(theta.dtype)
    jac = vmap(jacrev(f_single), in_dims=(None, 0))(theta, x)  # (N, out, D)
    f = vmap(f_single, in_dims=(None, 0))(theta, x)  # (N, out)
    out_hess = vmap(hessian(loss_single))(f, y)  # (N, out, out)
    return torch.einsum("nod,nop,npe->de", jac, out_hess, jac) / x.shape[0]
