"""k-tied Normal: the std matrix U Vᵀ, the Khatri–Rao variance, Table 1's parameter counts, bad k."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _vi_helpers import make_method, make_problem, weight_stds
from torch.testing import assert_close

from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.likelihoods import Categorical, Gaussian
from bdl_bench.methods._diag_vi import kl_diag_to_prior
from bdl_bench.methods.ktied import khatri_rao_square, ktied_param_count, ktied_variance

MNIST_MLP = {"name": "mlp", "hidden": [400, 400], "activation": "relu"}


def test_khatri_rao_variance_equals_the_dense_product() -> None:
    g = torch.Generator().manual_seed(0)
    dt = torch.float64
    a = torch.randn(2, 5, 7, generator=g, dtype=dt)  # (S, N, in)
    u, v = torch.rand(3, 7, generator=g, dtype=dt), torch.rand(3, 4, generator=g, dtype=dt)  # U^T, V^T
    assert khatri_rao_square(u).shape == (9, 7)
    assert_close(ktied_variance(a, u, v), F.linear(a**2, (v.T @ u) ** 2))
    bias_var = torch.rand(4, generator=g, dtype=dt)
    for x in (a, a[0]):  # with a bias variance: in the addmm for 2-d inputs, added for batched ones
        assert_close(ktied_variance(x, u, v, bias_var), F.linear(x**2, (v.T @ u) ** 2, bias_var))


def test_std_matrix_is_the_product_of_positive_factors() -> None:
    problem = make_problem(3, Gaussian(noise_precision=1.0), seed=0)  # 3 → 24 → 24 → 1
    method = make_method("ktied", k=2, init_std=0.05)
    method.setup(problem)
    stds = weight_stds(method)
    assert [s.shape for s in stds] == [(24, 3), (24, 24), (1, 24)]
    for layer, std in zip(method.layers, stds):
        u = F.softplus(method.variational[f"u{layer.index}"])
        v = F.softplus(method.variational[f"v{layer.index}"])
        assert u.shape == (min(2, layer.in_features, layer.out_features), layer.in_features)
        assert_close(std, v.T @ u)
        assert bool((std > 0).all())
        # initialised so that the stds have mean init_std, each one up to the small symmetry-breaking jitter
        assert float(std.mean()) == pytest.approx(0.05, rel=1e-5)
        assert 0.5 * 0.05 < float(std.min()) and float(std.max()) < 2 * 0.05
    u1 = method.variational["u2"]
    assert not torch.allclose(u1[0], u1[1])  # the k columns of U differ (they would stay equal otherwise)
    q = method.posterior()
    assert isinstance(q, DiagGaussian)
    flat_std = q.variance().sqrt()
    parts = method.split_params(flat_std)
    for layer, std in zip(method.layers, stds):
        assert_close(parts[layer.weight_param], std)
        assert_close(parts[layer.bias_param], torch.full((layer.out_features,), 0.05))
    assert_close(method.kl_to_prior(), kl_diag_to_prior(q.mean, flat_std, problem.prior_precision))


@pytest.mark.parametrize(("k", "paper_k_params"), [(1, 482), (2, 484), (3, 486)])
def test_parameter_counts_of_table_1_and_the_mnist_mlp(k: int, paper_k_params: int) -> None:
    """Table 1: mn + k(m + n) per weight matrix (+ mean and std of each bias); Table 3 (MNIST MLP) in thousands."""
    assert ktied_param_count(784, 400, k) == 784 * 400 + k * (784 + 400)
    problem = make_problem(784, Categorical(), seed=0, out_features=10, model_cfg=MNIST_MLP)
    method = make_method("ktied", k=k)
    method.setup(problem)
    widths = [(784, 400), (400, 400), (400, 10)]
    expected = sum(ktied_param_count(m, n, k) + 2 * n for m, n in widths)
    assert method.n_variational_params() == expected
    assert round(expected / 1000) == paper_k_params
    gmfvi = make_method("gmfvi")
    gmfvi.setup(problem)
    assert round(gmfvi.n_variational_params() / 1000) == 957  # mean field


@pytest.mark.parametrize(
    ("k", "message"),
    [
        (0, r"method\.k=0 is out of range: it must be an integer >= 1"),
        (1.5, "method.k=1.5"),
        ("two", "method.k='two' is not a number"),
    ],
)
def test_bad_k_raises_at_construction(k: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_method("ktied", k=k)


def test_k_above_every_layer_rank_raises_at_setup() -> None:
    problem = make_problem(3, Gaussian(noise_precision=1.0), seed=0)  # largest min(in, out) is 24
    with pytest.raises(ValueError, match=r"k=25 exceeds .* \(24; 0\.weight 3→24, 2\.weight 24→24, 4\.weight 24→1\)"):
        make_method("ktied", k=25).setup(problem)
    make_method("ktied", k=24).setup(problem)  # the largest that any layer allows is fine
