"""Every StructuredGaussian against dense linear algebra (float64, D=7, L=2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributions import MultivariateNormal
from torch.testing import assert_close

from bdl_bench.gaussians import LinearMoments, StructuredGaussian

from .conftest import DIM, KINDS, MakeGaussian


def dense_precision(g: StructuredGaussian) -> torch.Tensor:
    return g.to_dense().precision


def dense_covariance(g: StructuredGaussian) -> torch.Tensor:
    return torch.linalg.inv(dense_precision(g))


def reference(g: StructuredGaussian) -> MultivariateNormal:
    return MultivariateNormal(g.mean, precision_matrix=dense_precision(g))


def test_dim_dtype_device(gaussian: StructuredGaussian) -> None:
    assert gaussian.dim == DIM
    assert gaussian.dtype == torch.float64
    assert gaussian.device == torch.device("cpu")
    assert type(gaussian).__name__ in repr(gaussian) and "D=7" in repr(gaussian)


def test_frozen(gaussian: StructuredGaussian) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        gaussian.mean = torch.zeros(DIM, dtype=torch.float64)  # type: ignore[misc]


def test_to_dense_is_same_distribution(gaussian: StructuredGaussian) -> None:
    dense = gaussian.to_dense()
    assert_close(dense.mean, gaussian.mean)
    assert_close(dense.precision, dense.precision.mT)
    assert_close(dense.logdet_precision(), gaussian.logdet_precision())


@pytest.mark.parametrize("n_cols", [None, 3])
def test_precision_matvec(gaussian: StructuredGaussian, generator: torch.Generator, n_cols: int | None) -> None:
    shape = (DIM,) if n_cols is None else (DIM, n_cols)
    v = torch.randn(shape, generator=generator, dtype=torch.float64)
    out = gaussian.precision_matvec(v)
    assert out.shape == v.shape
    assert_close(out, dense_precision(gaussian) @ v)


@pytest.mark.parametrize("n_cols", [None, 3])
def test_solve(gaussian: StructuredGaussian, generator: torch.Generator, n_cols: int | None) -> None:
    shape = (DIM,) if n_cols is None else (DIM, n_cols)
    v = torch.randn(shape, generator=generator, dtype=torch.float64)
    out = gaussian.solve(v)
    assert out.shape == v.shape
    assert_close(out, torch.linalg.solve(dense_precision(gaussian), v))
    assert_close(gaussian.precision_matvec(out), v)


@pytest.mark.parametrize("shape", [(DIM + 1,), (DIM, 2, 1), (2, DIM)])
def test_bad_rhs_shape(gaussian: StructuredGaussian, shape: tuple[int, ...]) -> None:
    v = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="D=7"):
        gaussian.solve(v)
    with pytest.raises(ValueError, match="D=7"):
        gaussian.precision_matvec(v)


def test_logdet_precision(gaussian: StructuredGaussian) -> None:
    assert_close(gaussian.logdet_precision(), torch.logdet(dense_precision(gaussian)))


def test_variance(gaussian: StructuredGaussian) -> None:
    assert_close(gaussian.variance(), dense_covariance(gaussian).diagonal())


def test_linear_moments(gaussian: StructuredGaussian, generator: torch.Generator) -> None:
    x = torch.randn(11, DIM, generator=generator, dtype=torch.float64)
    moments = gaussian.linear_moments(x)
    assert isinstance(moments, LinearMoments)
    assert_close(moments.mean, x @ gaussian.mean)
    assert_close(moments.variance, (x @ dense_covariance(gaussian) @ x.mT).diagonal())
    generic = StructuredGaussian.linear_moments(gaussian, x)  # the base's solve-based version
    assert_close(generic.variance, moments.variance)
    with pytest.raises(ValueError, match="D=7"):
        gaussian.linear_moments(x[:, :-1])


def test_sample_transform_is_exact_square_root(gaussian: StructuredGaussian) -> None:
    """rsample's linear map applied to the identity gives A^T, and A A^T = Sigma."""
    eye = torch.eye(DIM, dtype=torch.float64)
    a_transposed = gaussian._sample_transform(eye) - gaussian.mean
    assert_close(a_transposed.mT @ a_transposed, dense_covariance(gaussian))


def test_rsample_monte_carlo_moments(gaussian: StructuredGaussian, generator: torch.Generator) -> None:
    n = 200_000
    samples = gaussian.rsample(n, generator)
    assert samples.shape == (n, DIM) and samples.dtype == torch.float64
    cov = dense_covariance(gaussian)
    var = cov.diagonal()
    # Standard errors of the sample mean and of each sample-covariance entry; allow 5 of them.
    mean_se = (var / n).sqrt().max().item()
    cov_se = ((var[:, None] * var[None, :] + cov.square()) / n).sqrt().max().item()
    assert_close(samples.mean(0), gaussian.mean, atol=5 * mean_se, rtol=0)
    assert_close(torch.cov(samples.mT), cov, atol=5 * cov_se, rtol=0)


def test_rsample_uses_only_the_generator(gaussian: StructuredGaussian) -> None:
    first = gaussian.rsample(4, torch.Generator().manual_seed(3))
    second = gaussian.rsample(4, torch.Generator().manual_seed(3))
    assert_close(first, second, rtol=0, atol=0)
    assert gaussian.rsample(0).shape == (0, DIM)
    with pytest.raises(ValueError, match="n_samples"):
        gaussian.rsample(-1)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_matches_float64(make_gaussian: MakeGaussian, kind: str) -> None:
    g64 = make_gaussian(kind)
    fields = {f.name: getattr(g64, f.name).float() for f in dataclasses.fields(g64)}
    g32 = type(g64)(**fields)
    v = torch.linspace(-1.0, 1.0, DIM, dtype=torch.float64)
    x = torch.stack([v, v.flip(0)])
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for name, out32, out64 in [
        ("solve", g32.solve(v.float()), g64.solve(v)),
        ("matvec", g32.precision_matvec(v.float()), g64.precision_matvec(v)),
        ("logdet", g32.logdet_precision(), g64.logdet_precision()),
        ("variance", g32.variance(), g64.variance()),
        ("linear_var", g32.linear_moments(x.float()).variance, g64.linear_moments(x).variance),
        ("sample", g32._sample_transform(x.float()), g64._sample_transform(x)),
    ]:
        assert out32.dtype == torch.float32, name
        assert_close(out32.double(), out64, **tol, msg=lambda m, name=name: f"{name}: {m}")
    assert g32.rsample(3).dtype == torch.float32


def test_rsample_is_differentiable(make_gaussian: MakeGaussian, generator: torch.Generator) -> None:
    g = make_gaussian("low_rank")
    factor = g.prec_factor.clone().requires_grad_(True)  # type: ignore[attr-defined]
    rebuilt = type(g)(g.mean, factor, g.prec_diag)  # type: ignore[attr-defined]
    rebuilt.rsample(8, generator).square().sum().backward()
    assert factor.grad is not None and torch.isfinite(factor.grad).all()
