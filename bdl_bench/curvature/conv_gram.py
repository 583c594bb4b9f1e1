r"""The input factor A of a stride-1 convolution from shifted products of its input map (KFC, Grosse & Martens
2016): the Gram matrix of the unfolded patches without unfolding them, fewer multiply-adds than the patch GEMM
where the layer has enough input channels (:func:`uses_shifted_gram`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bdl_bench.curvature.pseudo_grads import ConvSpec, KronSlot

MIN_SHIFTED_CHANNELS = 8  # input channels from which the shifted-product conv Gram is used


def uses_shifted_gram(slot: KronSlot, input_shape: torch.Size) -> bool:
    """Whether :func:`add_shifted_products_` is cheaper than the patch GEMM (stride-1, undilated convs only;
    with fewer than ``MIN_SHIFTED_CHANNELS`` input channels its GEMMs are too thin to pay off)."""
    spec = slot.conv
    if spec is None or spec.stride != (1, 1) or spec.dilation != (1, 1):
        return False
    channels, height, width = input_shape[1:]
    if channels < MIN_SHIFTED_CHANNELS:
        return False
    (kh, kw), (ph, pw) = spec.kernel_size, spec.padding
    padded = (height + 2 * ph) * (width + 2 * pw)
    positions = (height + 2 * ph - kh + 1) * (width + 2 * pw - kw + 1)
    return padded * kh * (2 * kw - 1) * channels**2 < positions * slot.in_features**2


def add_shifted_products_(products: Tensor, sums: Tensor, x: Tensor, spec: ConvSpec) -> None:
    """Accumulate :math:`Q_{d,u,c,c'} = \\sum_i x^p_{icu}x^p_{ic',u+d}` and :math:`S_{uc} = \\sum_i x^p_{icu}`.

    :math:`x^p` is the zero-padded input map ``x`` ``(M, C, H, W)``, u runs over its ``H_p x W_p`` positions and
    d over the offsets between two kernel taps with a row offset :math:`d_r \\in [0, k_h)` and a column offset
    :math:`d_c \\in (-k_w, k_w)`: the offsets with :math:`d_r < 0` follow from
    :math:`Q_{d,u} = Q_{-d,u+d}^\\top`, i.e. from the symmetry of the Gram (:func:`shifted_gram`). A stride-1
    convolution's patch Gram :math:`\\sum_{i,t}\\tilde a_{it}\\tilde a_{it}^\\top` has the entry
    :math:`\\sum_{u\\in W_k}Q_{k'-k,u,c,c'}` at taps (c, k), (c', k') (k' not above k), with :math:`W_k` the
    window of positions that tap k reads: :math:`C^2k_h(2k_w-1)H_pW_p` multiply-adds per example instead of
    the patch GEMM's :math:`T(Ck_hk_w)^2`. One GEMM (C x M x (2k_w-1)C) per position row and row offset, on
    strided views of one copy of the map. ``products`` Q is ``(k_h, H_p, W_p, C, (2k_w-1)·C)`` (row offset;
    position; c; column offset, c'), ``sums`` S ``(H_p, W_p, C)``; both are added to in place.
    """
    (kh, kw), (ph, pw) = spec.kernel_size, spec.padding
    n_rows, channels = x.shape[:2]
    height, width = products.shape[1:3]
    # (H_p + k_h - 1, M, W_p + 2k_w - 2, C): x^p with k-1 more zeros below and on each side, so that u + d is in range
    grid = F.pad(x, (pw + kw - 1, pw + kw - 1, ph, ph + kh - 1)).permute(2, 0, 3, 1).contiguous()
    inner = grid[:height, :, kw - 1 : kw - 1 + width]  # x^p: (H_p, M, W_p, C)
    sums += inner.sum(1)
    col_stride, row_stride = grid.stride(2), grid.stride(1)
    for r in range(height):
        left = inner[r].permute(1, 2, 0)  # (W_p, C, M)
        for e in range(kh):
            # right[s, i, f·C + c'] = x^p[i, c', r + e, s + f - k_w + 1]: overlapping windows, no copy
            right = grid[r + e].as_strided((width, n_rows, (2 * kw - 1) * channels), (col_stride, row_stride, 1))
            products[e, r].baddbmm_(left, right)


def _window_sums(values: Tensor, dim: int, n_windows: int, length: int) -> Tensor:
    """Sums of ``values`` over ``[a, a + length)`` along ``dim`` for a = 0 .. n_windows-1 (one GEMM with the
    0/1 window matrix)."""
    index = torch.arange(values.shape[dim], device=values.device)
    starts = torch.arange(n_windows, device=values.device)[:, None]
    windows = ((index >= starts) & (index < starts + length)).to(values.dtype)  # (n_windows, size)
    return torch.tensordot(windows, values, dims=([1], [dim])).movedim(0, dim)


def shifted_gram(products: Tensor, sums: Tensor, n_rows: int, input_hw: tuple[int, int], slot: KronSlot) -> Tensor:
    """The patch Gram ``(n, n)`` from :func:`add_shifted_products_`'s Q and S, by window sums.

    The block of taps k = (a, b), k' = (a', b') is :math:`\\sum_{u\\in W_k}Q_{k'-k,u}` for a' >= a and the
    transpose of the block (k', k) for a' < a. Q and S are summed over the M = ``n_rows`` examples (the bias
    entry is M·T).
    """
    spec = slot.conv
    assert spec is not None
    (kh, kw), (ph, pw) = spec.kernel_size, spec.padding
    out_h, out_w = input_hw[0] + 2 * ph - kh + 1, input_hw[1] + 2 * pw - kw + 1
    channels = sums.shape[-1]
    box = _window_sums(_window_sums(products, 1, kh, out_h), 2, kw, out_w)  # (k_h, k_h, k_w, C, (2k_w-1)·C)
    box = box.view(kh, kh, kw, channels, 2 * kw - 1, channels)
    taps_h, taps_w = torch.arange(kh, device=box.device), torch.arange(kw, device=box.device)
    ia, ib = taps_h.view(kh, 1, 1, 1), taps_w.view(1, kw, 1, 1)
    ja, jb = taps_h.view(1, 1, kh, 1), taps_w.view(1, 1, 1, kw)
    below = ja < ia  # the blocks (k, k') with k' above k: transposes of (k', k)
    row, col = torch.where(below, ja, ia), torch.where(below, jb, ib)
    shift = torch.where(below, ib - jb, jb - ib) + kw - 1
    blocks = box[(ja - ia).abs(), row, col, :, shift]  # (k_h, k_w, k_h, k_w, C, C): taps k, k'
    blocks = torch.where(below[..., None, None], blocks.mT, blocks)
    n_in = slot.in_features
    gram = products.new_empty(slot.shape[1], slot.shape[1])
    gram[:n_in, :n_in] = blocks.permute(4, 0, 1, 5, 2, 3).reshape(n_in, n_in)  # unfold order (c, k_h, k_w)
    if slot.bias_slice is not None:
        column = _window_sums(_window_sums(sums, 0, kh, out_h), 1, kw, out_w).permute(2, 0, 1).reshape(n_in)
        gram[:n_in, n_in] = column
        gram[n_in, :n_in] = column
        gram[n_in, n_in] = n_rows * out_h * out_w
    return gram
