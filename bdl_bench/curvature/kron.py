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

KFAC's factors are GEMMs over the minibatch, never per-example gradients; a stride-1 convolution's A comes
from shifted products of its input map (:mod:`bdl_bench.curvature.conv_gram`). EFB (and DEF) need a second
pass in the fixed eigenbasis, for which a :class:`ChunkCache` keeps pass 1's layer inputs and output
gradients. The per-minibatch work runs in the pseudo-gradients' dtype; sums across minibatches are float64
(:class:`RunningSum`), and so are the results.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bdl_bench.curvature.conv_gram import add_shifted_products_, shifted_gram, uses_shifted_gram
from bdl_bench.curvature.pseudo_grads import KronLayout, KronSlot, LayerPseudoGrads, PseudoGrads, conv_taps
from bdl_bench.progress import delayed_bar


@dataclass(frozen=True)
class KronFactors:
    """KFAC factors of one layer: :math:`\\mathbf I_l \\approx G \\otimes A` (augmented row-major order)."""

    slot: KronSlot
    a_factor: Tensor  # A, (n, n), n = in_features (+1 with a bias)
    g_factor: Tensor  # G, (m, m), m = out_features

    def dense(self) -> Tensor:
        """:math:`G\\otimes A`, ``(m·n, m·n)``."""
        return torch.kron(self.g_factor, self.a_factor)


@dataclass(frozen=True)
class KronEigenbasis:
    """Eigendecompositions of one layer's KFAC factors, eigenvalues descending and clamped at 0."""

    slot: KronSlot
    eigvecs_out: Tensor  # U_G, (m, m)
    eigvecs_in: Tensor  # U_A, (n, n)
    eigvals_out: Tensor  # S_G, (m,)
    eigvals_in: Tensor  # S_A, (n,)


_FOLD_EVERY = 16  # minibatches summed in place in the compute dtype before folding into the float64 total


class RunningSum:
    """A sum over minibatches: terms are added in place in their own dtype (``addmm_``, ``baddbmm_``: no
    temporaries) and folded into a float64 total every ``_FOLD_EVERY`` minibatches, so float32 terms lose
    no accuracy over a whole training set."""

    def __init__(self, shape: tuple[int, ...], like: Tensor) -> None:
        self.partial = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.total = torch.zeros(shape, dtype=torch.float64, device=like.device)
        self._count = 0

    def step(self) -> None:
        """Mark the end of one minibatch's additions to :attr:`partial`."""
        self._count += 1
        if self._count % _FOLD_EVERY == 0 and self.partial.dtype != torch.float64:
            self.total += self.partial
            self.partial.zero_()

    def result(self) -> Tensor:
        """The float64 sum of everything added so far."""
        return self.total + self.partial


def _add_gram_(out: Tensor, rows: Tensor, bias: bool) -> None:
    """``out += [rows, 1]^T [rows, 1]`` (``(n, n)``, n = in (+1 with a bias)) without concatenating the ones."""
    n_in = rows.shape[1]
    out[:n_in, :n_in].addmm_(rows.mT, rows)
    if bias:
        column = rows.sum(0)
        out[:n_in, n_in] += column
        out[n_in, :n_in] += column
        out[n_in, n_in] += rows.shape[0]


class _FactorSums:
    """Running sums of one layer's :math:`\\sum_{i,t}\\tilde a\\tilde a^\\top` and
    :math:`\\frac1T\\sum_{i,k,t}\\delta\\delta^\\top` (the shifted-product form Q, S for a stride-1 conv)."""

    def __init__(self, layer: LayerPseudoGrads) -> None:
        self.slot = layer.slot
        like = layer.output_grads
        m, n = layer.shape
        self.g = RunningSum((m, m), like)
        self.input_shape = layer.layer_input.shape
        self.shifted = uses_shifted_gram(self.slot, self.input_shape)
        if self.shifted:
            spec = self.slot.conv
            assert spec is not None
            (kh, kw), (ph, pw) = spec.kernel_size, spec.padding
            channels, height, width = self.input_shape[1:]
            padded = (height + 2 * ph, width + 2 * pw)
            self.q = RunningSum((kh, *padded, channels, (2 * kw - 1) * channels), like)
            self.s = RunningSum((*padded, channels), like)
            self.totals = (self.g, self.q, self.s)
        else:
            self.a = RunningSum((n, n), like)
            self.totals = (self.g, self.a)

    def add(self, layer: LayerPseudoGrads) -> None:
        deltas = layer.output_grads.reshape(-1, layer.output_grads.shape[-1])
        self.g.partial.addmm_(deltas.mT, deltas, alpha=1.0 / layer.n_positions)
        if self.shifted:
            assert layer.slot.conv is not None
            add_shifted_products_(self.q.partial, self.s.partial, layer.layer_input, layer.slot.conv)
        elif layer.slot.conv is None:
            _add_gram_(self.a.partial, layer.layer_input, layer.slot.bias_slice is not None)
        else:
            patches = layer.inputs.reshape(-1, layer.inputs.shape[-1])
            self.a.partial.addmm_(patches.mT, patches)
        for total in self.totals:
            total.step()

    def a_sum(self, n_rows: int) -> Tensor:
        """:math:`\\sum_{i,t}\\tilde a\\tilde a^\\top` over the ``n_rows`` examples added."""
        if self.shifted:
            return shifted_gram(self.q.result(), self.s.result(), n_rows, self.input_shape[2:], self.slot)
        return self.a.result()


def kron_factors(batches: Iterable[PseudoGrads]) -> tuple[KronFactors, ...]:
    """KFAC factors A and G (float64) of every layer, averaged over all examples of ``batches``."""
    sums: list[_FactorSums] | None = None
    n_total = 0
    for batch in batches:
        if sums is None:
            sums = [_FactorSums(layer) for layer in batch.layers]
        for acc, layer in zip(sums, batch.layers):
            acc.add(layer)
        n_total += batch.n_examples
    if sums is None:
        raise ValueError("kron_factors needs at least one minibatch")
    return tuple(
        KronFactors(acc.slot, _symmetric(acc.a_sum(n_total)) / n_total, _symmetric(acc.g.result()) / n_total)
        for acc in sums
    )


def _symmetric(matrix: Tensor) -> Tensor:
    """:math:`(S + S^\\top)/2`: a float32 GEMM's :math:`X^\\top X` is symmetric only up to rounding."""
    return (matrix + matrix.mT) / 2


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


_WIDTH_MULTIPLE = 16  # EFB rotates pseudo-gradients padded to a width that is a multiple of this (float32 SIMD)


def _padded_width(n: int) -> int:
    return -(-n // _WIDTH_MULTIPLE) * _WIDTH_MULTIPLE


class _EfbSums:
    """One layer's running :math:`\\sum_{i,k}(U_G^\\top g_{ik}U_A)^{\\circ2}` and :math:`\\sum_{i,k}g_{ik}^{\\circ2}`,
    as ``(m, w)`` grids, w = n rounded up to a multiple of ``_WIDTH_MULTIPLE``: the pseudo-gradients get w - n
    zero columns and :math:`U_A` is zero-padded to w x w, so the rotation GEMMs run on aligned widths."""

    def __init__(self, slot: KronSlot, basis: KronEigenbasis, like: Tensor) -> None:
        m, n = slot.shape
        self.slot, self.n, self.width = slot, n, _padded_width(n)
        self.u_out = basis.eigvecs_out.to(like)
        self.u_in = like.new_zeros(self.width, self.width)
        self.u_in[:n, :n] = basis.eigvecs_in
        self.eig = RunningSum((m, self.width), like)
        self.diag = RunningSum((m, self.width), like)
        self._u_in_taps: Tensor | None = None  # U_A's rows in conv_taps' column order (kh, kw·C, w), made once
        self._buffers: dict[str, Tensor] = {}  # flat scratch tensors reused across minibatches

    def add(self, layer: LayerPseudoGrads | Tensor) -> None:
        """Add one minibatch of the layer: its factors, or its pseudo-gradients as :class:`ChunkCache` keeps them.

        A linear layer's :math:`g_{ik} = \\delta_{ik}\\tilde a_i^\\top` is rank 1, so both sums are one GEMM
        of squared projections: :math:`\\sum_i(\\sum_k(U_G^\\top\\delta_{ik})^{\\circ2})((U_A^\\top\\tilde
        a_i)^{\\circ2})^\\top`. A convolution's :math:`g_{ik} = \\sum_t\\delta_{ikt}\\tilde a_{it}^\\top` is
        formed once (:meth:`LayerPseudoGrads.per_example`) and rotated as a stack (:meth:`add_grads`).
        """
        if isinstance(layer, Tensor):
            self.add_grads(layer)
        elif layer.n_positions == 1:
            deltas = layer.output_grads[:, :, 0]  # (K, M, m)
            if layer.slot.conv is None:  # (M, w): [a, 1, 0...], in one copy
                inputs = layer.layer_input.new_zeros(layer.layer_input.shape[0], self.width)
                inputs[:, : layer.slot.in_features] = layer.layer_input
                if layer.slot.bias_slice is not None:
                    inputs[:, layer.slot.in_features] = 1.0
            else:  # a convolution with one output position: its one patch
                inputs = F.pad(layer.inputs[:, 0], (0, self.width - self.n))
            self.eig.partial.addmm_((deltas @ self.u_out).square().sum(0).mT, (inputs @ self.u_in).square())
            self.diag.partial.addmm_(deltas.square().sum(0).mT, inputs.square())
        elif layer.uses_conv_taps:
            self._add_conv_taps(layer)
        else:
            self.add_grads(layer.per_example(self.width))
        self.step()

    def _buffer(self, name: str, numel: int) -> Tensor:
        """A flat scratch tensor of ``numel`` elements, reused (and grown when needed) across minibatches."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[name] = self.eig.partial.new_empty(numel)
        return buffer[:numel]

    def _add_conv_taps(self, layer: LayerPseudoGrads) -> None:
        """A stride-1 convolution (:attr:`LayerPseudoGrads.uses_conv_taps`) from its kernel-row taps
        (:func:`conv_taps`), never permuted into pseudo-gradient matrices.

        :math:`g_{ik}U_A = \\sum_a T_{aik}U_A^{(a)}` over the kernel rows a, with :math:`U_A^{(a)}` the rows of
        :math:`U_A` in the taps' (b, c) column order (permuted once). The kh GEMMs write it transposed,
        ``(w, K·M·m)``, so that :math:`U_G^\\top` applies to all examples as one GEMM; the taps are squared in
        place for the diagonal. Same multiply-adds as :meth:`add_grads`, without the permuting copy.
        """
        slot, x, deltas = layer.slot, layer.layer_input, layer.output_grads
        spec = slot.conv
        assert spec is not None
        kh, kw = spec.kernel_size
        n_draws, n_rows, _, m = deltas.shape
        channels, n_in, width = x.shape[1], slot.in_features, self.width
        rows, cols = n_draws * n_rows * m, kw * channels
        if self._u_in_taps is None:  # rows (c, a, b) of the unfold order -> (a, (b, c))
            self._u_in_taps = (
                self.u_in[:n_in].view(channels, kh, kw, width).permute(1, 2, 0, 3).reshape(kh, cols, width)
            )
        taps = conv_taps(x, deltas, slot, out=self._buffer("taps", kh * rows * cols).view(kh, n_draws, n_rows, m, cols))
        taps = taps.view(kh, rows, cols)
        rotated = self._buffer("rotated", width * rows).view(width, rows)  # (g U_A)^T, columns (k, i, alpha)
        torch.mm(self._u_in_taps[0].mT, taps[0].mT, out=rotated)
        for a in range(1, kh):
            rotated.addmm_(self._u_in_taps[a].mT, taps[a].mT)
        bias_sums = None
        if slot.bias_slice is not None:  # the bias column of g is sum_t delta_t; its row of U_A is row n_in
            bias_sums = deltas.sum(2).reshape(rows)
            rotated.addr_(self.u_in[n_in], bias_sums)
        projected = self._buffer("projected", width * rows).view(width * n_draws * n_rows, m)
        torch.mm(rotated.view(width * n_draws * n_rows, m), self.u_out, out=projected)  # (U_G^T g U_A)^T
        self.eig.partial += projected.square_().view(width, n_draws * n_rows, m).sum(1).mT
        squares = taps.square_().view(kh, n_draws * n_rows, m, kw, channels).sum(1)  # (a, alpha, b, c)
        self.diag.partial[:, :n_in].unflatten(-1, (channels, kh, kw)).add_(squares.permute(1, 3, 0, 2))
        if bias_sums is not None:
            self.diag.partial[:, n_in] += bias_sums.view(-1, m).square().sum(0)

    def add_grads(self, grads: Tensor) -> None:
        """Add a stack of pseudo-gradients ``(K, M, m, w)`` (zero after column n): :math:`U_G^\\top(g\\,U_A)`."""
        grads = grads.flatten(0, 1)
        self.diag.partial += grads.square().sum(0)
        self.eig.partial += (self.u_out.mT @ (grads @ self.u_in)).square_().sum(0)

    def step(self) -> None:
        self.eig.step()
        self.diag.step()

    def results(self) -> tuple[Tensor, Tensor]:
        return self.eig.result()[:, : self.n], self.diag.result()[:, : self.n]


class ChunkCache:
    """Pass 1's minibatches, kept under a memory budget for the EFB pass (Lee et al.'s second pass over the
    data) so that it need not recompute the network's forward and backward passes.

    :meth:`record` passes pass 1's pseudo-gradients through unchanged and keeps, for the leading minibatches
    that fit in ``budget_bytes`` together, each layer's input map and output gradients (a
    :class:`LayerPseudoGrads`) or, where smaller (a first convolution with one input channel), its
    pseudo-gradients ``(K, M, m, w)``. It keeps every minibatch's sampled
    :attr:`labels` too, so that the minibatches beyond the budget are recomputed on the same Fisher sample.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self.labels: list[Tensor | None] = []
        self.n_cached_rows = 0
        self.layout: KronLayout | None = None
        self._chunks: list[tuple[int, tuple[LayerPseudoGrads | Tensor, ...]]] = []
        self._full = budget_bytes == 0

    @property
    def n_cached(self) -> int:
        return len(self._chunks)

    def record(self, batches: Iterable[PseudoGrads]) -> Iterator[PseudoGrads]:
        """Yield ``batches`` unchanged, keeping each after its consumer is done with it (see the class)."""
        for batch in batches:
            yield batch
            self.layout = batch.layout
            self.labels.append(batch.labels)
            if self._full:
                continue
            plans = [_cache_plan(layer) for layer in batch.layers]
            size = sum(nbytes for _, nbytes in plans)
            if self.nbytes + size > self.budget_bytes:
                self._full = True  # keep a prefix only: the rest is recomputed in order
                continue
            layers = tuple(
                layer.per_example(_padded_width(layer.shape[1]))
                if as_grads
                else LayerPseudoGrads(layer.slot, layer.layer_input, layer.output_grads)
                for layer, (as_grads, _) in zip(batch.layers, plans)
            )
            self._chunks.append((batch.n_examples, layers))
            self.nbytes += size
            self.n_cached_rows += batch.n_examples

    def chunks(self) -> Iterator[tuple[int, tuple[LayerPseudoGrads | Tensor, ...]]]:
        """The kept minibatches in order: ``(M, per-layer entries)``."""
        return iter(self._chunks)


def _cache_plan(layer: LayerPseudoGrads) -> tuple[bool, int]:
    """``(as_grads, bytes)``: whether :class:`ChunkCache` keeps the layer's pseudo-gradients rather than its
    input and output gradients, and the bytes that takes."""
    k, m_rows = layer.output_grads.shape[:2]
    size = layer.output_grads.element_size()
    as_maps = (layer.layer_input.numel() + layer.output_grads.numel()) * size
    as_grads = k * m_rows * layer.shape[0] * _padded_width(layer.shape[1]) * size
    return (True, as_grads) if as_grads < as_maps else (False, as_maps)


def efb_eigenvalues(
    batches: Iterable[PseudoGrads],
    bases: tuple[KronEigenbasis, ...],
    *,
    cache: ChunkCache | None = None,
    progress: bool = False,
) -> tuple[tuple[Tensor, ...], Tensor]:
    """EFB eigenvalues in each layer's Kronecker eigenbasis ``bases`` and the exact diagonal, in one pass.

    ``batches`` are the pseudo-gradients of the whole training set, or with ``cache`` (pass 1's minibatches,
    used first) of the minibatches after the ``cache.n_cached`` it kept. Returns ``(eigenvalues, diagonal)``:
    per layer the ``(m, n)`` grid :math:`\\Lambda_{\\beta\\zeta} = \\operatorname{mean}_i\\sum_k((U_G^\\top
    \\delta_{ik})_\\beta(U_A^\\top\\tilde a_i)_\\zeta)^2` (Lee et al., Sec. 2.2) and the exact diagonal ``(D,)``
    in flat order, both from the same pseudo-gradients (so DEF's diagonal correction is exact for them).
    """
    sums: list[_EfbSums] | None = None
    n_total = 0
    layout = None if cache is None else cache.layout
    kept = (
        ()
        if cache is None
        else delayed_bar(cache.chunks(), desc="EFB pass", unit="chunk", enabled=progress, total=cache.n_cached)
    )
    for n_rows, entries in kept:
        if sums is None:
            like = entries[0] if isinstance(entries[0], Tensor) else entries[0].output_grads
            sums = [_EfbSums(b.slot, b, like) for b in bases]
        for acc, entry in zip(sums, entries):
            acc.add(entry)
        n_total += n_rows
    for batch in batches:
        if sums is None:
            sums = [_EfbSums(layer.slot, b, batch.layers[0].output_grads) for layer, b in zip(batch.layers, bases)]
        layout = batch.layout
        for acc, layer in zip(sums, batch.layers):
            acc.add(layer)
        n_total += batch.n_examples
    if sums is None or layout is None:
        raise ValueError("efb_eigenvalues needs at least one minibatch")
    results = [acc.results() for acc in sums]
    flat = torch.zeros(layout.n_params, dtype=torch.float64, device=results[0][0].device)
    for (_, diag), acc in zip(results, sums):
        _grid_to_flat(diag, acc.slot, flat)
    return tuple(eig / n_total for eig, _ in results), flat / n_total


def diagonal(batches: Iterable[PseudoGrads]) -> Tensor:
    """The exact diagonal of the mean curvature, ``(D,)`` in flat order (Lee et al., eq. 5's E[δθ²]); float64."""
    diag: Tensor | None = None
    n_total = 0
    for batch in batches:
        if diag is None:
            diag = torch.zeros(batch.layout.n_params, dtype=torch.float64, device=batch.layers[0].output_grads.device)
        for layer in batch.layers:
            _grid_to_flat(_layer_diag(layer), layer.slot, diag)
        n_total += batch.n_examples
    if diag is None:
        raise ValueError("diagonal needs at least one minibatch")
    return diag / n_total
