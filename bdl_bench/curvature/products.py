"""Batched matrix products in the form the CPU's batched GEMM runs fastest, for R stacked copies of small
matrices (:mod:`bdl_bench.stacked`), each the same value as the plain product up to rounding.

A batched GEMM runs one product per matrix; for thin shapes (a dimension of 1, or a transposed left factor
against a few columns) its kernel is several times slower than an equivalent form, measured for 100
copies of the UCI networks' shapes (one thread, float32):

- ``(R, P, 1) @ (R, 1, n)`` (outer products): 275 us as a GEMM, 110 us as a broadcast product;
- ``(R, D, 1) @ (R, 1, 1)``: 300 us against 9 us; ``(R, 4, D) @ (R, D, 1)`` 380 us against 62 us;
- ``x^T y`` for ``x`` ``(R, 200, 50)``, ``y`` ``(R, 200, 8)`` (a layer's output gradients against its
  inputs): 1270 us as ``x.mT @ y``, 315 us as ``(y.mT @ x).mT``.
"""

from __future__ import annotations

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
