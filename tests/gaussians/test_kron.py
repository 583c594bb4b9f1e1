"""Block-diagonal, KFAC, EFB and DEF Gaussians against dense linear algebra (float64, two blocks, D=14)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from bdl_bench.gaussians import DiagGaussian, FullGaussian, kl
from bdl_bench.gaussians.blocks import BlockDiagGaussian, BlockEigenGaussian, BlockGaussian, pack
from bdl_bench.gaussians.def_lowrank import KroneckerLowRankPlusDiagGaussian
from bdl_bench.gaussians.io import load_gaussian, save_gaussian
from bdl_bench.gaussians.kl import _kl_dense
from bdl_bench.gaussians.kron import EigenKroneckerGaussian, KroneckerGaussian, ScaledEigenKroneckerGaussian

SHAPES = [(2, 4), (3, 2)]  # D = 8 + 6
DIM = sum(m * n for m, n in SHAPES)
KINDS = ("block", "block_eigen", "kron", "eigen_kron", "scaled_eigen_kron", "def", "def_full_rank", "def_zero_eig")


def _spd(n: int, g: torch.Generator) -> torch.Tensor:
    root = torch.randn(n, n, generator=g, dtype=torch.float64)
    return root @ root.mT / n + 0.5 * torch.eye(n, dtype=torch.float64)


def _orthogonal(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q


def make(kind: str, g: torch.Generator) -> BlockGaussian:
    mean = torch.randn(DIM, generator=g, dtype=torch.float64)
    index = torch.randperm(DIM, generator=g)
    shapes = torch.tensor(SHAPES)
    if kind == "block":
        return BlockDiagGaussian(mean, index, shapes, pack([_spd(m * n, g) for m, n in SHAPES]))
    if kind == "block_eigen":
        vecs = pack([_orthogonal(m * n, g) for m, n in SHAPES])
        return BlockEigenGaussian(
            mean, index, shapes, vecs, torch.rand(DIM, generator=g, dtype=torch.float64) * 3 + 0.2
        )
    if kind == "kron":
        return KroneckerGaussian(
            mean, index, shapes, pack([_spd(m, g) for m, _ in SHAPES]), pack([_spd(n, g) for _, n in SHAPES])
        )
    if kind in ("eigen_kron", "scaled_eigen_kron"):
        fields = (
            mean,
            index,
            shapes,
            pack([_orthogonal(m, g) for m, _ in SHAPES]),
            pack([_orthogonal(n, g) for _, n in SHAPES]),
            torch.rand(DIM, generator=g, dtype=torch.float64) * 3 + 0.2,
        )
        if kind == "eigen_kron":
            return EigenKroneckerGaussian(*fields)
        scale = torch.rand(sum(n for _, n in SHAPES), generator=g, dtype=torch.float64) * 2 + 0.3
        return ScaledEigenKroneckerGaussian(*fields, scale)
    ranks = {"def": [(1, 2), (2, 1)], "def_full_rank": SHAPES, "def_zero_eig": [(2, 2), (2, 2)]}[kind]
    eigenvalues = [torch.rand(r, generator=g, dtype=torch.float64) * 4 for r in ranks]
    if kind == "def_zero_eig":
        eigenvalues[0][1, 1] = 0.0  # a singular H: the sampler's eigendecomposition fallback
    return KroneckerLowRankPlusDiagGaussian(
        mean,
        index,
        shapes,
        torch.tensor(ranks),
        pack([_orthogonal(m, g)[:, :r] for (m, _), (r, _) in zip(SHAPES, ranks)]),
        pack([_orthogonal(n, g)[:, :r] for (_, n), (_, r) in zip(SHAPES, ranks)]),
        pack(eigenvalues),
        torch.rand(DIM, generator=g, dtype=torch.float64) + 0.3,
    )


@pytest.fixture(params=KINDS)
def gaussian(request: pytest.FixtureRequest, generator: torch.Generator) -> BlockGaussian:
    return make(request.param, generator)


def expected_precision(q: BlockGaussian) -> torch.Tensor:
    """The precision built from the definitions, independently of ``_block_dense``/``to_dense``."""
    p = torch.zeros(DIM, DIM, dtype=torch.float64)
    for b, idx in enumerate(q._block_index):
        if isinstance(q, BlockDiagGaussian):
            block = q._blocks[b]
        elif isinstance(q, BlockEigenGaussian):
            block = q._vecs[b] @ torch.diag(q.eigvals.split([m * n for m, n in SHAPES])[b]) @ q._vecs[b].mT
        elif isinstance(q, KroneckerGaussian):
            block = torch.kron(q._outs[b], q._ins[b])
        elif isinstance(q, ScaledEigenKroneckerGaussian):  # (Q_B ⊗ S Q_C) diag(Λ) (Q_B ⊗ S Q_C)^T
            v = torch.kron(q._outs[b], torch.diag(q._scales[b]) @ q._ins[b])
            block = v @ torch.diag(q._eigs[b].reshape(-1)) @ v.mT
        elif isinstance(q, EigenKroneckerGaussian):
            v = torch.kron(q._outs[b], q._ins[b])
            block = v @ torch.diag(q._eigs[b].reshape(-1)) @ v.mT
        else:
            v = torch.kron(q._outs[b], q._ins[b])
            block = v @ torch.diag(q._sqrt_eigs[b].square().reshape(-1)) @ v.mT + torch.diag(q.prec_diag[idx])
        p[idx[:, None], idx[None, :]] = block
    return p


def test_to_dense_matches_the_definition(gaussian: BlockGaussian) -> None:
    assert_close(gaussian.to_dense().precision, expected_precision(gaussian))
    assert_close(gaussian.to_dense().mean, gaussian.mean)


@pytest.mark.parametrize("n_cols", [None, 3])
def test_matvec_and_solve(gaussian: BlockGaussian, generator: torch.Generator, n_cols: int | None) -> None:
    shape = (DIM,) if n_cols is None else (DIM, n_cols)
    v = torch.randn(shape, generator=generator, dtype=torch.float64)
    precision = expected_precision(gaussian)
    assert_close(gaussian.precision_matvec(v), precision @ v)
    assert_close(gaussian.solve(v), torch.linalg.solve(precision, v))


def test_logdet_and_variance(gaussian: BlockGaussian) -> None:
    precision = expected_precision(gaussian)
    assert_close(gaussian.logdet_precision(), torch.logdet(precision))
    assert_close(gaussian.variance(), torch.linalg.inv(precision).diagonal())


def test_sampler_covariance_matches_dense(gaussian: BlockGaussian) -> None:
    """rsample's map A (from the identity) satisfies A A^T = P^{-1}; for DEF this is App. B.2's sampler."""
    a_transposed = gaussian._sample_transform(torch.eye(DIM, dtype=torch.float64)) - gaussian.mean
    assert_close(a_transposed.mT @ a_transposed, torch.linalg.inv(expected_precision(gaussian)))


def test_def_sampler_core_is_rank_sized(generator: torch.Generator) -> None:
    """The only cubic work of the DEF sampler is on L x L matrices (L = g·a per block)."""
    q = make("def", generator)
    assert [tuple(c.shape) for c in q._sample_cores] == [(2, 2), (2, 2)]


def test_rsample_uses_only_the_generator(gaussian: BlockGaussian) -> None:
    a = gaussian.rsample(3, torch.Generator().manual_seed(5))
    b = gaussian.rsample(3, torch.Generator().manual_seed(5))
    assert a.shape == (3, DIM)
    assert_close(a, b, rtol=0, atol=0)


def test_save_load_round_trip(gaussian: BlockGaussian, tmp_path: Path) -> None:
    save_gaussian(gaussian, tmp_path / "q.pt")
    loaded = load_gaussian(tmp_path / "q.pt")
    assert type(loaded) is type(gaussian)
    for field in dataclasses.fields(gaussian):
        assert_close(getattr(loaded, field.name), getattr(gaussian, field.name), rtol=0, atol=0)


def test_kl_to_diag_closed_form_matches_dense(gaussian: BlockGaussian, generator: torch.Generator) -> None:
    q = DiagGaussian(
        torch.randn(DIM, generator=generator, dtype=torch.float64),
        torch.rand(DIM, generator=generator, dtype=torch.float64) + 0.5,
    )
    assert_close(kl(gaussian, q), _kl_dense(gaussian, q))
    other = FullGaussian(q.mean, expected_precision(gaussian) + torch.eye(DIM, dtype=torch.float64))
    assert_close(kl(gaussian, other), _kl_dense(gaussian, other))  # dense fallback for other pairs


def test_bad_layouts_are_refused(generator: torch.Generator) -> None:
    q = make("kron", generator)
    fields = {f.name: getattr(q, f.name) for f in dataclasses.fields(q)}
    with pytest.raises(ValueError, match="permutation"):
        KroneckerGaussian(**{**fields, "index": torch.zeros(DIM, dtype=torch.long)})
    with pytest.raises(ValueError, match="cover"):
        KroneckerGaussian(**{**fields, "shapes": torch.tensor([[2, 4], [3, 3]])})
    with pytest.raises(ValueError, match="symmetric"):
        KroneckerGaussian(**{**fields, "prec_out": torch.arange(13, dtype=torch.float64)})
    bad_spd = KroneckerGaussian(**{**fields, "prec_out": -fields["prec_out"]})
    with pytest.raises(ValueError, match="not positive definite"):
        bad_spd.variance()


def test_def_refuses_bad_ranks_and_negative_values(generator: torch.Generator) -> None:
    q = make("def", generator)
    fields = {f.name: getattr(q, f.name) for f in dataclasses.fields(q)}
    with pytest.raises(ValueError, match="ranks"):
        KroneckerLowRankPlusDiagGaussian(**{**fields, "ranks": torch.tensor([[3, 2], [2, 1]])})
    with pytest.raises(ValueError, match="eigenvalues must be >= 0"):
        KroneckerLowRankPlusDiagGaussian(**{**fields, "eigenvalues": -fields["eigenvalues"]})
    with pytest.raises(ValueError, match="prec_diag must be positive"):
        KroneckerLowRankPlusDiagGaussian(**{**fields, "prec_diag": torch.zeros(DIM, dtype=torch.float64)})


def test_block_eigen_with_infinite_eigenvalues_is_the_pseudo_inverse(generator: torch.Generator) -> None:
    """+inf eigenvalues (null_space=deterministic) give the covariance V diag(1/λ) V^T with 1/inf = 0: solve,
    variance and the sampler follow it, samples do not move along those eigenvectors, and log|P| = inf."""
    q = make("block_eigen", generator)
    eigvals = q.eigvals.clone()
    eigvals[[1, 5, 9]] = torch.inf  # two in block 0 (positions 0-7), one in block 1
    q = BlockEigenGaussian(q.mean, q.index, q.shapes, q.eigvecs, eigvals)
    assert q.n_deterministic == 3
    covariance, null = torch.zeros(DIM, DIM, dtype=torch.float64), []
    for b, (idx, lam) in enumerate(zip(q._block_index, eigvals.split([m * n for m, n in SHAPES]))):
        v = q._vecs[b]
        covariance[idx[:, None], idx[None, :]] = v @ torch.diag(torch.where(lam.isinf(), 0.0, 1 / lam)) @ v.mT
        lifted = torch.zeros(DIM, v.shape[1], dtype=torch.float64)
        lifted[idx] = v
        null.append(lifted[:, lam.isinf()])
    null = torch.cat(null, 1)
    assert torch.linalg.matrix_rank(covariance) == DIM - 3
    rhs = torch.randn(DIM, 2, generator=generator, dtype=torch.float64)
    assert_close(q.solve(rhs), covariance @ rhs)
    assert_close(q.variance(), covariance.diagonal())
    a_transposed = q._sample_transform(torch.eye(DIM, dtype=torch.float64)) - q.mean
    assert_close(a_transposed.mT @ a_transposed, covariance)
    samples = q.rsample(50, torch.Generator().manual_seed(1)) - q.mean
    assert_close(samples @ null, torch.zeros(50, 3, dtype=torch.float64), rtol=0, atol=1e-12)
    assert q.logdet_precision() == torch.inf
    with pytest.raises(ValueError, match="infinite along the 3 deterministic directions"):
        q.to_dense()
    with pytest.raises(ValueError, match="eigvals must be positive"):
        BlockEigenGaussian(q.mean, q.index, q.shapes, q.eigvecs, -q.eigvals)
