r"""SLANG's update for R stacked copies at once (one per data split; :mod:`bdl_bench.orchestration.stacked`).

The same maths as :func:`bdl_bench.methods.slang.slang_update` and
:func:`bdl_bench.curvature.gram.low_rank_update` (Mishkin et al. 2018, Alg. 1 with the exact top-L
step by the Gram trick), written with a leading copy dimension R on every tensor instead of the
single run's blocked, in-place passes over D. Meant for the small networks of SLANG's UCI study
(D ≈ 10³, P = S·M ≈ 40 per-example gradients): there the single run's cost is Python overhead per
step, which one stacked step shares among R splits. As in the single run, no D x P tensor is formed:
every product with the per-example gradient matrix G goes through the layer factors A (inputs) and
:math:`\Delta` (output gradients), :math:`g_p = \operatorname{vec}(\delta_p a_p^\top)` per layer.

Copy r draws exactly the standard normals a single run of the same seed draws (one ``(S, D + L)``
draw, shared by the copies: :func:`bdl_bench.curvature.low_rank.sample_noise` on the stacked
precision), so a stacked fit equals R single runs up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bdl_bench.curvature.gram import canonical_signs, workspace_buffer
from bdl_bench.curvature.low_rank import PrecisionCache, capacitance_cholesky
from bdl_bench.curvature.per_example import LinearLayout
from bdl_bench.curvature.products import t_matmul, thin_matmul
from bdl_bench.curvature.stacked import StackedFactors, assemble_layers, gradient_sum
from bdl_bench.methods.slang import NonFiniteGradientError, SlangState


def merged_columns(factors: StackedFactors, layout: LinearLayout) -> tuple[list[Tensor], list[Tensor]] | None:
    r"""Output gradients and inputs of M columns per copy with the same :math:`GG^\top` as the S·M
    per-example gradients, for one linear layer with one output on a shared input (logistic regression;
    :func:`bdl_bench.curvature.gram.merge_samples` for one run): :math:`(\sum_s\delta_{s,i}^2)^{1/2}` and
    :math:`x_i`. ``None`` when that does not apply."""
    if len(layout.slots) != 1 or layout.slots[0].out_features != 1 or not factors.first_input_shared:
        return None
    d = factors.output_grads[0]
    weights = d.view(d.shape[0], factors.losses.shape[1], -1).square().sum(1).sqrt_()  # (R, M)
    return [weights[..., None]], [factors.inputs[0]]


def _per_layer(matrix: Tensor, layout: LinearLayout) -> list[tuple[Tensor, Tensor | None]]:
    """``matrix`` ``(R, D, K)`` as per-layer (weight ``(R, out, in, K)``, bias ``(R, out, K)``) views."""
    parts = []
    for slot in layout.slots:
        weight = matrix[:, slot.weight_slice].reshape(matrix.shape[0], slot.out_features, slot.in_features, -1)
        bias = None if slot.bias_slice is None else matrix[:, slot.bias_slice]
        parts.append((weight, bias))
    return parts


def stacked_slang_update(
    state: SlangState,
    cache: PrecisionCache,
    factors: StackedFactors,
    layout: LinearLayout,
    *,
    n_data: int,
    prior_precision: Tensor,
    lr: float,
    beta: float,
    momentum: float,
    workspace: dict[str, Tensor] | None = None,
) -> tuple[SlangState, PrecisionCache]:
    """:func:`bdl_bench.methods.slang.slang_update` for every copy (module docstring).

    ``workspace`` keeps the ``(R, L+P, L+P)`` Gram buffer from one step to the next (a fresh one each
    step costs more in page faults than the arithmetic filling it).

    Raises:
        NonFiniteGradientError: if a copy's gradient or Gram matrix is not finite (naming the copy).
    """
    step = state.step + 1
    u = state.prec_factor  # (R, D, L)
    rank = u.shape[-1]
    scale = n_data / factors.losses[0].numel()  # N / (M S)
    grad = gradient_sum(factors, layout)  # G 1, then g_hat = scale * G 1
    _check_finite(grad.sum(1), step, "gradient")
    w0, w1 = 1.0 - beta, beta * scale
    merged = merged_columns(factors, layout)
    sign_reference = None  # B 1 of the unmerged B (gram.canonical_signs), when G's columns are merged
    shared_input = None  # the first layer's input (R, M, in) when it is the same for all S samples
    if merged is None:
        deltas = factors.output_grads
        acts = [factors.input_columns(layer) for layer in range(len(deltas))]
        shared_input = factors.inputs[0] if factors.first_input_shared else None
    else:
        deltas, acts = merged
        sign_reference = grad * w1**0.5 + u.sum(-1) * w0**0.5
    grad.mul_(scale)
    if layout.n_params <= rank + deltas[0].shape[1]:  # e.g. logistic regression: the D x D matrix is the smaller one
        new_u, eigenvalues, residual = _dense_update(u, deltas, acts, layout, w0, w1, step, sign_reference)
    else:
        new_u, eigenvalues, residual = _gram_update(
            u, cache, deltas, acts, layout, w0, w1, step, workspace, sign_reference, shared_input
        )
    new_sqnorms = new_u.square().sum(-1)
    # eq. (9), eq. (11) with momentum and the Woodbury solve (Alg. 2)
    prec_diag = state.prec_diag * (1.0 - beta) + prior_precision * beta + residual.clamp_min(0.0)
    new_momentum = state.momentum * momentum + grad * (1.0 - momentum)
    direction = new_momentum / (1.0 - momentum**step) + prior_precision * state.mean
    inv_diag = prec_diag.reciprocal()
    scaled_u = new_u * inv_diag[..., None]  # (R, D, L)
    capacitance = thin_matmul(new_u.mT, scaled_u)
    proj = thin_matmul(scaled_u.mT, direction[..., None])[..., 0]  # U^T D^{-1} direction, (R, L)
    chol = capacitance_cholesky(capacitance)
    inner = torch.cholesky_solve(proj[..., None], chol)[..., 0]
    mean = state.mean - lr * inv_diag * (direction - thin_matmul(new_u, inner[..., None])[..., 0])
    new_state = SlangState(mean=mean, prec_factor=new_u, prec_diag=prec_diag, momentum=new_momentum, step=step)
    new_cache = PrecisionCache(
        factor_gram=torch.diag_embed(eigenvalues),
        factor_sqnorms=new_sqnorms,
        capacitance=capacitance,
        capacitance_chol=chol,
    )
    return new_state, new_cache


_HALF_GRAM_COLUMNS = 128  # from this many gradient columns only the lower 3/4 of G^T G is formed


def _gram_blocks(
    factor: Tensor,
    half: int,
    out: tuple[Tensor, Tensor] | None,
    *,
    accumulate: bool = False,
) -> tuple[Tensor, Tensor]:
    """The stored blocks of :math:`FF^\\top` for rows F ``(R, P, k)``: rows ``[0, half)`` against columns
    ``[0, half)`` ``(R, half, half)`` and rows ``[half, P)`` against all ``(R, P - half, P)``; written into
    ``out`` (added to it with ``accumulate``), or fresh (``out=None``)."""
    top, rows = factor[:, :half], factor[:, half:]
    if out is None:
        return top @ top.mT, rows @ factor.mT
    beta = 1.0 if accumulate else 0.0
    out[0].baddbmm_(top, top.mT, beta=beta)
    if out[1].shape[1] > 0:
        out[1].baddbmm_(rows, factor.mT, beta=beta)
    return out


def _workspace_blocks(
    workspace: dict[str, Tensor] | None, name: str, like: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """Scratch blocks shaped as ``like`` (:func:`_gram_blocks`' pair), from ``workspace``."""
    return (
        workspace_buffer(workspace, name, like[0].shape, like[0]),
        workspace_buffer(workspace, f"{name}_rows", like[1].shape, like[1]),
    )


@dataclass(frozen=True)
class _LowerStored:
    """Symmetric matrices ``(R, K, K)`` of which ``data`` holds the rows ``[0, split)`` up to column ``split``
    and the rows ``[split, K)`` whole: the block above-right of ``split`` is the transpose of the one below-left,
    and is not stored (``split = K``: all of it is)."""

    data: Tensor
    split: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __matmul__(self, vectors: Tensor) -> Tensor:
        """The product with ``vectors`` ``(R, K, b)``: three batched GEMMs on the stored blocks."""
        s, data = self.split, self.data
        if s == data.shape[-1]:
            return data @ vectors
        # as (V^T A)^T, every block read row by row: V^T A's first s columns from the stored blocks left of the
        # split, the rest as (A_2 V)^T from the whole rows A_2 below it; b x K products of a column-major V (QR's)
        # run faster than K x b ones
        rows = vectors.mT  # (R, b, K)
        left = torch.bmm(rows[:, :, :s], data[:, :s, :s]).add_(torch.bmm(rows[:, :, s:], data[:, s:, :s]))
        return torch.cat([left, torch.bmm(rows, data[:, s:].mT)], dim=2).mT

    def dense(self, copies: Tensor | None = None) -> Tensor:
        """The whole matrices (of the ``copies`` given, else of all), the unstored block filled in."""
        matrix = self.data if copies is None else self.data[copies]
        s = self.split
        if s == matrix.shape[-1]:  # stored whole
            return matrix
        matrix = matrix.clone()
        matrix[:, :s, s:] = matrix[:, s:, :s].mT
        return matrix

    def stored_sums(self) -> Tensor:
        """Each copy's sum over the stored entries ``(R,)`` (finite exactly when the whole matrix is)."""
        s, data = self.split, self.data
        return data[:, :s, :s].sum((1, 2)) + data[:, s:].sum((1, 2))


def _gram_update(
    u: Tensor,
    cache: PrecisionCache,
    deltas: list[Tensor],
    acts: list[Tensor],
    layout: LinearLayout,
    w0: float,
    w1: float,
    step: int,
    workspace: dict[str, Tensor] | None,
    sign_reference: Tensor | None = None,
    shared_input: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The top-L update by the Gram trick (gram.py): ``(U_new, eigenvalues, diag residual)`` of every copy.
    ``sign_reference``: :math:`B\\mathbf 1` ``(R, D)`` of the unmerged B when the columns are merged.
    ``shared_input``: the first layer's input ``(R, M, in)`` when ``acts[0]`` repeats it for each of the S
    samples: its products are then taken once (:math:`AA^\\top` is the M x M block :math:`XX^\\top`
    tiled S x S, and sums over the P = S·M columns against A sum over the samples first)."""
    n_copies, _, rank = u.shape
    n_cols = deltas[0].shape[1]
    has_bias = [slot.bias_slice is not None for slot in layout.slots]
    # B^T B with B = [sqrt(w0) U, sqrt(w1) G] (gram.py's module docstring)
    u_layers = _per_layer(u, layout)
    size = rank + n_cols
    btb = workspace_buffer(workspace, "btb", (n_copies, size, size), u)
    cross = torch.zeros(n_copies, n_cols, rank, dtype=u.dtype, device=u.device)  # U^T g_p as rows
    # G^T G, summed over the layers in contiguous buffers (a product into the strided block of btb would
    # run as one small GEMM per copy), then scaled into btb. G^T G is symmetric: from P = 128 columns on, only
    # its first h rows against the first h columns and its last P - h rows against all columns are formed
    # (h = P / 2, whole samples with a shared first input; 3/4 of the products), and the upper right block of
    # B^T B is never written: the eigensolver multiplies by its transpose (_LowerStored)
    n_rows = shared_input.shape[1] if shared_input is not None else 1
    half = n_rows * (n_cols // n_rows // 2) if n_cols >= _HALF_GRAM_COLUMNS else 0
    half = half or n_cols  # one sample on a shared input: whole
    blocks = (
        workspace_buffer(workspace, "gram", (n_copies, half, half), u),
        workspace_buffer(workspace, "gram_rows", (n_copies, n_cols - half, n_cols), u),
    )
    inputs = list(acts) if shared_input is None else [shared_input, *acts[1:]]  # (R, M, in) or (R, P, in)
    first = True
    for layer, (dl, a, x, (uw, ub)) in enumerate(zip(deltas, acts, inputs, u_layers)):
        cross += _factor_cross(dl, uw, x)
        if ub is not None:
            cross += thin_matmul(dl, ub)
        if layer == 0 and shared_input is not None and dl.shape[-1] > 1:
            # (A A^T) o (Delta Delta^T) with A A^T the tiled X X^T (+ 1: the bias's input)
            xxt = shared_input @ shared_input.mT
            if ub is not None:
                xxt.add_(1.0)
            targets = blocks if first else _workspace_blocks(workspace, "outer", blocks)
            _gram_blocks(dl, half, targets)
            for target in targets:  # rows and columns start at whole samples: X X^T tiles every block
                target.view(n_copies, -1, n_rows, target.shape[-1] // n_rows, n_rows).mul_(xxt[:, None, :, None, :])
            if not first:
                for block, target in zip(blocks, targets):
                    block += target
            first = False
            continue
        if ub is not None:
            a = torch.cat([a, torch.ones_like(a[..., :1])], dim=-1)  # the bias's input is 1
        if dl.shape[-1] == 1:  # one output: (A A^T) o (d d^T) = (d o A)(d o A)^T, one product
            _gram_blocks(a * dl, half, blocks, accumulate=not first)
        else:
            outer = _gram_blocks(dl, half, _workspace_blocks(workspace, "outer", blocks))
            if first:
                for block, factor in zip(_gram_blocks(a, half, blocks), outer):
                    block.mul_(factor)
            else:
                for block, a_block, factor in zip(blocks, _gram_blocks(a, half, None), outer):
                    block.addcmul_(a_block, factor)
        first = False
    split = rank + half  # B^T B's rows from here on are stored whole, those above it up to column split
    torch.mul(blocks[0], w1, out=btb[:, rank:split, rank:split])
    torch.mul(blocks[1], w1, out=btb[:, split:, rank:])
    btb[:, :rank, :rank] = cache.factor_gram * w0
    btb[:, rank:, :rank] = cross * (w0 * w1) ** 0.5
    btb[:, :rank, rank:split] = btb[:, rank:split, :rank].mT
    matrix = _LowerStored(btb, split)
    _check_finite(matrix.stored_sums(), step, "Gram matrix B^T B")
    # started from B^T B's first L columns: the images of the U block, one power step ahead of it (with
    # P = 200, kin8nm's search needs 2 products a step instead of 3)
    eigenvalues, top = top_eigenpairs(matrix, rank, start=btb[:, :, :rank])  # (R, L), (R, L + P, L)
    coefficient_sums = None
    if sign_reference is not None:  # B^T b = [sqrt(w0) U^T b; sqrt(w1) G^T b]
        g_ref = torch.zeros_like(deltas[0][..., 0])  # (R, P)
        for dl, a, (ref_w, ref_b) in zip(deltas, acts, _per_layer(sign_reference[..., None], layout)):
            g_ref += _factor_cross(dl, ref_w, a)[..., 0]
            if ref_b is not None:
                g_ref += thin_matmul(dl, ref_b)[..., 0]
        coefficient_sums = torch.cat(
            [thin_matmul(u.mT, sign_reference[..., None])[..., 0] * w0**0.5, g_ref * w1**0.5], -1
        )
    eigenvalues, top = eigenvalues.clamp_min(0.0), canonical_signs(top, coefficient_sums)
    # U_new = sqrt(w0) U W_U + sqrt(w1) G W_G; diag residual of w0 UU^T + w1 GG^T - U_new U_new^T
    g_top = top[:, rank:] * w1**0.5  # (R, P, L)
    new_u = thin_matmul(u, top[:, :rank]) * w0**0.5
    new_u += assemble_layers(
        layout,
        [
            (_weighted_outer_sum(dl, g_top, a), thin_matmul(dl.mT, g_top) if b else None)
            for dl, a, b in zip(deltas, inputs, has_bias)
        ],
        u,
        (rank,),
    )
    squares = [dl.square() for dl in deltas]
    sq_diag = assemble_layers(
        layout,
        [
            (t_matmul(_sample_sum(sq, a), a.square()), sq.sum(1) if b else None)
            for sq, a, b in zip(squares, inputs, has_bias)
        ],
        u,
        (),
    )
    return new_u, eigenvalues, sq_diag * w1 + cache.factor_sqnorms * w0 - new_u.square().sum(-1)


def _factor_cross(deltas: Tensor, weights: Tensor, inputs: Tensor) -> Tensor:
    r""":math:`u_l^\top g_p = \delta_p^\top U_l a_p` of every copy, ``(R, P, L)``, for ``deltas`` ``(R, P, out)``,
    a layer's weight rows ``weights`` ``(R, out, in, L)`` and ``inputs`` ``(R, P, in)``, or ``(R, M, in)`` shared by
    the S samples (P = S·M, sample-major): one batched GEMM on the smaller of in and out (with a shared input,
    on the inputs: once per example), then a row-wise product with the other (an einsum of the three chose
    an outer product of ``deltas`` and ``inputs`` first, an ``(R, P, out, in)`` temporary). A one-output
    layer's product is a broadcast one (:func:`thin_matmul`)."""
    n_copies, n_cols, n_out = deltas.shape
    n_rows, n_in, rank = inputs.shape[1], weights.shape[2], weights.shape[3]
    if n_rows < n_cols or n_out <= n_in:  # A U_l^T, (R, rows, out, L), then the sum over out with Delta
        prod = thin_matmul(inputs, weights.permute(0, 2, 1, 3).reshape(n_copies, n_in, n_out * rank))
        prod = prod.view(n_copies, 1, n_rows, n_out, rank)
        return (prod * deltas.view(n_copies, -1, n_rows, n_out, 1)).sum(3).view(n_copies, n_cols, rank)
    prod = deltas @ weights.reshape(n_copies, n_out, n_in * rank)  # Delta U_l, (R, P, in, L)
    return (prod.view(n_copies, n_cols, n_in, rank) * inputs[..., None]).sum(2)


def _sample_sum(columns: Tensor, inputs: Tensor) -> Tensor:
    """``columns`` ``(R, P, k)`` summed over the samples (``(R, M, k)``) when ``inputs`` has M < P rows (a first
    layer's input shared by the S samples, P = S·M, sample-major), else ``columns``."""
    n_rows = inputs.shape[1]
    if n_rows == columns.shape[1]:
        return columns
    return columns.view(columns.shape[0], -1, n_rows, columns.shape[-1]).sum(1)


def _weighted_outer_sum(deltas: Tensor, coeffs: Tensor, inputs: Tensor) -> Tensor:
    """:math:`\\sum_p c_{pl}\\,\\delta_p a_p^\\top` of every copy as ``(R, out, in, L)`` (a layer's rows of
    :math:`GC`), for ``coeffs`` ``(R, P, L)``: one batched GEMM of :math:`[\\delta_{po}c_{pl}]` with A (``inputs``
    ``(R, P, in)``, or ``(R, M, in)`` shared by the S samples: the left factor summed over them first)."""
    n_copies, n_cols, n_out = deltas.shape
    rank = coeffs.shape[-1]
    left = (deltas[..., :, None] * coeffs[..., None, :]).view(n_copies, n_cols, n_out * rank)
    return t_matmul(_sample_sum(left, inputs), inputs).reshape(n_copies, n_out, rank, -1).transpose(2, 3)


def _dense_update(
    u: Tensor,
    deltas: list[Tensor],
    acts: list[Tensor],
    layout: LinearLayout,
    w0: float,
    w1: float,
    step: int,
    sign_reference: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The same update through each copy's D x D matrix :math:`w_0UU^\\top + w_1GG^\\top` (for D <= L + P),
    with G materialised and the Gram path's sign convention (as ``gram._dense_update`` for one run)."""
    rank = u.shape[-1]
    n_cols = deltas[0].shape[1]
    has_bias = [slot.bias_slice is not None for slot in layout.slots]
    grads = assemble_layers(  # (R, D, P): per-example gradient p of layer l is delta_p a_p^T (and delta_p)
        layout,
        [(torch.einsum("rpo,rpi->roip", dl, a), dl.mT if b else None) for dl, a, b in zip(deltas, acts, has_bias)],
        u,
        (n_cols,),
    )
    matrix = (u @ u.mT).mul_(w0).baddbmm_(grads, grads.mT, alpha=w1)
    _check_finite(matrix.flatten(1).sum(1), step, "matrix w0 U U^T + w1 G G^T")
    evals, evecs = torch.linalg.eigh(matrix)  # ascending
    eigenvalues = evals[:, -rank:].flip(-1).clamp_min(0.0)
    top = evecs[:, :, -rank:].flip(-1)  # (R, D, L)
    sums = sign_reference  # (R, D): B 1, whose projections the Gram path makes >= 0
    if sums is None:
        sums = u.sum(-1) * w0**0.5 + grads.sum(-1) * w1**0.5
    top = canonical_signs(top, sums)
    new_u = top * eigenvalues.sqrt()[:, None, :]
    return new_u, eigenvalues, matrix.diagonal(dim1=-2, dim2=-1) - new_u.square().sum(-1)


_OVERSAMPLING = 4  # extra vectors in the subspace iteration of top_eigenpairs
_MAX_ITERATIONS = 60


def top_eigenpairs(
    matrix: Tensor | _LowerStored, rank: int, *, tol: float | None = None, start: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""The top-``rank`` eigenpairs of symmetric PSD matrices ``(R, K, K)`` (whole, or their lower part:
    :class:`_LowerStored`), largest first: eigenvalues ``(R, L)`` and unit eigenvectors ``(R, K, L)``.

    Block subspace iteration with Rayleigh-Ritz (Saad, *Numerical Methods for Large Eigenvalue
    Problems*, Alg. 5.2) on ``rank + 4`` vectors, started from ``start`` ``(R, K, L)`` (default: the first
    ``rank`` coordinates, SLANG's U block, whose directions change little from step to step; a copy's
    all-zero start falls back to them) and fixed pseudo-random vectors, run
    until every copy's residual :math:`\|AV - V\Theta\|_F` is below ``tol`` times its largest
    eigenvalue (default: 100 machine epsilons, the accuracy of ``torch.linalg.eigh`` itself).
    Copies not converged after 60 iterations (nearly equal eigenvalues at the L-th place) are
    decomposed by ``torch.linalg.eigh``. For K = L + P in the hundreds (UCI batches of 100 with 2 MC
    samples) this is much cheaper than a full ``eigh`` of every copy.
    """
    if not isinstance(matrix, _LowerStored):
        matrix = _LowerStored(matrix, matrix.shape[-1])
    n_copies, size, _ = matrix.shape
    like = matrix.data
    if size <= rank + _OVERSAMPLING:
        evals, evecs = torch.linalg.eigh(matrix.dense())
        return evals[:, -rank:].flip(-1), evecs[:, :, -rank:].flip(-1)
    tol = 100 * torch.finfo(like.dtype).eps if tol is None else tol
    block = rank + _OVERSAMPLING
    noise = torch.randn(size, block, generator=torch.Generator().manual_seed(0), dtype=like.dtype).to(like.device)
    vectors = noise.expand(n_copies, size, block).clone()
    vectors[..., :rank] += 10.0 * torch.eye(size, rank, dtype=like.dtype, device=like.device)
    if start is not None:  # the given directions exactly (a copy's all-zero start keeps the coordinates)
        norms = start.norm(dim=1, keepdim=True)
        vectors[..., :rank] = torch.where(
            norms > 0, start / norms.clamp_min(torch.finfo(start.dtype).tiny), vectors[..., :rank]
        )
    basis = torch.linalg.qr(vectors).Q
    for _ in range(_MAX_ITERATIONS):
        image = matrix @ basis  # one product per iteration: A Q serves the Ritz step and the next basis
        ritz_values, ritz_vectors = torch.linalg.eigh(basis.mT @ image)  # ascending, (R, b)
        values = ritz_values[:, -rank:].flip(-1)
        top = ritz_vectors[:, :, -rank:].flip(-1)
        vectors = thin_matmul(basis, top)
        residual = (thin_matmul(image, top) - vectors * values[:, None, :]).norm(dim=(1, 2))
        done = residual <= tol * values[:, 0].abs().clamp_min(torch.finfo(like.dtype).tiny)
        if bool(done.all()):
            return values, vectors
        basis = torch.linalg.qr(image).Q
    stuck = (~done).nonzero()[:, 0]
    evals, evecs = torch.linalg.eigh(matrix.dense(stuck))
    values, vectors = values.clone(), vectors.clone()
    values[stuck], vectors[stuck] = evals[:, -rank:].flip(-1), evecs[:, :, -rank:].flip(-1)
    return values, vectors


def stacked_cache(state: SlangState) -> PrecisionCache:
    """:func:`bdl_bench.curvature.low_rank.build_cache` for every copy of a stacked state."""
    u, d = state.prec_factor, state.prec_diag
    capacitance = thin_matmul(u.mT, u / d[..., None])
    return PrecisionCache(
        factor_gram=thin_matmul(u.mT, u),
        factor_sqnorms=u.square().sum(-1),
        capacitance=capacitance,
        capacitance_chol=capacitance_cholesky(capacitance),
    )


def _check_finite(per_copy_sums: Tensor, step: int, what: str) -> None:
    finite = torch.isfinite(per_copy_sums)
    if not bool(finite.all()):
        bad = int((~finite).nonzero()[0, 0])
        raise NonFiniteGradientError(f"method 'slang': non-finite {what} at step {step} in stacked copy {bad}")
