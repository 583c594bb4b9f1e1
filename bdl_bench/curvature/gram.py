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
from scipy.linalg import get_lapack_funcs
from torch import Tensor

from bdl_bench.curvature.per_example import LayerFactors, PerExampleFactors

_BLOCK_ELEMENTS = 1 << 17  # entries of a (K, D) matrix handled at a time by blocked passes (~512 KB, in L2)


def columns_first(matrix: Tensor) -> Tensor:
    """``matrix`` (D, K) as its transpose (K, D), contiguous: each column of ``matrix`` one row."""
    return matrix.mT.contiguous()


def empty_columns_first(n_rows: int, n_cols: int, like: Tensor) -> Tensor:
    """An uninitialised (D, K) tensor stored column by column (its ``.mT`` is contiguous)."""
    return torch.empty(n_cols, n_rows, dtype=like.dtype, device=like.device).mT


def workspace_buffer(workspace: dict[str, Tensor] | None, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised contiguous tensor of ``shape`` for scratch use, taken from ``workspace[name]``.

    A training loop that passes the same dict at every step reuses the buffers (grown when too small)
    instead of allocating fresh ones: on CPU every new large tensor is fresh memory from the OS, whose
    first touch costs a page fault per 4 KB, comparable to the arithmetic
    of a D-sized pass. With ``workspace=None`` a new tensor is returned.
    """
    if workspace is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    strides, numel = [], 1
    for size in reversed(shape):
        strides.append(numel)
        numel *= size
    buffer = workspace.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
        buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        workspace[name] = buffer
    return buffer.as_strided(shape, strides[::-1])  # the first numel entries, contiguous


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


def _layer_weights(rows: Tensor, layer: LayerFactors) -> Tensor:
    """Rows of a (K, D) matrix restricted to ``layer``'s weight, as ``(K, out, in)`` (a view)."""
    slot = layer.slot
    return rows[:, slot.weight_slice].unflatten(1, (slot.out_features, slot.in_features))


def factor_cross(factors: PerExampleFactors, vectors: Tensor, workspace: dict[str, Tensor] | None = None) -> Tensor:
    """:math:`G^\\top V`, shape ``(P, K)``, for ``vectors`` V of shape ``(D, K)``.

    Per layer and vector, :math:`(G^\\top v)_p = \\delta_p^\\top V_l a_p`: one batched GEMM
    :math:`A V_l^\\top` (P x in x out per vector; or :math:`\\Delta V_l` when out > in) over the K
    vectors, read in place from a column-major V, then a row-wise dot product with :math:`\\Delta`
    (with A). ``workspace``: scratch buffers reused between calls (:func:`workspace_buffer`).
    """
    rows = columns_first(vectors)  # (K, D), free for a column-major V
    n_vec, n_cols = rows.shape[0], factors.n_columns
    out = torch.zeros(n_vec, n_cols, dtype=factors.dtype, device=factors.device)
    if n_vec == 0:
        return out.mT
    width = max(min(layer.slot.out_features, layer.slot.in_features) for layer in factors.layers)
    group = n_vec  # vectors per batched GEMM: all at once on an accelerator, about 2 MB of output on CPU
    if rows.device.type == "cpu":
        group = max(1, min(n_vec, 4 * _BLOCK_ELEMENTS // max(n_cols * width, 1)))
    buffer = workspace_buffer(workspace, "cross", (group * n_cols * width,), rows)
    for layer in factors.layers:
        slot = layer.slot
        weights = _layer_weights(rows, layer)  # (K, out, in)
        # (G^T v)_p = sum_o delta_po (A V^T)_po = sum_i a_pi (Delta V)_pi: contract the larger side first
        by_outputs = slot.out_features <= slot.in_features
        left, right = (layer.inputs, layer.output_grads) if by_outputs else (layer.output_grads, layer.inputs)
        for start in range(0, n_vec, group):
            block = weights[start : start + group]
            block = block.mT if by_outputs else block  # (g, in, out) or (g, out, in)
            prod = buffer[: block.shape[0] * n_cols * block.shape[2]].view(block.shape[0], n_cols, block.shape[2])
            torch.bmm(left.expand(block.shape[0], *left.shape), block, out=prod)
            out[start : start + group] += prod.mul_(right).sum(-1)
        if slot.bias_slice is not None:
            out.addmm_(rows[:, slot.bias_slice], layer.output_grads.mT)
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
    combine_rows(factors, coeffs, rows, rows, alpha=alpha)
    return out


def combine_rows(
    factors: PerExampleFactors,
    coeffs: Tensor,
    src: Tensor,
    dst: Tensor,
    *,
    alpha: float = 1.0,
    mixing: Tensor | None = None,
    sqnorms: Tensor | None = None,
    workspace: dict[str, Tensor] | None = None,
) -> None:
    """``dst = mixing^T src + alpha (G coeffs)^T`` for rows ``src``, ``dst`` ``(K, D)`` and ``coeffs`` ``(P, K)``.

    In column form, :math:`V_{dst} = V_{src} M + \\alpha G C`: with ``mixing`` M = ``None`` (the
    identity) it adds :math:`\\alpha GC` to ``src``; with SLANG's rotation it forms the new factor
    :math:`\\sqrt{w_0}UW_U + \\sqrt{w_1}GW_G` in one pass. Per layer and chunk of weight rows (about
    512 KB for all K vectors on CPU), :math:`\\alpha C^\\top G^\\top` is one GEMM
    (:math:`[c_k\\circ\\delta_{:,o}]_{k,o}` ((K·rows) x P) times A (P x in)) into a reused buffer,
    the mixing another (K x K x chunk), and only then is the chunk written to ``dst``: so ``dst`` may
    be ``src`` (updated in place, each chunk read before it is written). With ``sqnorms`` ``(D,)``,
    it is set to the column sums of squares of ``dst`` (:math:`\\operatorname{diag}(V_{dst}V_{dst}^\\top)`)
    while each chunk is in cache. ``workspace``: scratch buffers reused between calls
    (:func:`workspace_buffer`).
    """
    n_vec = dst.shape[0]
    coeffs_t = coeffs.mT.mul(alpha).contiguous()  # (K, P), alpha folded in
    mixing_t = None if mixing is None else mixing.mT
    n_cols = factors.n_columns
    # weight rows per chunk: about 512 KB for all K vectors on CPU (in L2), whole layers on an accelerator
    chunk_rows = [
        max(1, min(layer.slot.out_features, _BLOCK_ELEMENTS // max(n_vec * layer.slot.in_features, 1)))
        if dst.device.type == "cpu"
        else layer.slot.out_features
        for layer in factors.layers
    ]
    scaled_size = max(n_vec * r * n_cols for r in chunk_rows)
    chunk_size = max(n_vec * r * layer.slot.in_features for r, layer in zip(chunk_rows, factors.layers))
    scaled_buf = workspace_buffer(workspace, "combine_scaled", (scaled_size,), dst)
    chunk_buf = workspace_buffer(workspace, "combine_chunk", (chunk_size,), dst)
    square_buf = None if sqnorms is None else workspace_buffer(workspace, "combine_squares", (chunk_size,), dst)
    for layer, rows_per_chunk in zip(factors.layers, chunk_rows):
        slot = layer.slot
        n_in = slot.in_features
        grads_t = layer.output_grads.mT.contiguous()  # (out, P)
        for first in range(0, slot.out_features, rows_per_chunk):
            n_rows = min(rows_per_chunk, slot.out_features - first)
            scaled = scaled_buf[: n_vec * n_rows * n_cols].view(n_vec, n_rows, n_cols)
            torch.mul(coeffs_t[:, None, :], grads_t[None, first : first + n_rows], out=scaled)  # c_kp delta_po
            chunk = chunk_buf[: n_vec * n_rows * n_in].view(n_vec * n_rows, n_in)
            torch.mm(scaled.view(n_vec * n_rows, n_cols), layer.inputs, out=chunk)
            chunk = chunk.view(n_vec, n_rows * n_in)
            cols = slice(slot.weight_offset + first * n_in, slot.weight_offset + (first + n_rows) * n_in)
            if mixing_t is None:
                chunk.add_(src[:, cols])
            else:
                chunk.addmm_(mixing_t, src[:, cols])
            dst[:, cols].copy_(chunk)
            if sqnorms is not None and square_buf is not None:
                squares = torch.mul(chunk, chunk, out=square_buf[: chunk.numel()].view_as(chunk))
                torch.sum(squares, 0, out=sqnorms[cols])
        if slot.bias_slice is not None:
            bias = torch.mm(coeffs_t, layer.output_grads)  # (K, out)
            if mixing_t is None:
                bias.add_(src[:, slot.bias_slice])
            else:
                bias.addmm_(mixing_t, src[:, slot.bias_slice])
            dst[:, slot.bias_slice].copy_(bias)
            if sqnorms is not None:
                torch.sum(bias.square(), 0, out=sqnorms[slot.bias_slice])


def sq_diag(factors: PerExampleFactors, out: Tensor | None = None) -> Tensor:
    """:math:`\\operatorname{diag}(GG^\\top) = \\sum_p g_p \\circ g_p`, shape ``(D,)`` (into ``out`` if given)."""
    if out is None:
        out = torch.empty(factors.n_params, dtype=factors.dtype, device=factors.device)  # every entry is written
    for layer in factors.layers:
        slot = layer.slot
        sq_grads = layer.output_grads.square()
        weight = out[slot.weight_slice].view(slot.out_features, slot.in_features)
        torch.mm(sq_grads.mT, layer.inputs.square(), out=weight)
        if slot.bias_slice is not None:
            torch.sum(sq_grads, 0, out=out[slot.bias_slice])
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


def merge_samples(factors: PerExampleFactors) -> PerExampleFactors | None:
    r"""The same :math:`GG^\top` from M columns instead of S·M, for one linear layer with one output.

    For logistic regression every column of G is :math:`g_{s,i} = \delta_{s,i}\tilde x_i` with
    :math:`\tilde x_i = [x_i; 1]` the same for all S samples, so
    :math:`GG^\top = \sum_i (\sum_s \delta_{s,i}^2)\,\tilde x_i\tilde x_i^\top`: the factors with inputs
    :math:`x_i` and output gradients :math:`(\sum_s\delta_{s,i}^2)^{1/2}` give the same
    :math:`GG^\top` and :math:`\operatorname{diag}(GG^\top)` (not the same :math:`G\mathbf 1`). Their
    ``losses`` and ``outputs`` are summed over the samples. ``None`` when this does not apply (several
    layers or outputs) or saves nothing (S = 1).
    """
    n_samples, n_examples = factors.losses.shape
    if len(factors.layers) != 1 or factors.layers[0].slot.out_features != 1 or n_samples == 1:
        return None
    (layer,) = factors.layers
    weights = layer.output_grads.view(n_samples, n_examples).square().sum(0).sqrt_()
    return PerExampleFactors(
        layers=(LayerFactors(slot=layer.slot, inputs=layer.inputs[:n_examples], output_grads=weights[:, None]),),
        n_params=factors.n_params,
        losses=factors.losses.sum(0, keepdim=True),
        outputs=factors.outputs.sum(0, keepdim=True),
    )


def canonical_signs(vectors: Tensor, sums: Tensor | None = None) -> Tensor:
    r"""Eigenvectors ``(..., K, L)`` of :math:`B^\top B` with each column's sign chosen so that its
    entries sum to >= 0.

    An eigenvector's sign is arbitrary (LAPACK picks one), but SLANG's samples
    :math:`d^{1/2}\epsilon_1 + U\epsilon_2` depend on the sign of U's columns: with one convention
    the dense path, the Gram path and the stacked update (:mod:`bdl_bench.methods._slang_stacked`)
    draw the same samples from the same noise, so their runs agree up to rounding, on any LAPACK.
    In terms of :math:`v = Bw/\sqrt\lambda`, the rule is :math:`(B\mathbf 1)^\top v \ge 0`; a B with
    merged columns (:func:`merge_samples`) keeps it by passing ``sums`` = :math:`B^\top b` ``(..., K)``
    for :math:`b = B_{\text{unmerged}}\mathbf 1`: each column's sign then makes ``sums @ column`` >= 0.
    The D x D paths pass eigenvectors v of :math:`BB^\top` with ``sums`` = b itself (the same rule).
    """
    if sums is None:
        signs = torch.where(vectors.sum(-2, keepdim=True) < 0, -1.0, 1.0).to(vectors.dtype)
    else:
        signs = torch.where((sums.unsqueeze(-2) @ vectors) < 0, -1.0, 1.0).to(vectors.dtype)
    return vectors * signs


def top_eigenpairs(matrix: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest eigenvalues of a symmetric ``matrix`` ``(n, n)``, in decreasing order ``(k,)``, and their
    unit eigenvectors as columns ``(n, k)``; ``matrix`` may be overwritten (it is scratch to the caller).

    On the host, LAPACK's ``?syevr`` (SciPy's) computes only these k pairs (MRRR after the tridiagonal
    reduction), cheaper than ``torch.linalg.eigh``, which computes all n. Elsewhere (CUDA), ``torch.linalg.eigh``.
    """
    n = matrix.shape[-1]
    if matrix.device.type != "cpu" or matrix.dtype not in (torch.float32, torch.float64) or not 0 < k <= n:
        evals, evecs = torch.linalg.eigh(matrix)  # ascending
        return evals[-k:].flip(0), evecs[:, -k:].flip(1)
    if not matrix.is_contiguous():
        matrix = matrix.contiguous()
    array = matrix.numpy().T  # Fortran order, no copy (the matrix is symmetric)
    (syevr,) = get_lapack_funcs(("syevr",), (array,))
    values, vectors, found, _, info = syevr(array, compute_v=1, range="I", il=n - k + 1, iu=n, overwrite_a=1)
    if info != 0 or found != k:
        raise FloatingPointError(f"LAPACK ?syevr failed (info={info}, {found} of {k} eigenpairs)")
    return torch.from_numpy(values[:k][::-1].copy()), torch.from_numpy(vectors[:, ::-1].copy())


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
    sqnorms_out: Tensor | None = None,
    workspace: dict[str, Tensor] | None = None,
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
            ``None`` for a new one. It may be ``prec_factor`` itself: U is then overwritten in place,
            chunk by chunk (each chunk of U is read before it is written), so no second D x L buffer
            is needed.
        sqnorms_out: a ``(D,)`` tensor for :math:`\\operatorname{diag}(U_{new}U_{new}^\\top)`, or
            ``None`` for a new one; it may be ``factor_sqnorms`` itself (read before it is written).
        workspace: scratch buffers kept by the caller between calls (a training loop's dict;
            :func:`workspace_buffer`). The returned ``diag_residual`` then lives in it: valid until
            the next call with the same workspace.

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
    merged = merge_samples(factors)
    sign_reference = None  # B 1 of the unmerged B: fixes the eigenvectors' signs as canonical_signs does
    if merged is not None:
        sign_reference = factors.grad_sum().mul_(new_weight**0.5).add_(prec_factor.sum(1), alpha=old_weight**0.5)
        factors = merged
    if path == "dense" or (path == "auto" and factors.n_params <= rank + factors.n_columns):
        update = _dense_update(
            factors, prec_factor, old_weight=old_weight, new_weight=new_weight, sign_reference=sign_reference
        )
        if out is not None:
            out.copy_(update.prec_factor)
            update = replace(update, prec_factor=out)
        if sqnorms_out is not None:
            update = replace(update, factor_sqnorms=sqnorms_out.copy_(update.factor_sqnorms))
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
    btb = workspace_buffer(workspace, "gram_btb", (rank + n_cols, rank + n_cols), prec_factor)
    btb[:rank, :rank] = factor_gram * old_weight
    cross = factor_cross(factors, prec_factor, workspace).mul_((old_weight * new_weight) ** 0.5)  # (P, L)
    btb[rank:, :rank] = cross
    btb[:rank, rank:] = cross.mT
    btb[rank:, rank:] = gram_matrix(factors).mul_(new_weight)
    if not bool(torch.isfinite(btb).all()):
        raise FloatingPointError("non-finite Gram matrix B^T B (non-finite or overflowing per-example gradients)")
    eigenvalues, top_vectors = top_eigenpairs(btb, rank)  # btb is scratch from here on
    eigenvalues = eigenvalues.clamp_min(0.0)
    coefficient_sums = None
    if sign_reference is not None:  # B^T b = [sqrt(w0) U^T b; sqrt(w1) G^T b]
        coefficient_sums = torch.cat(
            [
                (prec_factor.mT @ sign_reference).mul_(old_weight**0.5),
                factor_cross(factors, sign_reference[:, None])[:, 0].mul_(new_weight**0.5),
            ]
        )
    top = canonical_signs(top_vectors, coefficient_sums)  # (L+P, L)
    # diag(w0 U U^T + w1 G G^T) now: factor_sqnorms may be overwritten by the new squared norms below
    residual = sq_diag(factors, out=workspace_buffer(workspace, "residual", (factors.n_params,), prec_factor))
    residual.mul_(new_weight).add_(factor_sqnorms, alpha=old_weight)
    new_sqnorms = torch.empty_like(factor_sqnorms) if sqnorms_out is None else sqnorms_out
    # sqrt(w0) U W_U + sqrt(w1) G W_G in one pass over U (target may be U), squaring each finished chunk
    new_factor = target
    combine_rows(
        factors,
        top[rank:],
        prec_factor.mT,
        new_factor.mT,
        alpha=new_weight**0.5,
        mixing=top[:rank] * old_weight**0.5,
        sqnorms=new_sqnorms,
        workspace=workspace,
    )
    residual.sub_(new_sqnorms)
    if out is not None and new_factor is not out:
        new_factor = out.copy_(new_factor)
    return LowRankUpdate(
        prec_factor=new_factor, eigenvalues=eigenvalues, factor_sqnorms=new_sqnorms, diag_residual=residual
    )


def _dense_update(
    factors: PerExampleFactors,
    prec_factor: Tensor,
    *,
    old_weight: float,
    new_weight: float,
    sign_reference: Tensor | None = None,
) -> LowRankUpdate:
    """The same update through the D x D matrix :math:`w_0UU^\\top + w_1GG^\\top` (for D <= L + P);
    ``sign_reference``: :math:`B\\mathbf 1` when ``factors`` are merged (:func:`merge_samples`)."""
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
    sums = sign_reference
    if sums is None:
        sums = prec_factor.sum(1) * old_weight**0.5 + grads.sum(1) * new_weight**0.5  # (D,)
    top = canonical_signs(top, sums)
    new_factor = top * eigenvalues.sqrt()
    new_sqnorms = new_factor.square().sum(1)
    return LowRankUpdate(
        prec_factor=new_factor,
        eigenvalues=eigenvalues,
        factor_sqnorms=new_sqnorms,
        diag_residual=matrix.diagonal() - new_sqnorms,
    )
