r"""Products with the per-example gradient matrix G, layer by layer, and SLANG's top-L update.

G is the D x P matrix of per-example gradients (:mod:`bdl_bench.curvature.per_example`). For a
linear layer with inputs A (P x in) and output gradients :math:`\Delta` (P x out), column p of G
restricted to the layer's weight is :math:`\operatorname{vec}(\delta_p a_p^\top)` and to its bias
:math:`\delta_p`. Hence, summing over layers,

* :math:`g_p^\top g_q = \sum_l (a_p\cdot a_q + [\text{bias}])(\delta_p\cdot\delta_q)`
  (:func:`gram_matrix`, O(P² Σ(in+out)));
* :math:`u^\top g_p = \sum_l \delta_p^\top U_l a_p` with u reshaped per layer
  (:func:`factor_cross`, O(P D L) for L vectors u);
* :math:`G c = \sum_l \Delta^\top \operatorname{diag}(c) A` (:func:`add_matmul`, O(P D K) for K vectors c);
* :math:`\operatorname{diag}(GG^\top) = (\Delta\circ\Delta)^\top(A\circ A)` (:func:`sq_diag`, O(P D)).

The Gram trick (Mishkin et al. 2018, Sec. 3, eqs. 5-7, done exactly instead of with a randomised
eigensolver): with :math:`B = [\sqrt{w_0}\,U,\ \sqrt{w_1}\,G]` (D x (L+P)),
:math:`w_0 U U^\top + w_1 G G^\top = B B^\top`, whose nonzero eigenpairs come from the small
(L+P) x (L+P) matrix :math:`B^\top B`: if :math:`B^\top B w = \lambda w` with :math:`\|w\| = 1`, then
:math:`Bw/\sqrt\lambda` is a unit eigenvector of :math:`BB^\top` with eigenvalue :math:`\lambda`.
SLANG's new factor :math:`Q_{1:L}\Lambda_{1:L}^{1/2}` (eq. 7) is therefore :math:`B W_L`, with
:math:`W_L` the top-L unit eigenvectors of :math:`B^\top B`; and its Gram matrix
:math:`(BW_L)^\top BW_L = \Lambda_L` is known without touching D. Cost
O(P D L + D L² + (L+P)³), memory O(D L): no D x P tensor is allocated (per-layer temporaries are
chunked over the P columns to stay below the size of U).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from bdl_bench.curvature.per_example import PerExampleFactors

_MIN_CHUNK_ELEMENTS = 1 << 22  # per-layer temporaries may always use this many elements


def _column_chunks(n_cols: int, row_elements: int, budget: int) -> Iterator[slice]:
    """Slices of ``range(n_cols)`` whose temporaries (``row_elements`` each) fit in ``budget`` elements."""
    step = max(1, max(budget, _MIN_CHUNK_ELEMENTS) // max(row_elements, 1))
    for start in range(0, n_cols, step):
        yield slice(start, min(start + step, n_cols))


def gram_matrix(factors: PerExampleFactors) -> Tensor:
    """:math:`G^\\top G`, shape ``(P, P)``: :math:`\\sum_l (A A^\\top + [1])\\circ(\\Delta\\Delta^\\top)`."""
    out = None
    for layer in factors.layers:
        a_gram = layer.inputs @ layer.inputs.mT
        if layer.slot.bias_slice is not None:
            a_gram += 1.0
        term = a_gram.mul_(layer.output_grads @ layer.output_grads.mT)
        out = term if out is None else out.add_(term)
    assert out is not None
    return out


def factor_cross(factors: PerExampleFactors, vectors: Tensor) -> Tensor:
    """:math:`G^\\top V`, shape ``(P, K)``, for ``vectors`` V of shape ``(D, K)``.

    Per layer, :math:`(G^\\top V)_{pk} = \\delta_p^\\top V_{l,k}\\, a_p` with :math:`V_{l,k}` the
    ``(out, in)`` block of column k: one GEMM :math:`\\Delta\\, V_l` (V_l viewed as
    ``(out, in·K)``, which is contiguous for a row-major V), then a batched dot product with A.
    """
    vectors = vectors.contiguous()
    n_vec = vectors.shape[1]
    out = torch.zeros(factors.n_columns, n_vec, dtype=factors.dtype, device=factors.device)
    for layer in factors.layers:
        slot = layer.slot
        block = vectors[slot.weight_slice].view(slot.out_features, slot.in_features * n_vec)
        for cols in _column_chunks(factors.n_columns, slot.in_features * n_vec, vectors.numel()):
            tmp = (layer.output_grads[cols] @ block).view(-1, slot.in_features, n_vec)  # (p, in, K)
            out[cols] += torch.bmm(layer.inputs[cols].unsqueeze(1), tmp).squeeze(1)
        if slot.bias_slice is not None:
            out.addmm_(layer.output_grads, vectors[slot.bias_slice])
    return out


def add_matmul(factors: PerExampleFactors, coeffs: Tensor, out: Tensor, alpha: float = 1.0) -> Tensor:
    """``out += alpha * G @ coeffs`` in place, for ``coeffs`` ``(P, K)`` and a contiguous ``out`` ``(D, K)``.

    Per layer, :math:`(G C)_l = \\sum_p \\delta_p\\, (a_p \\otimes c_p)`: one GEMM
    :math:`\\Delta^\\top Z` with :math:`Z_p = a_p \\otimes c_p` (``(P, in·K)``), written straight into
    the ``(out, in·K)`` view of the layer's rows of ``out``.

    Returns:
        ``out``.
    """
    if not out.is_contiguous():
        raise ValueError("add_matmul needs a contiguous output (a row-major (D, K) tensor)")
    n_vec = coeffs.shape[1]
    for layer in factors.layers:
        slot = layer.slot
        block = out[slot.weight_slice].view(slot.out_features, slot.in_features * n_vec)
        for cols in _column_chunks(factors.n_columns, slot.in_features * n_vec, out.numel()):
            z = (layer.inputs[cols].unsqueeze(2) * coeffs[cols].unsqueeze(1)).view(-1, slot.in_features * n_vec)
            block.addmm_(layer.output_grads[cols].mT, z, alpha=alpha)
        if slot.bias_slice is not None:
            out[slot.bias_slice].addmm_(layer.output_grads.mT, coeffs, alpha=alpha)
    return out


def sq_diag(factors: PerExampleFactors) -> Tensor:
    """:math:`\\operatorname{diag}(GG^\\top) = \\sum_p g_p \\circ g_p`, shape ``(D,)``."""
    out = torch.zeros(factors.n_params, dtype=factors.dtype, device=factors.device)
    for layer in factors.layers:
        slot = layer.slot
        sq_grads = layer.output_grads.square()
        out[slot.weight_slice].view(slot.out_features, slot.in_features).addmm_(sq_grads.mT, layer.inputs.square())
        if slot.bias_slice is not None:
            out[slot.bias_slice] = sq_grads.sum(0)
    return out


@dataclass(frozen=True)
class LowRankUpdate:
    """The top-L eigen-update of :math:`w_0 UU^\\top + w_1 GG^\\top` (Mishkin et al. 2018, eqs. 6-7, 10).

    Attributes:
        prec_factor: :math:`U_{new} = Q_{1:L}\\Lambda_{1:L}^{1/2}`, shape ``(D, L)``, columns in
            decreasing order of eigenvalue (mutually orthogonal).
        eigenvalues: :math:`\\Lambda_{1:L}` (clamped at 0), shape ``(L,)``; also
            :math:`U_{new}^\\top U_{new}` = ``diag(eigenvalues)``.
        factor_sqnorms: :math:`\\operatorname{diag}(U_{new}U_{new}^\\top)`, shape ``(D,)``.
        diag_residual: :math:`\\operatorname{diag}(w_0 UU^\\top + w_1 GG^\\top - U_{new}U_{new}^\\top)`,
            shape ``(D,)``: SLANG's diagonal correction (eq. 10); nonnegative up to rounding.
    """

    prec_factor: Tensor  # (D, L)
    eigenvalues: Tensor  # (L,)
    factor_sqnorms: Tensor  # (D,)
    diag_residual: Tensor  # (D,)


def low_rank_update(
    factors: PerExampleFactors,
    prec_factor: Tensor,
    *,
    old_weight: float,
    new_weight: float,
    factor_gram: Tensor | None = None,
    factor_sqnorms: Tensor | None = None,
    path: str = "auto",
) -> LowRankUpdate:
    """Top-L eigenpairs of :math:`w_0 UU^\\top + w_1 GG^\\top` by the Gram trick (module docstring).

    Args:
        factors: per-example factors defining G (D x P).
        prec_factor: U, shape ``(D, L)``.
        old_weight: :math:`w_0 \\ge 0` (SLANG: :math:`1-\\beta`).
        new_weight: :math:`w_1 \\ge 0` (SLANG: :math:`\\beta N / (M S)`).
        factor_gram: :math:`U^\\top U` ``(L, L)`` if known (SLANG keeps it: it is the previous
            update's ``diag(eigenvalues)``); computed (O(D L²)) when ``None``.
        factor_sqnorms: :math:`\\operatorname{diag}(UU^\\top)` ``(D,)`` if known; computed when ``None``.
        path: ``"gram"`` (eigendecomposition of the (L+P) x (L+P) matrix :math:`B^\\top B`),
            ``"dense"`` (materialise G and decompose the D x D matrix :math:`BB^\\top`: cheaper when
            D <= L + P, e.g. logistic regression) or ``"auto"`` (the smaller of the two).

    Returns:
        The :class:`LowRankUpdate`.

    Raises:
        FloatingPointError: if :math:`B^\\top B` is not finite (a non-finite or overflowing gradient).
    """
    rank = prec_factor.shape[1]
    if path not in ("auto", "gram", "dense"):
        raise ValueError(f"unknown path {path!r}; choose 'auto', 'gram' or 'dense'")
    if path == "dense" or (path == "auto" and factors.n_params <= rank + factors.n_columns):
        return _dense_update(factors, prec_factor, old_weight=old_weight, new_weight=new_weight)
    if factor_gram is None:
        factor_gram = prec_factor.mT @ prec_factor
    if factor_sqnorms is None:
        factor_sqnorms = prec_factor.square().sum(1)
    n_cols = factors.n_columns
    btb = torch.empty(rank + n_cols, rank + n_cols, dtype=factors.dtype, device=factors.device)
    btb[:rank, :rank] = factor_gram * old_weight
    cross = factor_cross(factors, prec_factor).mul_((old_weight * new_weight) ** 0.5)  # (P, L)
    btb[rank:, :rank] = cross
    btb[:rank, rank:] = cross.mT
    btb[rank:, rank:] = gram_matrix(factors).mul_(new_weight)
    if not bool(torch.isfinite(btb).all()):
        raise FloatingPointError("non-finite Gram matrix B^T B (non-finite or overflowing per-example gradients)")
    evals, evecs = torch.linalg.eigh(btb)  # ascending
    eigenvalues = evals[-rank:].flip(0).clamp_min(0.0)
    top = evecs[:, -rank:].flip(1)  # (L+P, L)
    new_factor = prec_factor @ (top[:rank] * old_weight**0.5)  # sqrt(w0) U W_U
    add_matmul(factors, top[rank:].contiguous(), new_factor, alpha=new_weight**0.5)  # + sqrt(w1) G W_G
    new_sqnorms = torch.linalg.vector_norm(new_factor, dim=1).square_()
    residual = factor_sqnorms * old_weight + sq_diag(factors).mul_(new_weight) - new_sqnorms
    return LowRankUpdate(
        prec_factor=new_factor, eigenvalues=eigenvalues, factor_sqnorms=new_sqnorms, diag_residual=residual
    )


def _dense_update(
    factors: PerExampleFactors, prec_factor: Tensor, *, old_weight: float, new_weight: float
) -> LowRankUpdate:
    """The same update through the D x D matrix :math:`w_0UU^\\top + w_1GG^\\top` (for D <= L + P)."""
    rank = prec_factor.shape[1]
    grads = factors.dense()  # (D, P)
    matrix = torch.addmm(prec_factor @ prec_factor.mT, grads, grads.mT, beta=old_weight, alpha=new_weight)
    if not bool(torch.isfinite(matrix).all()):
        raise FloatingPointError(
            "non-finite matrix w0 U U^T + w1 G G^T (non-finite or overflowing per-example gradients)"
        )
    evals, evecs = torch.linalg.eigh(matrix)  # ascending
    eigenvalues = evals[-rank:].flip(0).clamp_min(0.0)
    new_factor = evecs[:, -rank:].flip(1) * eigenvalues.sqrt()
    new_sqnorms = new_factor.square().sum(1)
    return LowRankUpdate(
        prec_factor=new_factor,
        eigenvalues=eigenvalues,
        factor_sqnorms=new_sqnorms,
        diag_residual=matrix.diagonal() - new_sqnorms,
    )
