"""The Gram-trick products and SLANG's top-L update against materialised G and a D x D ``eigh``."""

from __future__ import annotations

import pytest
import torch

from bdl_bench.curvature import (
    PerExampleFactors,
    add_matmul,
    factor_cross,
    gram,
    gram_matrix,
    linear_factors,
    low_rank_update,
    sq_diag,
)
from bdl_bench.curvature.dense import dense_low_rank_update, per_example_gradients
from bdl_bench.likelihoods import Categorical
from bdl_bench.models.mlp import mlp

F64 = torch.float64


def _factors(generator: torch.Generator, n_samples: int = 1, n: int = 7) -> tuple[PerExampleFactors, torch.Tensor]:
    """Factors of a 3-5-2 tanh MLP (D = 32) at random parameters, and the dense G they stand for."""
    torch.manual_seed(0)
    model = mlp(in_features=3, out_features=2, hidden=[5], activation="tanh").to(F64)
    x = torch.randn(n, 3, generator=generator, dtype=F64)
    y = torch.randint(0, 2, (n,), generator=generator)
    thetas = torch.randn(n_samples, 32, generator=generator, dtype=F64)
    factors = linear_factors(model, thetas, x, y, Categorical())
    return factors, per_example_gradients(model, thetas, x, y, Categorical())


@pytest.fixture(params=[False, True], ids=["one_chunk", "chunked"])
def chunking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run each blocked pass once whole and once in several blocks."""
    if request.param:
        monkeypatch.setattr(gram, "_BLOCK_ELEMENTS", 40)
    return request.param


@pytest.mark.parametrize("n_samples", [1, 3])
def test_products_equal_dense(n_samples: int, chunking: bool, generator: torch.Generator) -> None:
    factors, dense = _factors(generator, n_samples)
    vectors = torch.randn(32, 4, generator=generator, dtype=F64)
    coeffs = torch.randn(factors.n_columns, 4, generator=generator, dtype=F64)
    torch.testing.assert_close(gram_matrix(factors), dense.mT @ dense)
    torch.testing.assert_close(factor_cross(factors, vectors), dense.mT @ vectors)
    out = gram.empty_columns_first(32, 4, like=coeffs).copy_(torch.randn(32, 4, generator=generator, dtype=F64))
    expected = out + 0.5 * dense @ coeffs
    assert add_matmul(factors, coeffs, out, alpha=0.5) is out
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(sq_diag(factors), dense.square().sum(1))


def _projector_check(update_factor: torch.Tensor, reference_factor: torch.Tensor) -> None:
    """Equal ``U Uᵀ``: invariant to the sign and rotation of eigenvectors within ties."""
    torch.testing.assert_close(update_factor @ update_factor.mT, reference_factor @ reference_factor.mT)


@pytest.mark.parametrize("n_samples", [1, 3])
@pytest.mark.parametrize("rank", [1, 3, 6])
def test_gram_update_equals_dense_eigh(n_samples: int, rank: int, chunking: bool, generator: torch.Generator) -> None:
    factors, dense = _factors(generator, n_samples)
    u = torch.randn(32, rank, generator=generator, dtype=F64)
    old_weight, new_weight = 0.9, 0.1 * 50 / factors.n_columns
    update = low_rank_update(factors, u, old_weight=old_weight, new_weight=new_weight, path="gram")
    ref_factor, ref_residual = dense_low_rank_update(dense, u, old_weight=old_weight, new_weight=new_weight)
    _projector_check(update.prec_factor, ref_factor)
    torch.testing.assert_close(update.diag_residual, ref_residual)
    assert bool((update.diag_residual > -1e-10).all())  # a diagonal of a PSD residual
    torch.testing.assert_close(update.factor_sqnorms, update.prec_factor.square().sum(1))
    # the new factor's Gram matrix is the diagonal of its eigenvalues, in decreasing order
    torch.testing.assert_close(update.prec_factor.mT @ update.prec_factor, torch.diag(update.eigenvalues))
    assert bool((update.eigenvalues[:-1] >= update.eigenvalues[1:]).all())


def test_first_step_from_zero_factor(generator: torch.Generator) -> None:
    """U = 0 (SLANG's start), with more columns asked for than G has (rank > P): zero columns."""
    factors, dense = _factors(generator, n=3)
    u = torch.zeros(32, 5, dtype=F64)
    update = low_rank_update(factors, u, old_weight=0.95, new_weight=0.05, path="gram")
    ref_factor, ref_residual = dense_low_rank_update(dense, u, old_weight=0.95, new_weight=0.05)
    _projector_check(update.prec_factor, ref_factor)
    torch.testing.assert_close(update.diag_residual, ref_residual, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(update.eigenvalues[3:], torch.zeros(2, dtype=F64), atol=1e-12, rtol=0)


def test_dense_path_and_known_gram_agree_with_gram_path(generator: torch.Generator) -> None:
    factors, _ = _factors(generator, n_samples=2)
    u = torch.randn(32, 3, generator=generator, dtype=F64)
    kwargs = dict(old_weight=0.8, new_weight=0.3)
    via_gram = low_rank_update(factors, u, **kwargs, path="gram")
    via_dense = low_rank_update(factors, u, **kwargs, path="dense")
    with_cache = low_rank_update(factors, u, **kwargs, factor_gram=u.mT @ u, factor_sqnorms=u.square().sum(1))
    for other in (via_dense, with_cache):
        _projector_check(other.prec_factor, via_gram.prec_factor)
        torch.testing.assert_close(other.eigenvalues, via_gram.eigenvalues)
        torch.testing.assert_close(other.diag_residual, via_gram.diag_residual)


@pytest.mark.parametrize("path", ["gram", "dense"])
def test_non_finite_gradients_raise(path: str, generator: torch.Generator) -> None:
    factors, _ = _factors(generator)
    factors.layers[0].output_grads[2, 1] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        low_rank_update(factors, torch.randn(32, 2, dtype=F64), old_weight=0.9, new_weight=0.1, path=path)


def test_unknown_path_is_refused(generator: torch.Generator) -> None:
    factors, _ = _factors(generator)
    with pytest.raises(ValueError, match="'auto', 'gram' or 'dense'"):
        low_rank_update(factors, torch.zeros(32, 1, dtype=F64), old_weight=0.9, new_weight=0.1, path="lanczos")


@pytest.mark.parametrize("layout", ["new", "column_major_out", "row_major_out", "in_place"])
def test_update_into_given_output(layout: str, chunking: bool, generator: torch.Generator) -> None:
    """``out`` (possibly U itself, rotated block by block in place) gives the same update."""
    factors, _ = _factors(generator, n_samples=2)
    u = gram.empty_columns_first(32, 3, like=factors.losses).copy_(torch.randn(32, 3, generator=generator, dtype=F64))
    kwargs = dict(old_weight=0.8, new_weight=0.3, path="gram")
    reference = low_rank_update(factors, u.clone(), **kwargs)
    out = {
        "new": None,
        "column_major_out": gram.empty_columns_first(32, 3, like=u),
        "row_major_out": torch.empty(32, 3, dtype=F64),
        "in_place": u,
    }[layout]
    update = low_rank_update(factors, u, **kwargs, out=out)
    if out is not None:
        assert update.prec_factor is out
    torch.testing.assert_close(update.prec_factor, reference.prec_factor)
    torch.testing.assert_close(update.diag_residual, reference.diag_residual)


def test_column_sqnorms(generator: torch.Generator) -> None:
    m = torch.randn(11, 4, generator=generator, dtype=F64)
    torch.testing.assert_close(gram.column_sqnorms(m), m.square().sum(1))
    torch.testing.assert_close(gram.column_sqnorms(gram.empty_columns_first(11, 4, like=m).copy_(m)), m.square().sum(1))


@pytest.mark.parametrize("with_mixing", [False, True], ids=["add", "mix"])
@pytest.mark.parametrize("in_place", [False, True], ids=["new_dst", "in_place"])
def test_combine_rows_equals_dense(
    with_mixing: bool, in_place: bool, chunking: bool, generator: torch.Generator
) -> None:
    """``dst = mixing^T src + alpha (G C)^T`` and its squared column norms, chunk by chunk, against dense G."""
    factors, dense = _factors(generator, n_samples=2)
    rank = 3
    coeffs = torch.randn(factors.n_columns, rank, generator=generator, dtype=F64)
    mixing = torch.randn(rank, rank, generator=generator, dtype=F64) if with_mixing else None
    src = torch.randn(rank, 32, generator=generator, dtype=F64)  # rows (K, D)
    expected = (src.mT if mixing is None else src.mT @ mixing) + 0.7 * dense @ coeffs  # (D, K)
    workspace: dict[str, torch.Tensor] = {}
    for _ in range(2):  # the second call reuses the workspace's buffers
        source = src.clone()
        dst = source if in_place else torch.full_like(src, float("nan"))
        sqnorms = torch.full((32,), float("nan"), dtype=F64)
        gram.combine_rows(factors, coeffs, source, dst, alpha=0.7, mixing=mixing, sqnorms=sqnorms, workspace=workspace)
        torch.testing.assert_close(dst.mT, expected)
        torch.testing.assert_close(sqnorms, expected.square().sum(1))
    assert workspace  # buffers were kept


def test_workspace_buffer_reuses_and_grows() -> None:
    like = torch.zeros(1, dtype=F64)
    assert gram.workspace_buffer(None, "a", (2, 3), like).shape == (2, 3)
    workspace: dict[str, torch.Tensor] = {}
    first = gram.workspace_buffer(workspace, "a", (2, 3), like)
    again = gram.workspace_buffer(workspace, "a", (3, 2), like)
    assert again.shape == (3, 2) and again.data_ptr() == first.data_ptr()  # the same memory
    bigger = gram.workspace_buffer(workspace, "a", (4, 4), like)
    assert bigger.shape == (4, 4) and workspace["a"].numel() == 16
    single = gram.workspace_buffer(workspace, "a", (2,), torch.zeros(1, dtype=torch.float32))
    assert single.dtype == torch.float32 and workspace["a"].dtype == torch.float32


def test_outputs_into_given_buffers(generator: torch.Generator) -> None:
    factors, dense = _factors(generator)
    out = torch.full((32,), float("nan"), dtype=F64)
    assert sq_diag(factors, out=out) is out
    torch.testing.assert_close(out, dense.square().sum(1))
    assert factors.grad_sum(out=out) is out
    torch.testing.assert_close(out, dense.sum(1))


def _logreg_factors(generator: torch.Generator, n_samples: int, n: int, n_features: int) -> PerExampleFactors:
    from bdl_bench.likelihoods import Bernoulli
    from bdl_bench.models import build_model

    model = build_model({"name": "logreg", "bias": True}, in_features=n_features, out_features=1).to(F64)
    x = torch.randn(n, n_features, generator=generator, dtype=F64)
    y = torch.randint(0, 2, (n,), generator=generator).to(F64)
    thetas = torch.randn(n_samples, n_features + 1, generator=generator, dtype=F64)
    return linear_factors(model, thetas, x, y, Bernoulli())


@pytest.mark.parametrize("path", ["gram", "dense"])
@pytest.mark.parametrize("shape", [(3, 5, 12), (4, 30, 6)], ids=["D>L+M", "D<L+M"])
def test_logistic_regression_merges_samples_into_m_columns(
    path: str, shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch, generator: torch.Generator
) -> None:
    """One linear layer with one output: the update runs on M merged columns (gram.merge_samples) and
    gives the unmerged S·M-column update, eigenvector signs included."""
    n_samples, n, n_features = shape
    factors = _logreg_factors(generator, n_samples, n, n_features)
    merged = gram.merge_samples(factors)
    assert merged is not None and merged.n_columns == n
    dense = factors.dense()
    torch.testing.assert_close(gram_matrix(merged).trace(), (dense.mT @ dense).trace())
    torch.testing.assert_close(merged.dense() @ merged.dense().mT, dense @ dense.mT)
    u = torch.randn(n_features + 1, 2, generator=generator, dtype=F64)
    kwargs = dict(old_weight=0.9, new_weight=0.4, path=path)
    update = low_rank_update(factors, u, **kwargs)
    monkeypatch.setattr(gram, "merge_samples", lambda f: None)
    unmerged = low_rank_update(factors, u, **kwargs)
    for name in ("prec_factor", "eigenvalues", "factor_sqnorms", "diag_residual"):
        torch.testing.assert_close(getattr(update, name), getattr(unmerged, name), msg=name)
    ref_factor, ref_residual = dense_low_rank_update(dense, u, old_weight=0.9, new_weight=0.4)
    _projector_check(update.prec_factor, ref_factor)
    torch.testing.assert_close(update.diag_residual, ref_residual)


def test_merge_samples_does_not_apply_to_networks_or_one_sample(generator: torch.Generator) -> None:
    assert gram.merge_samples(_factors(generator, n_samples=3)[0]) is None  # two layers, two outputs
    assert gram.merge_samples(_logreg_factors(generator, 1, 5, 4)) is None  # S = 1: nothing to merge


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "k"), [(9, 1), (30, 5), (40, 40)])
def test_top_eigenpairs_equal_torch_eigh(n: int, k: int, dtype: torch.dtype, generator: torch.Generator) -> None:
    """LAPACK's ?syevr on the k top pairs (the update's fast path) against torch.linalg.eigh of all n, on a
    positive semi-definite matrix of rank n - 2 (SLANG's B^T B is rank-deficient when D < L + P)."""
    from bdl_bench.curvature.gram import top_eigenpairs

    factor = torch.randn(n, n - 2, generator=generator, dtype=dtype)
    matrix = factor @ factor.mT
    evals, evecs = torch.linalg.eigh(matrix)
    values, vectors = top_eigenpairs(matrix.clone(), k)
    eps = torch.finfo(dtype).eps
    scale = float(evals[-1])
    torch.testing.assert_close(values, evals[-k:].flip(0), rtol=0.0, atol=100 * eps * scale)
    assert vectors.shape == (n, k) and vectors.is_contiguous()
    torch.testing.assert_close(vectors.mT @ vectors, torch.eye(k, dtype=dtype), rtol=0.0, atol=100 * eps * n)
    torch.testing.assert_close(matrix @ vectors, vectors * values, rtol=0.0, atol=100 * eps * scale * n)
