"""DEF Fig. 5's errors (bdl_bench.curvature.frobenius): zero exactly where an approximation is exact, and the
orderings of Prop. 1, Lemma 1 and Lemma 4 on a random layer."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from _nets import small_net
from torch import nn

from bdl_bench.curvature.exact import exact_blocks
from bdl_bench.curvature.frobenius import (
    ERRORS,
    block_approximations,
    def_information,
    efb_grid,
    frobenius_errors,
    layer_approximations,
)
from bdl_bench.curvature.kron import efb_eigenvalues, eigenbasis, kron_factors
from bdl_bench.curvature.pseudo_grads import pseudo_grads
from bdl_bench.likelihoods import Categorical, Gaussian


def _row(table: pd.DataFrame, method: str) -> pd.Series:
    return table[table["method"] == method].iloc[0]


def test_errors_are_zero_for_the_exact_matrix_and_normalised_otherwise() -> None:
    g = torch.Generator().manual_seed(0)
    root = torch.randn(6, 6, generator=g, dtype=torch.float64)
    exact = root @ root.T
    assert frobenius_errors(exact, exact.clone()) == {k: 0.0 for k in ERRORS}
    zero = frobenius_errors(exact, torch.zeros_like(exact))  # the zero matrix: 1 everywhere ("from 0 to 1")
    assert zero == pytest.approx({k: 1.0 for k in ERRORS})
    half = frobenius_errors(exact, exact / 2)
    assert half == pytest.approx({k: 0.5 for k in ERRORS})
    only_diag = frobenius_errors(exact, torch.diag(exact.diagonal()))
    assert only_diag["err_diag"] == 0 and only_diag["err_offdiag"] == pytest.approx(1.0)


def test_every_kronecker_approximation_is_exact_on_a_kronecker_block() -> None:
    """One training point: the first layer's block is vec(g aᵀ) vec(g aᵀ)ᵀ = g gᵀ ⊗ a aᵀ, a Kronecker product of
    rank 1, so KFAC, EFB and DEF at every K reproduce it (errors 0) while Diag misses all its off-diagonal."""
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    theta = torch.randn(17, generator=g, dtype=torch.float64)
    x = torch.randn(1, 2, generator=g, dtype=torch.float64)
    table, eigenvalues = layer_approximations(model, theta, x, torch.zeros(1), Gaussian(2.0))
    assert eigenvalues.shape == (12,) and int((eigenvalues > 1e-10 * eigenvalues.max()).sum()) == 1
    exact_ones = table[table["method"] != "Diag"]
    assert (exact_ones[list(ERRORS)] < 1e-10).all().all(), exact_ones
    assert _row(table, "Diag")["err_offdiag"] == pytest.approx(1.0)


@pytest.fixture
def tiny_layer_table() -> pd.DataFrame:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    theta = torch.randn(16, generator=g, dtype=torch.float64)
    x = torch.randn(40, 1, generator=g, dtype=torch.float64)
    table, eigenvalues = layer_approximations(model, theta, x, torch.zeros(40), Gaussian(2.0))
    assert eigenvalues.shape == (10,)
    return table


def test_frobenius_errors_follow_lemmas_1_and_4(tiny_layer_table: pd.DataFrame) -> None:
    defs = tiny_layer_table[tiny_layer_table["method"] == "DEF"]
    assert (defs["err_diag"] < 1e-12).all()  # Prop. 1: DEF's diagonal is exact at every rank
    assert _row(tiny_layer_table, "Diag")["err_diag"] == 0
    assert _row(tiny_layer_table, "Diag")["err_offdiag"] == pytest.approx(1.0)
    full = defs.iloc[-1]
    assert full["kept"] == 10 and list(defs["rank"]) == list(range(1, 11))
    assert full["err_total"] <= _row(tiny_layer_table, "EFB")["err_total"] + 1e-12  # Lemma 4
    assert _row(tiny_layer_table, "EFB")["err_total"] <= _row(tiny_layer_table, "KFAC")["err_total"] + 1e-12
    assert full["err_offdiag"] == pytest.approx(_row(tiny_layer_table, "EFB")["err_offdiag"])  # EFB's off-diagonal
    assert _row(tiny_layer_table, "KFAC")["err_diag"] > 1e-3  # the random layer is not a Kronecker product


def test_block_based_efb_and_def_agree_with_the_streaming_passes_on_a_conv_net() -> None:
    """The dense twin of Laplace's fast path: EFB's eigenvalues read off the exact block, diag(Qᵀ I Q), equal
    ``efb_eigenvalues``' streamed mean squared projections on every layer of a small CNN (padded and strided
    convolutions, 3 classes), and DEF's dense form keeps the exact diagonal (Prop. 1) and at full rank is EFB
    plus that correction."""
    g = torch.Generator().manual_seed(3)
    model = small_net("cnn", 3)
    theta = torch.randn(sum(p.numel() for p in model.parameters()), generator=g, dtype=torch.float64)
    x = torch.randn(30, 25, generator=g, dtype=torch.float64)
    batch = pseudo_grads(model, theta, x, torch.zeros(30, dtype=torch.long), Categorical())
    blocks, factors = exact_blocks([batch]), kron_factors([batch])
    bases = eigenbasis(factors)
    streamed, _ = efb_eigenvalues([batch], bases)
    for block, basis, lam in zip(blocks, bases, streamed):
        torch.testing.assert_close(efb_grid(block, basis), lam, rtol=1e-9, atol=1e-12)
        q = torch.kron(basis.eigvecs_out, basis.eigvecs_in)
        approx, kept = def_information(block, basis, None)
        assert kept == block.shape[0]
        torch.testing.assert_close(approx.diagonal(), block.diagonal(), rtol=1e-9, atol=1e-12)
        efb = q @ torch.diag(lam.reshape(-1)) @ q.mT
        off = ~torch.eye(block.shape[0], dtype=torch.bool)
        torch.testing.assert_close(approx[off], efb[off], rtol=1e-9, atol=1e-12)
    table = block_approximations(blocks[0], factors[0], [1, 3])
    assert list(table["method"]) == ["Diag", "KFAC", "EFB", "DEF", "DEF"] and list(table["rank"].iloc[3:]) == [1, 3]
