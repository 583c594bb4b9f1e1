r"""Exact curvature matrices for small networks: layer blocks, the whole D x D matrix, and an autograd twin.

* :func:`exact_blocks`: each layer's block :math:`\frac1N\sum_{i,k} g_{ik}g_{ik}^\top` with
  :math:`g_{ik} = \operatorname{vec}_r\sum_t\delta_{ikt}\tilde a_{it}^\top` (augmented row-major order), the "exact block-diagonal"
  matrix of Lee et al. (FB Laplace, Fig. 4; the reference of Fig. 5). O(K N (m n)^2) time.
* :func:`exact_matrix`: the whole mean curvature, ``(D, D)`` in flat order.
* :func:`ggn_by_autograd`: the same GGN from full Jacobians by ``torch.func.jacrev`` and the
  likelihood's output Hessian by ``torch.func.hessian``, independent of the layer-wise code; tests
  compare everything above with it.

All refuse D (or a block's size) above ``MAX_EXACT_DIM``; sums across minibatches and the results are float64.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.func import hessian, jacrev, vmap

from bdl_bench.curvature.pseudo_grads import PseudoGrads
from bdl_bench.likelihoods import Likelihood
from bdl_bench.models.params import forward_with

MAX_EXACT_DIM = 8192


def _check_size(size: int, what: str) -> None:
    if size > MAX_EXACT_DIM:
        raise ValueError(f"exact {what} refused: size {size} > {MAX_EXACT_DIM}; use a structured approximation")


def exact_blocks(batches: Iterable[PseudoGrads]) -> tuple[Tensor, ...]:
    """Each layer's mean curvature block, ``(m·n, m·n)`` in augmented row-major order.

    Raises:
        ValueError: if ``batches`` is empty or a block exceeds ``MAX_EXACT_DIM``.
    """
    sums: list[Tensor] | None = None
    n_total = 0
    for batch in batches:
        if sums is None:
            for layer in batch.layers:
                _check_size(layer.shape[0] * layer.shape[1], "layer block")
            sums = [
                torch.zeros(
                    size := layer.shape[0] * layer.shape[1], size, dtype=torch.float64, device=layer.output_grads.device
                )
                for layer in batch.layers
            ]
        for acc, layer in zip(sums, batch.layers):
            rows = layer.per_example().flatten(2).flatten(0, 1)  # (K·M, m·n)
            acc += rows.mT @ rows
        n_total += batch.n_examples
    if sums is None:
        raise ValueError("exact_blocks needs at least one minibatch")
    return tuple(s / n_total for s in sums)


def exact_matrix(batches: Iterable[PseudoGrads]) -> Tensor:
    """The whole mean curvature ``(D, D)`` in flat parameter order.

    Raises:
        ValueError: if ``batches`` is empty or D exceeds ``MAX_EXACT_DIM``.
    """
    total: Tensor | None = None
    n_total = 0
    for batch in batches:
        _check_size(batch.layout.n_params, "curvature matrix")
        rows = batch.dense()
        total = (rows.mT @ rows).double() if total is None else total + rows.mT @ rows
        n_total += batch.n_examples
    if total is None:
        raise ValueError("exact_matrix needs at least one minibatch")
    return total / n_total


def ggn_by_autograd(model: nn.Module, theta: Tensor, x: Tensor, y: Tensor, likelihood: Likelihood) -> Tensor:
    """Mean GGN :math:`\\frac1N\\sum_i J_i^\\top\\,\\partial^2_f\\ell(f_i, y_i)\\,J_i`, ``(D, D)``, by autograd.

    Args:
        model: any model ``forward_with`` can evaluate.
        theta: ``(D,)``.
        x: inputs ``(N, ...)``.
        y: targets ``(N,)`` (the output Hessian of these likelihoods does not depend on them).
        likelihood: the per-example loss.
    """
    theta = theta.detach()
    _check_size(theta.numel(), "GGN")

    def f_single(th: Tensor, xi: Tensor) -> Tensor:
        return forward_with(model, th, xi.unsqueeze(0))[0]  # (out,)

    def loss_single(fi: Tensor, yi: Tensor) -> Tensor:
        return likelihood.nll(fi.unsqueeze(0), yi.unsqueeze(0)).sum()

    x = x.to(theta.dtype)
    jac = vmap(jacrev(f_single), in_dims=(None, 0))(theta, x)  # (N, out, D)
    f = vmap(f_single, in_dims=(None, 0))(theta, x)  # (N, out)
    out_hess = vmap(hessian(loss_single))(f, y)  # (N, out, out)
    return torch.einsum("nod,nop,npe->de", jac, out_hess, jac) / x.shape[0]
