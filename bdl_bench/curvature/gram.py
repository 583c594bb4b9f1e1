r"""Products with the per-example gradient matrix G, layer by layer, and SLANG's top-L update.

G is the D x P matrix of per-example gradients (:mod:`bdl_bench.curvature.per_example`). For a
linear layer with inputs A (P x in) and output gradients :math:`\Delta` (P x out), column p of G
restricted to the layer's weight is :math:`\operatorname{vec}(\delta_p a_p^\top)` and to its bias
:math:`\delta_p`. Hence, summing over layers,

* :math:`g_p^\top g_q = \sum_l (a_p\cdot a_q + [\text{bias}])(\delta_p\cdot\delta_q)`
  (:func:`gram_matrix`, O(P² Σ(in+out)));
* :math:`u^\top g_p = \sum_l \delta_p^\top U_l a_p` with u reshaped per layer to
  :math:`U_l` (out x in) (:func:`factor_cross`, O(P D) per vector u);
* :math:`G c = \sum_l \Delta^\top \operatorname{diag}(c) A` (:func:`add_matmul`, O(P D) per vector c);
* :math:`\operatorname{diag}(GG^\top) = (\Delta\circ\Delta)^\top(A\circ A)` (:func:`sq_diag`, O(P D)).

Per vector and layer these are the GEMMs of a training step (out x in x P), so they run at the
speed of backpropagation. They are fastest when the D x K matrices are stored column by column
(``torch.empty(K, D).mT``: each vector contiguous), as SLANG stores U; other layouts are copied.

The Gram trick (Mishkin et al. 2018, Sec. 3, eqs. 5-7, done exactly instead of with a randomised
eigensolver): with :math:`B = [\sqrt{w_0}\,U,\ \sqrt{w_1}\,G]` (D x (L+P)),
:math:`w_0 U U^\top + w_1 G G^\top = B B^\top`, whose nonzero eigenpairs come from the small
(L+P) x (L+P) matrix :math:`B^\top B`: if :math:`B^\top B w = \lambda w` with :math:`\|w\| = 1`, then
:math:`Bw/\sqrt\lambda` is a unit eigenvector of :math:`BB^\top` with eigenvalue :math:`\lambda`.
SLANG's new factor :math:`Q_{1:L}\Lambda_{1:L}^{1/2}` (eq. 7) is therefore :math:`B W_L`, with
:math:`W_L` the top-L unit eigenvectors of :math:`B^\top B`; and its Gram matrix
:math:`(BW_L)^\top BW_L = \Lambda_L` is known without touching D. Cost
O(P D L + D L² + (L+P)³), memory O(D L): no D x P tensor is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from bdl_bench.curvature.per_example import LayerFactors, PerExampleFactors

_BLOCK_ELEMENTS = 1 << 18  # columns of a (K, D) matrix handled at a time by blocked passes (~1 MB)


def columns_first(matrix: Tensor) -> Tensor:
    """``matrix`` (D, K) as its transpose (K, D), contiguous: each column of ``matrix`` one row."""
    return matrix.mT.contiguous()


def empty_columns_first(n_rows: int, n_cols: int, like: Tensor) -> Tensor:
    """An uninitialised (D, K) tensor stored column by column (its ``.mT`` is contiguous)."""
    return torch.empty(n_cols, n_rows, dtype=like.dtype, device=like.device).mT


def column_sqnorms(matrix: Tensor) -> Tensor:
    """:math:`\\operatorname{diag}(MM^\\top)`, the squared row norms of ``matrix`` (D, K), without a D x K temporary."""
    rows = matrix.mT
    out = torch.zeros(rows.shape[1], dtype=matrix.dtype, device=matrix.device)
    for row in rows:
        out.addcmul_(row, row)
    return out


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


def _weight_block(rows: Tensor, k: int, layer: LayerFactors) -> Tensor:
    """Row k of a (K, D) matrix restricted to ``layer``'s weight, as an ``(out, in)`` matrix."""
    slot = layer.slot
    return rows[k, slot.weight_slice].view(slot.out_features, slot.in_features)


def factor_cross(factors: PerExampleFactors, vectors: Tensor) -> Tensor:
    """:math:`G^\\top V`, shape ``(P, K)``, for ``vectors`` V of shape ``(D, K)``.

    Per layer and vector, :math:`(G^\\top v)_p = \\delta_p^\\top V_l a_p`: one GEMM
    :math:`V_l A^\\top` (out x in x P), then a column-wise dot product with :math:`\\Delta^\\top`.
    """
    rows = columns_first(vectors)  # (K, D), free for a column-major V
    n_vec = rows.shape[0]
    out = torch.zeros(n_vec, factors.n_columns, dtype=factors.dtype, device=factors.device)
    for layer in factors.layers:
        grads_t = layer.output_grads.mT  # (out, P)
        buffer = torch.empty(grads_t.shape, dtype=factors.dtype, device=factors.device)
        for k in range(n_vec):
            torch.mm(_weight_block(rows, k, layer), layer.inputs.mT, out=buffer)
            out[k] += buffer.mul_(grads_t).sum(0)
        if layer.slot.bias_slice is not None:
            out.addmm_(rows[:, layer.slot.bias_slice], grads_t)
    return out.mT


def add_matmul(factors: PerExampleFactors, coeffs: Tensor, out: Tensor, alpha: float = 1.0) -> Tensor:
    """``out += alpha * G @ coeffs`` in place, for ``coeffs`` ``(P, K)`` and ``out`` ``(D, K)``.

    Per layer and column k, :math:`(Gc)_l = \\Delta^\\top\\operatorname{diag}(c)A` (one out x P x in GEMM).
    ``out`` must be stored column by column (see :func:`empty_columns_first`).

    Returns:
        ``out``.
    """
    rows = out.mT
    if not rows.is_contiguous():
        raise ValueError("add_matmul needs an output stored column by column: use empty_columns_first(D, K, like)")
    _add_matmul_rows(factors, coeffs, rows, alpha)
    return out


def _add_matmul_rows(
    factors: PerExampleFactors, coeffs: Tensor, rows: Tensor, alpha: float, sqnorms: Tensor | None = None
) -> None:
    """``rows += alpha * (G coeffs)^T`` for ``rows`` (K, D); with ``sqnorms`` (D,), also add the squared
    entries of the updated weight blocks to it while they are in cache."""
    n_vec = rows.shape[0]
    for layer in factors.layers:
        slot = layer.slot
        buffer = torch.empty(layer.output_grads.shape, dtype=factors.dtype, device=factors.device)
        for k in range(n_vec):
            block = _weight_block(rows, k, layer)
            torch.mul(layer.output_grads, coeffs[:, k : k + 1], out=buffer)
            block.addmm_(buffer.mT, layer.inputs, alpha=alpha)
            if sqnorms is not None:
                sqnorms[slot.weight_slice].view_as(block).addcmul_(block, block)
        if slot.bias_slice is not None:
            rows[:, slot.bias_slice].addmm_(coeffs.mT, layer.output_grads, alpha=alpha)
            if sqnorms is not None:
                sqnorms[slot.bias_slice] += rows[:, slot.bias_slice].square().sum(0)


def sq_diag(factors: PerExampleFactors) -> Tensor:
    """:math:`\\operatorname{diag}(GG^\\top) = \\sum_p g_p \\circ g_p`, shape ``(D,)``."""
    out = torch.empty(factors.n_params, dtype=factors.dtype, device=factors.device)  # every entry is written
    for layer in factors.layers:
        slot = layer.slot
        sq_grads = layer.output_grads.square()
        weight = out[slot.weight_slice].view(slot.out_features, slot.in_features)
        torch.mm(sq_grads.mT, layer.inputs.square(), out=weight)
        if slot.bias_slice is not None:
            torch.sum(sq_grads, 0, out=out[slot.bias_slice])
    return out


def rotate_columns(factor: Tensor, rotation: Tensor, out: Tensor) -> Tensor:
    """``out = factor @ rotation`` for column-major ``factor``, ``out`` (D, L) and ``rotation`` (L, L).

    Done in blocks of rows of D (about 1 MB each), so ``out`` may be ``factor`` itself (in place).
    """
    src, dst = factor.mT, out.mT  # (L, D)
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("rotate_columns needs column-major factor and out: use empty_columns_first")
    n_vec, n_params = src.shape
    if factor.device.type != "cpu":
        return out.copy_(factor @ rotation)
    cols = max(1, _BLOCK_ELEMENTS // max(n_vec, 1))
    buffer = torch.empty(n_vec, min(cols, n_params), dtype=factor.dtype, device=factor.device)
    rotation_t = rotation.mT
    for start in range(0, n_params, cols):
        block = src[:, start : start + cols]
        rotated = torch.mm(rotation_t, block, out=buffer[:, : block.shape[1]])
        dst[:, start : start + cols].copy_(rotated)
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


def canonical_signs(vectors: Tensor) -> Tensor:
    """Eigenvectors ``(..., K, L)`` of :math:`B^\top B` with each column's sign chosen so that its
    entries sum to >= 0.

    An eigenvector's sign is arbitrary (LAPACK picks one), but SLANG's samples
    :math:`d^{1/2}\\epsilon_1 + U\\epsilon_2` depend on the sign of U's columns: with one convention
    the dense path, the Gram path and the stacked update (:mod:`bdl_bench.methods._slang_stacked`)
    draw the same samples from the same noise, so their runs agree up to rounding, on any LAPACK.
    """
    signs = torch.where(vectors.sum(-2, keepdim=True) < 0, -1.0, 1.0).to(vectors.dtype)
    return vectors * signs


def low_rank_update(
    factors: PerExampleFactors,
    prec_factor: Tensor,
    *,
    old_weight: float,
    new_weight: float,
    factor_gram: Tensor | None = None,
    factor_sqnorms: Tensor | None = None,
    path: str = "auto",
    out: Tensor | None = None,
) -> LowRankUpdate:
    """Top-L eigenpairs of :math:`w_0 UU^\\top + w_1 GG^\\top` by the Gram trick (module docstring).

    Args:
        factors: per-example factors defining G (D x P).
        prec_factor: U, shape ``(D, L)`` (fastest stored column by column).
        old_weight: :math:`w_0 \\ge 0` (SLANG: :math:`1-\\beta`).
        new_weight: :math:`w_1 \\ge 0` (SLANG: :math:`\\beta N / (M S)`).
        factor_gram: :math:`U^\\top U` ``(L, L)`` if known (SLANG keeps it: it is the previous
            update's ``diag(eigenvalues)``); computed (O(D L²)) when ``None``.
        factor_sqnorms: :math:`\\operatorname{diag}(UU^\\top)` ``(D,)`` if known; computed when ``None``.
        path: ``"gram"`` (eigendecomposition of the (L+P) x (L+P) matrix :math:`B^\\top B`),
            ``"dense"`` (materialise G and decompose the D x D matrix :math:`BB^\\top`: cheaper when
            D <= L + P, e.g. logistic regression) or ``"auto"`` (the smaller of the two).
        out: a ``(D, L)`` tensor to write :math:`U_{new}` into (column-major on the gram path), or
            ``None`` for a new one. It may be ``prec_factor`` itself: U is then overwritten (rotated in
            place, block by block, before G's part is added), so no second D x L buffer is needed.

    Returns:
        The :class:`LowRankUpdate`.

    Raises:
        FloatingPointError: if :math:`B^\\top B` is not finite (a non-finite or overflowing gradient).
        ValueError: on an unknown ``path`` or a badly shaped ``out``.
    """
    rank = prec_factor.shape[1]
    if path not in ("auto", "gram", "dense"):
        raise ValueError(f"unknown path {path!r}; choose 'auto', 'gram' or 'dense'")
    if out is not None and out.shape != prec_factor.shape:
        raise ValueError(f"out must have shape {tuple(prec_factor.shape)}, got {tuple(out.shape)}")
    if path == "dense" or (path == "auto" and factors.n_params <= rank + factors.n_columns):
        update = _dense_update(factors, prec_factor, old_weight=old_weight, new_weight=new_weight)
        if out is not None:
            out.copy_(update.prec_factor)
            update = replace(update, prec_factor=out)
        return update
    if not prec_factor.mT.is_contiguous():
        prec_factor = columns_first(prec_factor).mT
    target = (
        out if out is not None and out.mT.is_contiguous() else empty_columns_first(*prec_factor.shape, like=prec_factor)
    )
    if factor_gram is None:
        factor_gram = prec_factor.mT @ prec_factor
    if factor_sqnorms is None:
        factor_sqnorms = column_sqnorms(prec_factor)
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
    top = canonical_signs(evecs[:, -rank:].flip(1))  # (L+P, L)
    new_factor = rotate_columns(prec_factor, top[:rank] * old_weight**0.5, target)  # sqrt(w0) U W_U
    new_sqnorms = torch.zeros_like(factor_sqnorms)
    # + sqrt(w1) G W_G, squaring each finished block while it is in cache
    _add_matmul_rows(factors, top[rank:], new_factor.mT, new_weight**0.5, sqnorms=new_sqnorms)
    residual = sq_diag(factors).mul_(new_weight).add_(factor_sqnorms, alpha=old_weight).sub_(new_sqnorms)
    if out is not None and new_factor is not out:
        new_factor = out.copy_(new_factor)
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
    top = evecs[:, -rank:].flip(1)  # (D, L)
    # the sign convention of the Gram path: its coefficients B^T v / sqrt(lambda) sum to >= 0, where
    # B^T v = [sqrt(w0) U^T v; sqrt(w1) G^T v], i.e. (sqrt(w0) U 1 + sqrt(w1) G 1)^T v >= 0
    sums = prec_factor.sum(1) * old_weight**0.5 + grads.sum(1) * new_weight**0.5  # (D,)
    top = top * torch.where(sums @ top < 0, -1.0, 1.0).to(top.dtype)
    new_factor = top * eigenvalues.sqrt()
    new_sqnorms = new_factor.square().sum(1)
    return LowRankUpdate(
        prec_factor=new_factor,
        eigenvalues=eigenvalues,
        factor_sqnorms=new_sqnorms,
        diag_residual=matrix.diagonal() - new_sqnorms,
    )
