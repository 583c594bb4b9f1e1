"""Batched matrix products in the form the CPU's batched GEMM runs fastest, for R stacked copies of small
matrices (:mod:`bdl_bench.orchestration.stacked`), each the same value as the plain product up to rounding.

A batched GEMM runs one product per matrix; for thin shapes its kernel is slower than an equivalent form:
products with an inner dimension or a column count of 1 (outer products, matrix-vector products, a one-output
layer and its backward) run as broadcast products, and ``x^T y`` against a few columns of y as
``(y.mT @ x).mT``.
"""

from __future__ import annotations

import torch
from torch import Tensor

_FEW_COLUMNS = 8  # t_matmul: at most this many columns of y (and fewer than x's) take the transposed form


def thin_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of (batched) matrices, by broadcasting where the inner dimension or ``b``'s number of columns
    is 1 (rank L = 1 factors, a one-output layer). Else ``a @ b``."""
    if a.dim() < 3 and b.dim() < 3:
        return a @ b
    if a.shape[-1] == 1:  # outer products: each entry one multiplication, as the GEMM's
        return a * b
    if b.shape[-1] == 1:  # matrix-vector products
        return (a * b.mT).sum(-1, keepdim=True)
    return a @ b


def t_matmul(x: Tensor, y: Tensor) -> Tensor:
    """:math:`x^\\top y` of batched matrices ``x`` ``(..., P, m)`` and ``y`` ``(..., P, n)``: ``(..., m, n)``,
    as ``(y.mT @ x).mT`` (a transposed view) when y has few columns (at most 8, and fewer than x), else
    ``x.mT @ y``."""
    if y.dim() >= 3 and y.shape[-1] <= _FEW_COLUMNS and y.shape[-1] < x.shape[-1]:
        return (y.mT @ x).mT
    return x.mT @ y


def t_matmul_into(x: Tensor, y: Tensor, out: Tensor) -> None:
    r""":func:`t_matmul` of batched matrices (:math:`x^\top y`, ``(R, m, n)``) written into ``out`` (e.g. a view of
    a flat ``(R, D)`` vector), in the transposed form where that one is the faster. An ``out`` whose copies are
    not contiguous (a layer's view of R > 1 flat vectors) is written by a copy: the batched GEMM would write it
    one copy at a time."""
    if not out.is_contiguous():
        out.copy_(t_matmul(x, y))
    elif y.shape[-1] <= _FEW_COLUMNS and y.shape[-1] < x.shape[-1]:
        torch.bmm(y.mT, x, out=out.mT)
    else:
        torch.bmm(x.mT, y, out=out)


def stacked_linear(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A linear layer of R copies, ``h`` ``(R, P, in)``, ``weight`` ``(R, out, in)``, ``bias`` ``(R, out)`` or
    ``None``: ``(R, P, out)``. A layer with one output is a broadcast product and a sum (so is its backward:
    autograd's products of a batched GEMM with a dimension of 1 run one tiny product per copy)."""
    if weight.shape[-2] == 1:
        out = (h * weight).sum(-1, keepdim=True)
        return out if bias is None else out + bias.unsqueeze(1)
    return h @ weight.mT if bias is None else torch.baddbmm(bias.unsqueeze(1), h, weight.mT)
