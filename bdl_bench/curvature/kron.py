r"""Kronecker factors, their eigenbasis, EFB eigenvalues and the diagonal, from pseudo-gradients.

Every quantity is a *mean* over the N training examples (the information matrix
:math:`\mathbf I = \mathbb E[\delta\theta\,\delta\theta^\top]` of Lee et al., Sec. 2.1); a Laplace
posterior scales it by N (or the paper's hyperparameter N) and adds the prior precision.

Per weight layer, in the augmented row-major order of :mod:`bdl_bench.curvature.pseudo_grads`
(pseudo-gradients :math:`g_{ik} = \sum_t\delta_{ikt}\tilde a_{it}^\top`; for a linear layer T = 1 and
:math:`g_{ik} = \delta_{ik}\otimes\tilde a_i`):

* KFAC (Martens & Grosse 2015; Lee et al. eq. 1): :math:`\mathbf I_l \approx G\otimes A` with
  :math:`A = \frac1N\sum_{i,t}\tilde a_{it}\tilde a_{it}^\top` (n x n) and
  :math:`G = \frac1{NT}\sum_{i,k,t}\delta_{ikt}\delta_{ikt}^\top` (m x m) (:func:`kron_factors`; for a
  convolution this is KFC, Grosse & Martens 2016);
* the Kronecker eigenbasis :math:`G = U_GS_GU_G^\top`, :math:`A = U_AS_AU_A^\top` (:func:`eigenbasis`);
* EFB (George et al. 2018; Lee et al. eq. 4): eigenvalues refitted in the fixed basis
  :math:`V = U_G\otimes U_A`, :math:`\Lambda_{\beta\zeta} = \frac1N\sum_{i,k}(U_G^\top g_{ik}U_A)^2_{\beta\zeta}`,
  i.e. :math:`\operatorname{diag}(V^\top\mathbf I_lV)`: the Frobenius-optimal diagonal in that basis
  (:func:`efb_eigenvalues`), as an m x n grid (entry :math:`(\beta, \zeta)` belongs to
  :math:`u_{G,\beta}\otimes u_{A,\zeta}`);
* the exact diagonal :math:`\frac1N\sum_{i,k}g_{ik}\circ g_{ik}` (:func:`diagonal`), in flat parameter
  order (all layers at once); one GEMM per linear layer, the per-example matrices for a convolution.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from bdl_bench.curvature.pseudo_grads import KronSlot, LayerPseudoGrads, PseudoGrads


@dataclass(frozen=True)
class KronFactors:
    """KFAC factors of one layer: :math:`\\mathbf I_l \\approx G \\otimes A` (augmented row-major order).

    Attributes:
        slot: the layer's place in the flat vector.
        a_factor: A, ``(n, n)``, n = in_features (+1 with a bias).
        g_factor: G, ``(m, m)``, m = out_features.
    """

    slot: KronSlot
    a_factor: Tensor  # (n, n)
    g_factor: Tensor  # (m, m)

    def dense(self) -> Tensor:
        """:math:`G\\otimes A`, ``(m·n, m·n)``."""
        return torch.kron(self.g_factor, self.a_factor)


@dataclass(frozen=True)
class KronEigenbasis:
    """Eigendecompositions of one layer's KFAC factors, eigenvalues in descending order.

    Attributes:
        slot: the layer's place in the flat vector.
        eigvecs_out: :math:`U_G`, ``(m, m)`` orthogonal.
        eigvecs_in: :math:`U_A`, ``(n, n)`` orthogonal.
        eigvals_out: :math:`S_G`, ``(m,)`` (clamped at 0).
        eigvals_in: :math:`S_A`, ``(n,)`` (clamped at 0).
    """

    slot: KronSlot
    eigvecs_out: Tensor  # (m, m)
    eigvecs_in: Tensor  # (n, n)
    eigvals_out: Tensor  # (m,)
    eigvals_in: Tensor  # (n,)

    def kfac_eigenvalues(self) -> Tensor:
        """KFAC's eigenvalues :math:`S_G\\otimes S_A` as an ``(m, n)`` grid."""
        return self.eigvals_out[:, None] * self.eigvals_in[None, :]


def _accumulate_pairs(layer: LayerPseudoGrads) -> tuple[Tensor, Tensor]:
    """:math:`\\sum_{i,t}\\tilde a\\tilde a^\\top` and :math:`\\frac1T\\sum_{i,k,t}\\delta\\delta^\\top` of a minibatch."""
    inputs = layer.inputs.reshape(-1, layer.inputs.shape[-1])
    deltas = layer.output_grads.reshape(-1, layer.output_grads.shape[-1])
    return inputs.mT @ inputs, deltas.mT @ deltas / layer.n_positions


def kron_factors(batches: Iterable[PseudoGrads]) -> tuple[KronFactors, ...]:
    """KFAC factors A and G of every layer, averaged over all examples of ``batches``.

    Raises:
        ValueError: if ``batches`` is empty.
    """
    sums: list[list[Tensor]] | None = None
    n_total = 0
    slots: tuple[KronSlot, ...] = ()
    for batch in batches:
        pairs = [_accumulate_pairs(layer) for layer in batch.layers]
        if sums is None:
            sums = [list(p) for p in pairs]
            slots = tuple(layer.slot for layer in batch.layers)
        else:
            for acc, (a, g) in zip(sums, pairs):
                acc[0] += a
                acc[1] += g
        n_total += batch.n_examples
    if sums is None:
        raise ValueError("kron_factors needs at least one minibatch")
    return tuple(KronFactors(slot, a / n_total, g / n_total) for slot, (a, g) in zip(slots, sums))


def _eigh_descending(matrix: Tensor) -> tuple[Tensor, Tensor]:
    evals, evecs = torch.linalg.eigh(matrix)
    return evals.flip(0).clamp_min(0.0), evecs.flip(1)


def eigenbasis(factors: Iterable[KronFactors]) -> tuple[KronEigenbasis, ...]:
    """Eigendecompose each layer's A and G once (Lee et al., Alg. 2, "Compute U_A, U_G")."""
    out = []
    for f in factors:
        s_g, u_g = _eigh_descending(f.g_factor)
        s_a, u_a = _eigh_descending(f.a_factor)
        out.append(KronEigenbasis(f.slot, u_g, u_a, s_g, s_a))
    return tuple(out)


def _layer_diag(layer: LayerPseudoGrads) -> Tensor:
    """:math:`\\sum_{i,k}g_{ik}\\circ g_{ik}` as an ``(m, n)`` grid (sum, not mean)."""
    if layer.n_positions == 1:  # sum_i (sum_k d_ik^2) a_i^2: one GEMM
        return layer.output_grads[:, :, 0].square().sum(0).mT @ layer.inputs[:, 0].square()
    return layer.per_example().square().sum((0, 1))


def _grid_to_flat(grid: Tensor, slot: KronSlot, out: Tensor) -> None:
    """Write an ``(m, n)`` grid in augmented order into the flat vector ``out`` (weights, then bias)."""
    out[slot.weight_slice] += grid[:, : slot.in_features].reshape(-1)
    if slot.bias_slice is not None:
        out[slot.bias_slice] += grid[:, slot.in_features]


def flat_to_grid(flat: Tensor, slot: KronSlot) -> Tensor:
    """The layer's entries of a flat ``(D,)`` vector as an ``(m, n)`` grid in augmented order."""
    weight = flat[slot.weight_slice].view(slot.out_features, slot.in_features)
    if slot.bias_slice is None:
        return weight
    return torch.cat([weight, flat[slot.bias_slice][:, None]], dim=1)


def efb_eigenvalues(
    batches: Iterable[PseudoGrads], bases: tuple[KronEigenbasis, ...]
) -> tuple[tuple[Tensor, ...], Tensor]:
    """EFB eigenvalues in each layer's Kronecker eigenbasis and the exact diagonal, in one pass.

    Args:
        batches: pseudo-gradients of the whole training set.
        bases: :func:`eigenbasis` of the same layers, in the same order.

    Returns:
        ``(eigenvalues, diagonal)``: per layer the ``(m, n)`` grid
        :math:`\\Lambda_{\\beta\\zeta} = \\operatorname{mean}_i\\sum_k((U_G^\\top\\delta_{ik})_\\beta
        (U_A^\\top\\tilde a_i)_\\zeta)^2` (Lee et al., Sec. 2.2), and the exact diagonal ``(D,)`` in flat
        order, both from the same pseudo-gradients (so DEF's diagonal correction is exact for them).

    Raises:
        ValueError: if ``batches`` is empty.
    """
    eig_sums: list[Tensor] | None = None
    diag: Tensor | None = None
    n_total = 0
    for batch in batches:
        if diag is None:
            first = batch.layers[0].inputs
            diag = torch.zeros(batch.layout.n_params, dtype=first.dtype, device=first.device)
            eig_sums = [torch.zeros(layer.shape, dtype=first.dtype, device=first.device) for layer in batch.layers]
        assert eig_sums is not None
        for acc, layer, basis in zip(eig_sums, batch.layers, bases):
            proj_in = layer.inputs @ basis.eigvecs_in  # (M, T, n)
            proj_out = layer.output_grads @ basis.eigvecs_out  # (K, M, T, m)
            if layer.n_positions == 1:  # ((U_G^T d)(U_A^T a)^T)^2 summed: one GEMM
                acc += proj_out[:, :, 0].square().sum(0).mT @ proj_in[:, 0].square()
            else:
                acc += torch.einsum("kitm,itn->kimn", proj_out, proj_in).square().sum((0, 1))
            _grid_to_flat(_layer_diag(layer), layer.slot, diag)
        n_total += batch.n_examples
    if diag is None or eig_sums is None:
        raise ValueError("efb_eigenvalues needs at least one minibatch")
    return tuple(e / n_total for e in eig_sums), diag / n_total


def diagonal(batches: Iterable[PseudoGrads]) -> Tensor:
    """The exact diagonal of the mean curvature, ``(D,)`` in flat order (Lee et al., eq. 5's E[δθ²]).

    Raises:
        ValueError: if ``batches`` is empty.
    """
    diag: Tensor | None = None
    n_total = 0
    for batch in batches:
        if diag is None:
            first = batch.layers[0].inputs
            diag = torch.zeros(batch.layout.n_params, dtype=first.dtype, device=first.device)
        for layer in batch.layers:
            _grid_to_flat(_layer_diag(layer), layer.slot, diag)
        n_total += batch.n_examples
    if diag is None:
        raise ValueError("diagonal needs at least one minibatch")
    return diag / n_total
