r"""Exact curvature matrices for small networks: layer blocks and the whole D x D matrix.

* :func:`exact_blocks`: each layer's block :math:`\frac1N\sum_{i,k} g_{ik}g_{ik}^\top` with
  :math:`g_{ik} = \operatorname{vec}_r\sum_t\delta_{ikt}\tilde a_{it}^\top` (augmented row-major order), the
  "exact block-diagonal" matrix of Lee et al. (FB Laplace, Fig. 4; the reference of Fig. 5). O(K N (m n)^2) time.
* :func:`exact_matrix`: the whole mean curvature, ``(D, D)`` in flat order.

Both refuse D (or a block's size) above ``MAX_EXACT_DIM``; sums across minibatches and the results are float64.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from bdl_bench.curvature.pseudo_grads import PseudoGrads

MAX_EXACT_DIM = 8192


def _check_size(size: int, what: str) -> None:
    if size > MAX_EXACT_DIM:
        raise ValueError(f"exact {what} refused: size {size} > {MAX_EXACT_DIM}; use a structured approximation")


def exact_blocks(batches: Iterable[PseudoGrads]) -> tuple[Tensor, ...]:
    """Each layer's mean curvature block, ``(m·n, m·n)`` in augmented row-major order."""
    sums: list[Tensor] | None = None
    n_total = 0
    for batch in batches:
        if sums is None:
            sizes = [layer.shape[0] * layer.shape[1] for layer in batch.layers]
            for size in sizes:
                _check_size(size, "layer block")
            device = batch.layers[0].output_grads.device
            sums = [torch.zeros(size, size, dtype=torch.float64, device=device) for size in sizes]
        for acc, layer in zip(sums, batch.layers):
            rows = layer.per_example().flatten(2).flatten(0, 1)  # (K·M, m·n)
            acc += rows.mT @ rows
        n_total += batch.n_examples
    if sums is None:
        raise ValueError("exact_blocks needs at least one minibatch")
    return tuple(s / n_total for s in sums)


def exact_matrix(batches: Iterable[PseudoGrads]) -> Tensor:
    """The whole mean curvature ``(D, D)`` in flat parameter order."""
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
