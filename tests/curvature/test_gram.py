"""The Gram-trick products and SLANG's top-L update against materialised G and a D x D ``eigh``."""

from __future__ import annotations

import pytest
import torch
from _dense import dense_low_rank_update, per_example_gradients

from bdl_bench.curvature import LinearLayout, factor_cross, gram, gram_blocks, linear_layout
from bdl_bench.curvature.gram import low_rank_update as stacked_low_rank_update
from bdl_bench.curvature.stacked import (
    StackedFactors,
    gradient_columns,
    gradient_sum,
    squared_gradient_sum,
    stacked_factors,
)
from bdl_bench.likelihoods import Categorical
from bdl_bench.models.mlp import mlp

F64 = torch.float64


class Factors(StackedFactors):
    """The layer factors of one copy (a single run) with their network's layout, as the tests pass them."""

    layout: LinearLayout

    @property
    def n_columns(self) -> int:
        return self.losses.numel()


def _one(model, thetas: torch.Tensor, x: torch.Tensor, y: torch.Tensor, likelihood) -> Factors:
    """The factors of a stack of one copy at the samples ``thetas`` ``(S, D)`` (first input shared)."""
    layout = linear_layout(model)
    f = stacked_factors(model, layout, thetas[None], x[None], y[None], [likelihood], share_first_input=True)
    factors = Factors(f.inputs, f.output_grads, f.losses, f.outputs, f.first_input_shared)
    object.__setattr__(factors, "layout", layout)
    return factors


def low_rank_update(factors: Factors, u: torch.Tensor, **kwargs):
    """:func:`gram.low_rank_update` of one copy, ``(D, L)`` in and out (``out`` and the cache likewise)."""
    for key in ("out", "factor_gram", "factor_sqnorms", "sqnorms_out"):
        if kwargs.get(key) is not None:
            kwargs[key] = kwargs[key][None]
    update = stacked_low_rank_update(factors, factors.layout, u[None], **kwargs)
    return type(update)(
        *(getattr(update, f)[0] for f in ("prec_factor", "eigenvalues", "factor_sqnorms", "diag_residual"))
    )


def _factors(generator: torch.Generator, n_samples: int = 1, n: int = 7) -> tuple[Factors, torch.Tensor]:
    """Factors of a 3-5-2 tanh MLP (D = 32) at random parameters, and the dense G they stand for."""
    torch.manual_seed(0)
    model = mlp(in_features=3, out_features=2, hidden=[5], activation="tanh").to(F64)
    x = torch.randn(n, 3, generator=generator, dtype=F64)
    y = torch.randint(0, 2, (n,), generator=generator)
    thetas = torch.randn(n_samples, 32, generator=generator, dtype=F64)
    return _one(model, thetas, x, y, Categorical()), per_example_gradients(model, thetas, x, y, Categorical())


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
    layout = factors.layout
    torch.testing.assert_close(gram_blocks(factors, layout, factors.n_columns)[0][0], dense.mT @ dense)
    torch.testing.assert_close(factor_cross(factors, layout, vectors.mT[None])[0], dense.mT @ vectors)
    torch.testing.assert_close(squared_gradient_sum(factors, layout)[0], dense.square().sum(1))


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
    factors.output_grads[0][0, 2, 1] = float("nan")
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
    u = gram.empty_columns_first(1, 32, 3, like=factors.losses)[0].copy_(
        torch.randn(32, 3, generator=generator, dtype=F64)
    )
    kwargs = dict(old_weight=0.8, new_weight=0.3, path="gram")
    reference = low_rank_update(factors, u.clone(), **kwargs)
    out = {
        "new": None,
        "column_major_out": gram.empty_columns_first(1, 32, 3, like=u)[0],
        "row_major_out": torch.empty(32, 3, dtype=F64),
        "in_place": u,
    }[layout]
    update = low_rank_update(factors, u, **kwargs, out=out)
    if out is not None:
        assert update.prec_factor.data_ptr() == out.data_ptr()
    torch.testing.assert_close(update.prec_factor, reference.prec_factor)
    torch.testing.assert_close(update.diag_residual, reference.diag_residual)


def test_column_sqnorms(generator: torch.Generator) -> None:
    m = torch.randn(11, 4, generator=generator, dtype=F64)
    torch.testing.assert_close(gram.column_sqnorms(m[None])[0], m.square().sum(1))
    columns = gram.empty_columns_first(1, 11, 4, like=m).copy_(m[None])
    torch.testing.assert_close(gram.column_sqnorms(columns)[0], m.square().sum(1))


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
        sqnorms = torch.full((1, 32), float("nan"), dtype=F64)
        gram.combine_rows(
            factors,
            factors.layout,
            coeffs[None],
            source[None],
            dst[None],
            alpha=0.7,
            mixing=None if mixing is None else mixing[None],
            sqnorms=sqnorms,
            workspace=workspace,
        )
        torch.testing.assert_close(dst.mT, expected)
        torch.testing.assert_close(sqnorms[0], expected.square().sum(1))
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
    out = torch.full((1, 32), float("nan"), dtype=F64)
    assert squared_gradient_sum(factors, factors.layout, out=out) is out
    torch.testing.assert_close(out[0], dense.square().sum(1))
    assert gradient_sum(factors, factors.layout, out=out) is out
    torch.testing.assert_close(out[0], dense.sum(1))


def _logreg_factors(generator: torch.Generator, n_samples: int, n: int, n_features: int) -> Factors:
    from bdl_bench.likelihoods import Bernoulli
    from bdl_bench.models import build_model

    model = build_model({"name": "logreg", "bias": True}, in_features=n_features, out_features=1).to(F64)
    x = torch.randn(n, n_features, generator=generator, dtype=F64)
    y = torch.randint(0, 2, (n,), generator=generator).to(F64)
    thetas = torch.randn(n_samples, n_features + 1, generator=generator, dtype=F64)
    return _one(model, thetas, x, y, Bernoulli())


@pytest.mark.parametrize("path", ["gram", "dense"])
@pytest.mark.parametrize("shape", [(3, 5, 12), (4, 30, 6)], ids=["D>L+M", "D<L+M"])
def test_logistic_regression_merges_samples_into_m_columns(
    path: str, shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch, generator: torch.Generator
) -> None:
    """One linear layer with one output: the update runs on M merged columns (gram.merge_samples) and
    gives the unmerged S·M-column update, eigenvector signs included."""
    n_samples, n, n_features = shape
    factors = _logreg_factors(generator, n_samples, n, n_features)
    layout = factors.layout
    merged = gram.merge_samples(factors, layout)
    assert merged is not None and merged.output_grads[0].shape[1] == n
    dense, merged_dense = (gradient_columns(f, layout)[0].mT for f in (factors, merged))
    torch.testing.assert_close(gram_blocks(merged, layout, n)[0][0].trace(), (dense.mT @ dense).trace())
    torch.testing.assert_close(merged_dense @ merged_dense.mT, dense @ dense.mT)
    u = torch.randn(n_features + 1, 2, generator=generator, dtype=F64)
    kwargs = dict(old_weight=0.9, new_weight=0.4, path=path)
    update = low_rank_update(factors, u, **kwargs)
    monkeypatch.setattr(gram, "merge_samples", lambda f, layout: None)
    unmerged = low_rank_update(factors, u, **kwargs)
    for name in ("prec_factor", "eigenvalues", "factor_sqnorms", "diag_residual"):
        torch.testing.assert_close(getattr(update, name), getattr(unmerged, name), msg=name)
    ref_factor, ref_residual = dense_low_rank_update(dense, u, old_weight=0.9, new_weight=0.4)
    _projector_check(update.prec_factor, ref_factor)
    torch.testing.assert_close(update.diag_residual, ref_residual)


def test_merge_samples_does_not_apply_to_networks_or_one_sample(generator: torch.Generator) -> None:
    mlp_factors, logreg_factors = _factors(generator, n_samples=3)[0], _logreg_factors(generator, 1, 5, 4)
    assert gram.merge_samples(mlp_factors, mlp_factors.layout) is None  # two layers, two outputs
    assert gram.merge_samples(logreg_factors, logreg_factors.layout) is None  # S = 1: nothing to merge


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "k"), [(9, 1), (30, 5), (40, 40)])
def test_top_eigenpairs_equal_torch_eigh(n: int, k: int, dtype: torch.dtype, generator: torch.Generator) -> None:
    """LAPACK's ?syevr on the k top pairs (one matrix on the host) against torch.linalg.eigh of all n, on a
    positive semi-definite matrix of rank n - 2 (SLANG's B^T B is rank-deficient when D < L + P)."""
    from bdl_bench.curvature.eigen import top_eigenpairs

    factor = torch.randn(n, n - 2, generator=generator, dtype=dtype)
    matrix = factor @ factor.mT
    evals, evecs = torch.linalg.eigh(matrix)
    values, vectors = (t[0] for t in top_eigenpairs(matrix.clone()[None], k))
    eps = torch.finfo(dtype).eps
    scale = float(evals[-1])
    torch.testing.assert_close(values, evals[-k:].flip(0), rtol=0.0, atol=100 * eps * scale)
    assert vectors.shape == (n, k) and vectors.is_contiguous()
    torch.testing.assert_close(vectors.mT @ vectors, torch.eye(k, dtype=dtype), rtol=0.0, atol=100 * eps * n)
    torch.testing.assert_close(matrix @ vectors, vectors * values, rtol=0.0, atol=100 * eps * scale * n)


@pytest.mark.parametrize("n_samples", [1, 3])
def test_a_stack_of_copies_equals_each_copy_alone(n_samples: int, chunking: bool, generator: torch.Generator) -> None:
    """The blocked passes (per copy and group of vectors) and the packed ones (all copies at once) of a stack of
    three copies (own parameters and data each) give each copy's products and update as a stack of one."""
    torch.manual_seed(0)
    model = mlp(in_features=3, out_features=2, hidden=[5], activation="tanh").to(F64)
    layout = linear_layout(model)
    x = torch.randn(3, 7, 3, generator=generator, dtype=F64)
    y = torch.randint(0, 2, (3, 7), generator=generator)
    thetas = torch.randn(3, n_samples, 32, generator=generator, dtype=F64)
    stack = stacked_factors(model, layout, thetas, x, y, [Categorical()] * 3, share_first_input=True)
    u = torch.randn(3, 32, 4, generator=generator, dtype=F64)
    coeffs = torch.randn(3, 7 * n_samples, 4, generator=generator, dtype=F64)
    cross = factor_cross(stack, layout, u.mT.contiguous())
    combined = torch.empty(3, 4, 32, dtype=F64)
    gram.combine_rows(stack, layout, coeffs, u.mT.contiguous(), combined, alpha=0.3, mixing=u[:, :4])
    update = stacked_low_rank_update(stack, layout, u, old_weight=0.9, new_weight=0.2, path="gram")
    for r in range(3):
        one = _one(model, thetas[r], x[r], y[r], Categorical())
        torch.testing.assert_close(cross[r], factor_cross(one, layout, u[r].mT[None])[0])
        alone = torch.empty(1, 4, 32, dtype=F64)
        gram.combine_rows(one, layout, coeffs[r : r + 1], u[r : r + 1].mT, alone, alpha=0.3, mixing=u[r : r + 1, :4])
        torch.testing.assert_close(combined[r], alone[0])
        single = low_rank_update(one, u[r], old_weight=0.9, new_weight=0.2, path="gram")
        _projector_check(update.prec_factor[r], single.prec_factor)
        torch.testing.assert_close(update.diag_residual[r], single.diag_residual)
