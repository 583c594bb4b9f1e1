"""The batched products of bdl_bench/curvature/products.py equal the plain matrix products."""

from __future__ import annotations

import pytest
import torch

from bdl_bench.curvature.products import stacked_linear, t_matmul, thin_matmul


@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [
        ((5, 7, 1), (5, 1, 3)),  # outer products
        ((5, 4, 9), (5, 9, 1)),  # matrix-vector
        ((5, 1, 9), (5, 9, 1)),  # dot products
        ((6, 1), (5, 1, 4)),  # a shared left factor, broadcast over the batch
        ((5, 4, 3), (5, 3, 2)),  # no dimension of 1: the plain product
        ((4, 3), (3, 1)),  # unbatched
    ],
)
def test_thin_matmul_equals_the_matrix_product(a_shape: tuple, b_shape: tuple) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(a_shape, generator=g, dtype=torch.float64)
    b = torch.randn(b_shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(thin_matmul(a, b), a @ b, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize(
    ("m", "n", "transposed"),
    [(50, 8, True), (50, 1, True), (9, 8, True), (8, 8, False), (50, 16, False), (8, 50, False)],
)
def test_t_matmul_equals_the_transposed_product(m: int, n: int, transposed: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 30, m, generator=g, dtype=torch.float64)
    y = torch.randn(4, 30, n, generator=g, dtype=torch.float64)
    product = t_matmul(x, y)
    assert product.shape == (4, m, n)
    if n > 1:  # the form it took: (y^T x)^T is a transposed view (unit stride down a column)
        assert (product.stride(-2) == 1) is transposed
    torch.testing.assert_close(product, x.mT @ y, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("n_out", [1, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_stacked_linear_and_its_gradients_equal_the_batched_gemm(n_out: int, with_bias: bool) -> None:
    """One output (the broadcast form) or several (the GEMM): values and autograd's gradients of h, W, b."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, n_out, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, n_out, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    upstream = torch.randn(4, 6, n_out, generator=g, dtype=torch.float64)
    leaves = [t for t in (h, weight, bias) if t is not None]
    out = stacked_linear(h, weight, bias)
    ref = h @ weight.mT + (bias.unsqueeze(1) if bias is not None else 0.0)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-14)
    for got, want in zip(torch.autograd.grad(out, leaves, upstream), torch.autograd.grad(ref, leaves, upstream)):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
