r"""Products with the per-example gradient matrix G, layer by layer, and SLANG's top-L update, for R stacked
copies (a single run is R = 1).

G is each copy's D x P matrix of per-example gradients, given by its layer factors
(:class:`bdl_bench.curvature.stacked.StackedFactors`). For a linear layer with inputs A (P x in) and output
gradients :math:`\Delta` (P x out), column p of G restricted to the layer's weight is
:math:`\operatorname{vec}(\delta_p a_p^\top)` and to its bias :math:`\delta_p`. Hence, summing over layers,

* :math:`g_p^\top g_q = \sum_l (a_p\cdot a_q + [\text{bias}])(\delta_p\cdot\delta_q)`
  (:func:`gram_blocks`, O(P² Σ(in+out)));
* :math:`u^\top g_p = \sum_l \delta_p^\top U_l a_p` with u reshaped per layer to
  :math:`U_l` (out x in) (:func:`factor_cross`, O(P D) per vector u);
* :math:`G c = \sum_l \Delta^\top \operatorname{diag}(c) A` (:func:`combine_rows`, O(P D) per vector c);
* :math:`\operatorname{diag}(GG^\top) = (\Delta\circ\Delta)^\top(A\circ A)`
  (:func:`bdl_bench.curvature.stacked.squared_gradient_sum`, O(P D)).

Per vector and layer these are the GEMMs of a training step (out x in x P), so they run at the
speed of backpropagation. A first layer's input shared by the S samples (``first_input_shared``) enters
once per example. The D x K matrices are stored column by column (``empty_columns_first``: each vector
contiguous, rows ``(R, K, D)``), as SLANG stores U; on CPU the passes over D go in blocks of about
512 KB (:data:`_BLOCK_ELEMENTS`, in cache), so no D x P or second D x K tensor is formed.

The Gram trick (Mishkin et al. 2018, Sec. 3, eqs. 5-7, done exactly instead of with a randomised
eigensolver): with :math:`B = [\sqrt{w_0}\,U,\ \sqrt{w_1}\,G]` (D x (L+P)),
:math:`w_0 U U^\top + w_1 G G^\top = B B^\top`, whose nonzero eigenpairs come from the small
(L+P) x (L+P) matrix :math:`B^\top B`: if :math:`B^\top B w = \lambda w` with :math:`\|w\| = 1`, then
:math:`Bw/\sqrt\lambda` is a unit eigenvector of :math:`BB^\top` with eigenvalue :math:`\lambda`.
SLANG's new factor :math:`Q_{1:L}\Lambda_{1:L}^{1/2}` (eq. 7) is therefore :math:`B W_L`, with
:math:`W_L` the top-L unit eigenvectors of :math:`B^\top B`; and its Gram matrix
:math:`(BW_L)^\top BW_L = \Lambda_L` is known without touching D. Cost
O(P D L + D L² + (L+P)³), memory O(D L).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from bdl_bench.curvature.eigen import LowerStored, canonical_signs, top_eigenpairs
from bdl_bench.curvature.per_example import LinearLayout
from bdl_bench.curvature.products import thin_matmul
from bdl_bench.curvature.stacked import StackedFactors, gradient_columns, gradient_sum, squared_gradient_sum

_BLOCK_ELEMENTS = 1 << 17  # entries of a (K, D) matrix handled at a time by blocked passes (~512 KB, in L2)
_HALF_GRAM_COLUMNS = 128  # from this many gradient columns only the lower 3/4 of G^T G is formed


def empty_columns_first(n_copies: int, n_rows: int, n_cols: int, like: Tensor) -> Tensor:
    """An uninitialised ``(R, D, K)`` tensor stored column by column (its ``.mT`` is contiguous)."""
    return torch.empty(n_copies, n_cols, n_rows, dtype=like.dtype, device=like.device).mT


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
    """:math:`\\operatorname{diag}(MM^\\top)` ``(R, D)`` of ``matrix`` ``(R, D, K)``, without a D x K temporary."""
    rows = matrix.mT
    out = torch.zeros(rows.shape[0], rows.shape[2], dtype=matrix.dtype, device=matrix.device)
    for k in range(rows.shape[1]):
        out.addcmul_(rows[:, k], rows[:, k])
    return out


def _gram_products(factor: Tensor, half: int, out: tuple[Tensor, Tensor], *, accumulate: bool = False) -> None:
    """The stored blocks of :math:`FF^\\top` for rows F ``(R, P, k)`` (:func:`gram_blocks`) into ``out``
    (added to it with ``accumulate``)."""
    beta = 1.0 if accumulate else 0.0
    out[0].baddbmm_(factor[:, :half], factor[:, :half].mT, beta=beta)
    if out[1].shape[1] > 0:
        out[1].baddbmm_(factor[:, half:], factor.mT, beta=beta)


def gram_blocks(
    factors: StackedFactors, layout: LinearLayout, half: int, workspace: dict[str, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    r""":math:`G^\top G` of every copy, :math:`\sum_l (AA^\top + [1])\circ(\Delta\Delta^\top)`, as its stored blocks:
    rows ``[0, half)`` against columns ``[0, half)`` ``(R, half, half)`` and rows ``[half, P)`` against all
    ``(R, P - half, P)`` (the block above right of ``half`` is the transpose of the one below left; ``half = P``:
    the whole matrix). With a shared first input, :math:`AA^\top` of that layer is the M x M block
    :math:`XX^\top` tiled S x S (``half`` a multiple of M)."""
    first_grads = factors.output_grads[0]
    n_copies, n_cols = first_grads.shape[:2]
    like = first_grads
    blocks = (
        workspace_buffer(workspace, "gram", (n_copies, half, half), like),
        workspace_buffer(workspace, "gram_rows", (n_copies, n_cols - half, n_cols), like),
    )
    scratch = (
        workspace_buffer(workspace, "gram_outer", blocks[0].shape, like),
        workspace_buffer(workspace, "gram_outer_rows", blocks[1].shape, like),
    )
    for layer, (slot, a, dl) in enumerate(zip(layout.slots, factors.inputs, factors.output_grads)):
        n_rows = a.shape[1]
        if n_rows < n_cols and dl.shape[-1] > 1:  # (A A^T) o (Delta Delta^T) with A A^T the tiled X X^T
            xxt = a @ a.mT
            if slot.bias_slice is not None:
                xxt.add_(1.0)
            targets = blocks if layer == 0 else scratch
            _gram_products(dl, half, targets)
            for target in targets:  # rows and columns start at whole samples: X X^T tiles every block
                target.view(n_copies, -1, n_rows, target.shape[-1] // n_rows, n_rows).mul_(xxt[:, None, :, None, :])
            if layer > 0:
                for block, target in zip(blocks, targets):
                    block += target
            continue
        if n_rows < n_cols:
            a = factors.input_columns(layer)
        if dl.shape[-1] == 1:  # one output: (A A^T) o (d d^T) = (d o A)(d o A)^T, one product
            if slot.bias_slice is not None:
                a = torch.cat([a, torch.ones_like(a[..., :1])], dim=-1)  # the bias's input is 1
            _gram_products(a * dl, half, blocks, accumulate=layer > 0)
            continue
        _gram_products(dl, half, scratch)
        a_blocks = blocks if layer == 0 else (torch.empty_like(blocks[0]), torch.empty_like(blocks[1]))
        _gram_products(a, half, a_blocks)
        for block, a_block, factor in zip(blocks, a_blocks, scratch):
            if slot.bias_slice is not None:
                a_block.add_(1.0)  # the bias's input is 1
            if layer == 0:
                block.mul_(factor)
            else:
                block.addcmul_(a_block, factor)
    return blocks


def factor_cross(
    factors: StackedFactors, layout: LinearLayout, rows: Tensor, workspace: dict[str, Tensor] | None = None
) -> Tensor:
    """:math:`G^\\top V` ``(R, P, K)`` of every copy, for vectors V given as rows ``(R, K, D)``.

    Per layer and vector, :math:`(G^\\top v)_p = \\delta_p^\\top V_l a_p`: a GEMM on the smaller of in and out
    (with a shared first input, on the inputs: once per example), :math:`A V_l^\\top` (or :math:`\\Delta V_l`),
    then a row-wise product with the other factor. A layer whose weights of all copies and vectors fit in a
    block (:data:`_BLOCK_ELEMENTS`; small networks) is one batched GEMM over the copies, its weights packed
    side by side; a larger one is read in place, per copy, in groups of vectors of about 2 MB of products
    on CPU (all at once elsewhere). ``workspace``: scratch buffers reused between calls.
    """
    n_copies, n_vec = rows.shape[:2]
    n_cols = factors.output_grads[0].shape[1]
    out = torch.zeros(n_copies, n_vec, n_cols, dtype=rows.dtype, device=rows.device)
    on_cpu = rows.device.type == "cpu"
    for slot, a, dl in zip(layout.slots, factors.inputs, factors.output_grads):
        n_rows, n_out, n_in = a.shape[1], slot.out_features, slot.in_features
        weights = rows[:, :, slot.weight_slice].unflatten(2, (n_out, n_in))  # (R, K, out, in)
        by_inputs = n_rows < n_cols or n_out <= n_in  # A U_l^T first, then the sum over out with Delta
        left, right = (a, dl) if by_inputs else (dl, a)
        width = right.shape[-1]
        if not on_cpu or n_copies * n_vec * n_out * n_in <= 4 * _BLOCK_ELEMENTS:
            packed = weights.permute(0, 3, 1, 2) if by_inputs else weights.permute(0, 2, 1, 3)  # (R, ., K, width)
            prod = thin_matmul(left, packed.reshape(n_copies, left.shape[-1], -1))  # (R, rows, K width)
            out += _contract(prod.view(n_copies, -1, n_vec, width).transpose(1, 2), right)
        else:
            group = max(1, min(n_vec, 4 * _BLOCK_ELEMENTS // max(n_cols * width, 1)))
            buffer = workspace_buffer(workspace, "cross", (group * left.shape[1] * width,), rows)
            for r in range(n_copies):
                for start in range(0, n_vec, group):
                    block = weights[r, start : start + group]
                    block = block.mT if by_inputs else block  # (g, in, out) or (g, out, in)
                    size = block.shape[0]
                    prod = buffer[: size * left.shape[1] * width].view(size, left.shape[1], width)
                    torch.bmm(left[r].expand(size, *left.shape[1:]), block, out=prod)
                    out[r, start : start + size] += _contract(prod[None], right[r : r + 1])[0]
        if slot.bias_slice is not None:
            out += thin_matmul(dl, rows[:, :, slot.bias_slice].mT).mT
    return out.mT


def _contract(prod: Tensor, right: Tensor) -> Tensor:
    """``(prod * right).sum(-1)`` over the shared width, ``(R, K, P)``, for products ``(R, K, rows, w)`` (consumed)
    and the other factor ``right`` ``(R, P, w)``: rows = P, or M < P for a first input shared by the S samples."""
    n_copies, n_vec, n_rows, width = prod.shape
    if n_rows == right.shape[1]:
        return prod.mul_(right[:, None]).sum(-1)
    samples = right.view(n_copies, 1, -1, n_rows, width)
    return (prod[:, :, None] * samples).sum(-1).view(n_copies, n_vec, -1)


def combine_rows(
    factors: StackedFactors,
    layout: LinearLayout,
    coeffs: Tensor,
    src: Tensor,
    dst: Tensor,
    *,
    alpha: float = 1.0,
    mixing: Tensor | None = None,
    sqnorms: Tensor | None = None,
    workspace: dict[str, Tensor] | None = None,
) -> None:
    """``dst = mixing^T src + alpha (G coeffs)^T`` of every copy, for rows ``src``, ``dst`` ``(R, K, D)`` and
    ``coeffs`` ``(R, P, K)``.

    In column form, :math:`V_{dst} = V_{src} M + \\alpha G C`: with ``mixing`` M = ``None`` (the
    identity) it adds :math:`\\alpha GC` to ``src``; with SLANG's rotation it forms the new factor
    :math:`\\sqrt{w_0}UW_U + \\sqrt{w_1}GW_G` in one pass. Per layer and chunk of weight rows (about
    512 KB for all K vectors on CPU, whole layers elsewhere), :math:`\\alpha C^\\top G^\\top` is one GEMM
    (:math:`[c_k\\circ\\delta_{:,o}]_{k,o}` ((K·rows) x P, summed over the samples of a shared input) times A)
    into a reused buffer, the mixing another (K x K x chunk), and only then is the chunk written to ``dst``:
    so ``dst`` may be ``src`` (updated in place, each chunk read before it is written). With ``sqnorms``
    ``(R, D)``, it is set to :math:`\\operatorname{diag}(V_{dst}V_{dst}^\\top)` while each chunk is in cache.
    """
    n_copies, n_vec = dst.shape[:2]
    n_cols = factors.output_grads[0].shape[1]
    coeffs_t = coeffs.mT.mul(alpha).contiguous()  # (R, K, P), alpha folded in
    mixing_t = None if mixing is None else mixing.mT
    chunk_rows = [
        max(1, min(slot.out_features, _BLOCK_ELEMENTS // max(n_copies * n_vec * slot.in_features, 1)))
        if dst.device.type == "cpu"
        else slot.out_features
        for slot in layout.slots
    ]
    size = max(n * slot.in_features for n, slot in zip(chunk_rows, layout.slots)) * n_copies * n_vec
    scaled_buf = workspace_buffer(workspace, "combine_scaled", (max(chunk_rows) * n_copies * n_vec * n_cols,), dst)
    chunk_buf = workspace_buffer(workspace, "combine_chunk", (size,), dst)
    square_buf = workspace_buffer(workspace, "combine_squares", (size,), dst) if sqnorms is not None else None
    for slot, a, dl, rows_per_chunk in zip(layout.slots, factors.inputs, factors.output_grads, chunk_rows):
        n_in, n_rows = slot.in_features, a.shape[1]
        grads_t = dl.mT.contiguous()  # (R, out, P)
        for first in range(0, slot.out_features, rows_per_chunk):
            n = min(rows_per_chunk, slot.out_features - first)
            scaled = scaled_buf[: n_copies * n_vec * n * n_cols].view(n_copies, n_vec, n, n_cols)
            torch.mul(coeffs_t[:, :, None], grads_t[:, None, first : first + n], out=scaled)  # c_kp delta_po
            scaled = scaled.view(n_copies, n_vec * n, -1, n_rows).sum(2) if n_rows < n_cols else scaled
            chunk = chunk_buf[: n_copies * n_vec * n * n_in].view(n_copies, n_vec * n, n_in)
            torch.bmm(scaled.view(n_copies, n_vec * n, n_rows), a, out=chunk)
            chunk = chunk.view(n_copies, n_vec, n * n_in)
            cols = slice(slot.weight_offset + first * n_in, slot.weight_offset + (first + n) * n_in)
            _mix_into(chunk, src[:, :, cols], mixing_t)
            dst[:, :, cols].copy_(chunk)
            if square_buf is not None and sqnorms is not None:
                squares = torch.mul(chunk, chunk, out=square_buf[: chunk.numel()].view_as(chunk))
                torch.sum(squares, 1, out=sqnorms[:, cols])
        if slot.bias_slice is not None:
            bias = thin_matmul(dl.mT, coeffs_t.mT).mT  # (R, K, out)
            _mix_into(bias, src[:, :, slot.bias_slice], mixing_t)
            dst[:, :, slot.bias_slice].copy_(bias)
            if sqnorms is not None:
                torch.sum(bias.square(), 1, out=sqnorms[:, slot.bias_slice])


def _mix_into(chunk: Tensor, src: Tensor, mixing_t: Tensor | None) -> None:
    """``chunk += mixing_t @ src`` (``src`` itself for ``None``): a broadcast product for K = 1."""
    if mixing_t is None:
        chunk.add_(src)
    elif mixing_t.shape[-1] == 1:
        chunk.addcmul_(src, mixing_t)
    else:
        chunk.baddbmm_(mixing_t, src)


def merge_samples(factors: StackedFactors, layout: LinearLayout) -> StackedFactors | None:
    r"""The same :math:`GG^\top` from M columns instead of S·M, for one linear layer with one output on a
    shared input.

    For logistic regression every column of G is :math:`g_{s,i} = \delta_{s,i}\tilde x_i` with
    :math:`\tilde x_i = [x_i; 1]` the same for all S samples, so
    :math:`GG^\top = \sum_i (\sum_s \delta_{s,i}^2)\,\tilde x_i\tilde x_i^\top`: the factors with inputs
    :math:`x_i` and output gradients :math:`(\sum_s\delta_{s,i}^2)^{1/2}` give the same
    :math:`GG^\top` and :math:`\operatorname{diag}(GG^\top)` (not the same :math:`G\mathbf 1`). Their
    ``losses`` and ``outputs`` are summed over the samples. ``None`` when this does not apply (several
    layers or outputs, an input not shared) or saves nothing (S = 1).
    """
    n_copies, n_samples, n_examples = factors.losses.shape
    if len(layout.slots) != 1 or layout.slots[0].out_features != 1 or not factors.first_input_shared:
        return None
    if n_samples == 1:
        return None
    d = factors.output_grads[0]
    weights = d.view(n_copies, n_samples, n_examples).square().sum(1).sqrt_()  # (R, M)
    return StackedFactors(
        inputs=[factors.inputs[0]],
        output_grads=[weights[..., None]],
        losses=factors.losses.sum(1, keepdim=True),
        outputs=factors.outputs.sum(1, keepdim=True),
        first_input_shared=True,
    )


@dataclass(frozen=True)
class LowRankUpdate:
    """The top-L eigen-update of :math:`w_0 UU^\\top + w_1 GG^\\top` of every copy (Mishkin et al. 2018,
    eqs. 6-7, 10).

    Attributes:
        prec_factor: :math:`U_{new} = Q_{1:L}\\Lambda_{1:L}^{1/2}`, shape ``(R, D, L)``, columns in
            decreasing order of eigenvalue (mutually orthogonal).
        eigenvalues: :math:`\\Lambda_{1:L}` (clamped at 0), shape ``(R, L)``; also
            :math:`U_{new}^\\top U_{new}` = ``diag(eigenvalues)``.
        factor_sqnorms: :math:`\\operatorname{diag}(U_{new}U_{new}^\\top)`, shape ``(R, D)``.
        diag_residual: :math:`\\operatorname{diag}(w_0 UU^\\top + w_1 GG^\\top - U_{new}U_{new}^\\top)`,
            shape ``(R, D)``: SLANG's diagonal correction (eq. 10); nonnegative up to rounding.
    """

    prec_factor: Tensor  # (R, D, L)
    eigenvalues: Tensor  # (R, L)
    factor_sqnorms: Tensor  # (R, D)
    diag_residual: Tensor  # (R, D)


def low_rank_update(
    factors: StackedFactors,
    layout: LinearLayout,
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
    grad_sum: Tensor | None = None,
) -> LowRankUpdate:
    """Top-L eigenpairs of :math:`w_0 UU^\\top + w_1 GG^\\top` of every copy by the Gram trick (module docstring),
    for U ``prec_factor`` ``(R, D, L)`` (fastest column-major) and G given by ``factors``.

    Args:
        factor_gram, factor_sqnorms: :math:`U^\\top U` ``(R, L, L)`` and :math:`\\operatorname{diag}(UU^\\top)`
            ``(R, D)`` if known (SLANG carries them); computed when ``None``.
        path: ``"gram"`` (eigenpairs of the (L+P) x (L+P) matrices :math:`B^\\top B`, from P = 128 columns on
            only their lower blocks: :class:`LowerStored`), ``"dense"`` (the D x D matrices :math:`BB^\\top`,
            with G formed) or ``"auto"`` (the smaller).
        out, sqnorms_out: tensors for :math:`U_{new}` and its squared row norms, or ``None`` for new ones; they
            may be ``prec_factor`` and ``factor_sqnorms`` themselves (each chunk is read before it is written).
        workspace: scratch buffers kept between calls (:func:`workspace_buffer`); the returned
            ``diag_residual`` then lives in it until the next call.
        grad_sum: :math:`G\\mathbf 1` ``(R, D)`` if at hand (needed for merged columns).

    Raises:
        FloatingPointError: if a copy's :math:`B^\\top B` is not finite (a non-finite or overflowing gradient).
        ValueError: on an unknown ``path`` or a badly shaped ``out``.
    """
    n_copies, n_params, rank = prec_factor.shape
    if path not in ("auto", "gram", "dense"):
        raise ValueError(f"unknown path {path!r}; choose 'auto', 'gram' or 'dense'")
    if out is not None and out.shape != prec_factor.shape:
        raise ValueError(f"out must have shape {tuple(prec_factor.shape)}, got {tuple(out.shape)}")
    merged = merge_samples(factors, layout)
    sign_reference = None  # B 1 of the unmerged B: fixes the eigenvectors' signs as canonical_signs does
    if merged is not None:
        grad_sum = gradient_sum(factors, layout) if grad_sum is None else grad_sum
        sign_reference = torch.add(grad_sum * new_weight**0.5, prec_factor.sum(-1), alpha=old_weight**0.5)
        factors = merged
    n_cols = factors.output_grads[0].shape[1]
    if path == "dense" or (path == "auto" and n_params <= rank + n_cols):
        update = _dense_update(factors, layout, prec_factor, old_weight, new_weight, sign_reference)
        if out is not None:
            update = replace(update, prec_factor=out.copy_(update.prec_factor))
        if sqnorms_out is not None:
            update = replace(update, factor_sqnorms=sqnorms_out.copy_(update.factor_sqnorms))
        return update
    rows = prec_factor.mT.contiguous()  # (R, L, D): free for a column-major U
    if factor_gram is None:
        factor_gram = rows @ rows.mT
    if factor_sqnorms is None:
        factor_sqnorms = column_sqnorms(prec_factor)
    # B^T B with B = [sqrt(w0) U, sqrt(w1) G]; from P = 128 columns on only G^T G's first h rows against its
    # first h columns and its last P - h rows against all are formed (h = P / 2, whole samples with a shared
    # first input), and the upper right block of B^T B is never written: the eigensolver multiplies by its
    # transpose (LowerStored)
    n_rows = factors.inputs[0].shape[1] if factors.first_input_shared else 1
    half = n_rows * (n_cols // n_rows // 2) if n_cols >= _HALF_GRAM_COLUMNS else 0
    half = half or n_cols  # one sample on a shared input: whole
    split = rank + half  # B^T B's rows from here on are stored whole, those above it up to column split
    size = rank + n_cols
    btb = workspace_buffer(workspace, "gram_btb", (n_copies, size, size), prec_factor)
    blocks = gram_blocks(factors, layout, half, workspace)
    torch.mul(blocks[0], new_weight, out=btb[:, rank:split, rank:split])
    torch.mul(blocks[1], new_weight, out=btb[:, split:, rank:])
    btb[:, :rank, :rank] = factor_gram * old_weight
    btb[:, rank:, :rank] = factor_cross(factors, layout, rows, workspace).mul_((old_weight * new_weight) ** 0.5)
    btb[:, :rank, rank:split] = btb[:, rank:split, :rank].mT
    matrix = LowerStored(btb, split)
    _check_finite(matrix.stored_sums(), "Gram matrix B^T B")
    # started from B^T B's first L columns: the images of the U block, one power step ahead of it
    eigenvalues, top = top_eigenpairs(matrix, rank, start=btb[:, :, :rank])  # btb is scratch from here on
    eigenvalues = eigenvalues.clamp_min(0.0)
    coefficient_sums = None
    if sign_reference is not None:  # B^T b = [sqrt(w0) U^T b; sqrt(w1) G^T b]
        g_ref = factor_cross(factors, layout, sign_reference[:, None]).mul_(new_weight**0.5)[..., 0]
        u_ref = thin_matmul(rows, sign_reference[..., None])[..., 0].mul_(old_weight**0.5)
        coefficient_sums = torch.cat([u_ref, g_ref], -1)
    top = canonical_signs(top, coefficient_sums)  # (R, L+P, L)
    # diag(w0 U U^T + w1 G G^T) now: factor_sqnorms may be overwritten by the new squared norms below
    residual = workspace_buffer(workspace, "residual", (n_copies, n_params), prec_factor)
    squared_gradient_sum(factors, layout, out=residual).mul_(new_weight).add_(factor_sqnorms, alpha=old_weight)
    new_sqnorms = torch.empty_like(residual) if sqnorms_out is None else sqnorms_out
    target = out if out is not None and out.mT.is_contiguous() else empty_columns_first(*prec_factor.shape, rows)
    combine_rows(  # sqrt(w0) U W_U + sqrt(w1) G W_G in one pass over U (target may be U)
        factors,
        layout,
        top[:, rank:],
        rows,
        target.mT,
        alpha=new_weight**0.5,
        mixing=top[:, :rank] * old_weight**0.5,
        sqnorms=new_sqnorms,
        workspace=workspace,
    )
    residual.sub_(new_sqnorms)
    if out is not None and target is not out:
        target = out.copy_(target)
    return LowRankUpdate(
        prec_factor=target, eigenvalues=eigenvalues, factor_sqnorms=new_sqnorms, diag_residual=residual
    )


def _dense_update(
    factors: StackedFactors,
    layout: LinearLayout,
    prec_factor: Tensor,
    old_weight: float,
    new_weight: float,
    sign_reference: Tensor | None,
) -> LowRankUpdate:
    """The same update through each copy's D x D matrix :math:`w_0UU^\\top + w_1GG^\\top` (for D <= L + P);
    ``sign_reference``: :math:`B\\mathbf 1` when ``factors`` are merged (:func:`merge_samples`)."""
    rank = prec_factor.shape[-1]
    grads = gradient_columns(factors, layout).mT  # (R, D, P)
    matrix = (prec_factor @ prec_factor.mT).mul_(old_weight).baddbmm_(grads, grads.mT, alpha=new_weight)
    _check_finite(matrix.flatten(1).sum(1), "matrix w0 U U^T + w1 G G^T")
    evals, evecs = torch.linalg.eigh(matrix)  # ascending
    eigenvalues = evals[:, -rank:].flip(-1).clamp_min(0.0)
    # the sign convention of the Gram path: its coefficients B^T v / sqrt(lambda) sum to >= 0, where
    # B^T v = [sqrt(w0) U^T v; sqrt(w1) G^T v], i.e. (sqrt(w0) U 1 + sqrt(w1) G 1)^T v >= 0
    sums = sign_reference
    if sums is None:
        sums = prec_factor.sum(-1) * old_weight**0.5 + grads.sum(-1) * new_weight**0.5  # (R, D)
    new_factor = canonical_signs(evecs[:, :, -rank:].flip(-1), sums) * eigenvalues.sqrt()[:, None, :]
    new_sqnorms = new_factor.square().sum(-1)
    return LowRankUpdate(
        prec_factor=new_factor,
        eigenvalues=eigenvalues,
        factor_sqnorms=new_sqnorms,
        diag_residual=matrix.diagonal(dim1=-2, dim2=-1) - new_sqnorms,
    )


def _check_finite(per_copy_sums: Tensor, what: str) -> None:
    """Raise :class:`FloatingPointError` naming ``what`` (and the first bad copy of a stack) if a sum is not
    finite."""
    finite = torch.isfinite(per_copy_sums)
    if not bool(finite.all()):
        where = f" in stacked copy {int((~finite).nonzero()[0, 0])}" if finite.numel() > 1 else ""
        raise FloatingPointError(f"non-finite {what}{where} (non-finite or overflowing per-example gradients)")
