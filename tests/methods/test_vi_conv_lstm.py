"""gmfvi and ktied on convolutional and LSTM models: the sampled convolution outputs against explicit weight
sampling, gradients and the closed-form KL through an LSTM, k-tied convolution kernels and parameter counts,
errors, and train/predict smoke runs (unit level and through the runner on tiny generated archives)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _archives import register_archive, write_cifar_archive, write_imdb_archive
from _vi_helpers import make_method, weight_stds
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.testing import assert_close

from bdl_bench.data.cifar import CIFAR100
from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian
from bdl_bench.methods._layerwise_vi import conv2d_per_sample
from bdl_bench.methods.base import Method, Problem
from bdl_bench.methods.ktied import ktied_param_count
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector, unflatten
from bdl_bench.orchestration.runner import run

# (kind, overrides): mean-field, k-tied with mean-field convolutions (the paper's CNN), k-tied convolutions
VARIANTS = {
    "gmfvi": ("gmfvi", {}),
    "ktied": ("ktied", {}),
    "ktied_conv": ("ktied", {"tie_conv": True}),
}
TINY_CNN = {"name": "cnn_ktied", "image_size": 8, "channels": [2, 3], "hidden": 5}
TINY_LSTM = {"name": "lstm", "vocab_size": 7, "embedding_dim": 3, "hidden_size": 2}


def _build(model_cfg: dict, seed: int = 0, **kwargs: int) -> nn.Module:
    """``build_model`` with PyTorch's default initialisation drawn under ``seed`` (the global RNG is restored)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_model(model_cfg, **kwargs)


def _problem(model: nn.Module, likelihood, seed: int = 0, dtype: torch.dtype = torch.float32) -> Problem:
    model = model.to(dtype)
    prior = prior_precision_vector(model, 1.0, None)
    return Problem(
        model=model,
        likelihood=likelihood,
        n_data=50,
        prior_precision=prior,
        generator=torch.Generator().manual_seed(seed),
    )


def _setup(variant: str, problem: Problem, **overrides: object) -> Method:
    kind, extra = VARIANTS[variant]
    method = make_method(kind, **{**extra, **overrides})
    method.setup(problem)
    return method


def _conv_problem(seed: int = 0) -> Problem:
    """One convolution (2 → 4 channels, 3×3, stride 2, zero padding 1) on 5×5 images, flattened: 36 outputs."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.Flatten())
    return _problem(model, Gaussian(noise_precision=1.0), dtype=torch.float64)


def _local_and_explicit(method: Method, x: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``n`` training-path outputs and ``n`` outputs of explicitly sampled whole weight vectors ``(n, N, out)``
    (the latter through ``functional_call``, independently of the method's own forward code)."""
    model = method.problem.model
    with torch.no_grad():
        terms = method._step_terms(with_kl=False)
        local = method._outputs_local(terms, x, n)
        thetas = method._sample_params(terms, n)
        explicit = vmap(lambda theta: functional_call(model, unflatten(model, theta), (x,)))(thetas)
    return local, explicit


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_local_conv_outputs_have_the_moments_of_weight_sampling(variant: str) -> None:
    """Every output element of a convolution with Gaussian weights is Gaussian; the local reparameterisation
    draws it from the same mean and variance as explicit weight sampling.

    Tolerances, n = 40,000 draws on each side, 180 output elements: two independent sample means differ by
    :math:`\\sigma\\sqrt{2/n}` (std), so 5 of those per element; two sample variances of Gaussians differ by a
    relative :math:`\\sqrt{4/n}` = 1 % (std), so 5 % is again 5 standard deviations."""
    method = _setup(variant, _conv_problem(), init_std=0.3)
    x = torch.randn(5, 2, 5, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    n = 40_000
    local, explicit = _local_and_explicit(method, x, n)
    assert local.shape == explicit.shape == (n, 5, 36)
    std = explicit.std(0)
    assert bool((local.mean(0) - explicit.mean(0)).abs().le(5 * std * math.sqrt(2 / n)).all())
    assert_close(local.var(0), explicit.var(0), rtol=0.05, atol=0)


def _position_covariance(f: Tensor) -> Tensor:
    """Covariance across samples of the first two positions of channel 0, per example: ``(N,)``."""
    a, b = f[..., 0], f[..., 1]
    return ((a - a.mean(0)) * (b - b.mean(0))).mean(0)


def test_conv_estimators_within_one_feature_map() -> None:
    """Positions of one feature map share the kernel: under q they are correlated. The local estimator
    samples them independently (its documented approximation); ``conv_estimator="reparam"`` keeps the
    correlation, so its outputs have the joint law of weight sampling."""
    problem = _conv_problem()
    x = torch.rand(3, 2, 5, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 1  # positive
    n = 40_000  # tolerances as in the test above: 5 % is 5 standard deviations of a variance estimate
    local, explicit = _local_and_explicit(_setup("gmfvi", problem, init_std=0.3), x, n)
    exact, _ = _local_and_explicit(_setup("gmfvi", problem, init_std=0.3, conv_estimator="reparam"), x, n)
    var = explicit[..., 0].var(0)  # the covariance below is a sizeable fraction of it
    cov_explicit = _position_covariance(explicit)
    assert bool((cov_explicit > 0.5 * var).all())  # about 0.95 here: strongly correlated
    assert bool((_position_covariance(local).abs() < 0.05 * var).all())  # its sampling std: var / sqrt(n) = 0.5 %
    assert_close(_position_covariance(exact), cov_explicit, rtol=0, atol=float(0.05 * var.max()))
    assert_close(exact.var(0), explicit.var(0), rtol=0.05, atol=0)


def test_grouped_per_sample_convolution_matches_a_loop() -> None:
    method = _setup("gmfvi", _conv_problem())
    layer = method.layers[0]
    g = torch.Generator().manual_seed(3)
    h = torch.randn(3 * 4, 2, 5, 5, generator=g, dtype=torch.float64)  # S = 3 stacked minibatches of 4
    weight = torch.randn(3, 4, 2, 3, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(3, 4, generator=g, dtype=torch.float64)
    loop = torch.cat([F.conv2d(h[4 * s : 4 * s + 4], weight[s], bias[s], stride=2, padding=1) for s in range(3)])
    assert_close(conv2d_per_sample(layer, h, weight, bias), loop)


def _lstm_problem(seed: int = 0) -> Problem:
    return _problem(_build(TINY_LSTM, seed, in_features=6, out_features=1), Bernoulli(), seed=seed)


def _tokens(seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 7, (8, 6), generator=g)
    x[:4, :2] = 0  # front padding
    return x, torch.randint(0, 2, (8,), generator=g).float()


@pytest.mark.parametrize("variant", ["gmfvi", "ktied"])
def test_lstm_gradients_reach_means_and_stds_and_the_kl_is_closed_form(variant: str) -> None:
    problem = _lstm_problem()
    method = _setup(variant, problem, n_train_mc_samples=2)
    assert not method.local  # not an nn.Sequential: one weight draw per minibatch and MC sample
    x, y = _tokens(0)
    method.train_step(x, y)
    mean_grads = dict(zip([n for n, _ in problem.model.named_parameters()], method.split_params(method.mean.grad)))
    for name in ("lstm.weight_ih_l0", "lstm.weight_hh_l0", "lstm.bias_ih_l0", "head.weight"):
        assert float(mean_grads[name].abs().min()) > 0, name
    assert float(mean_grads["embedding.weight"][1:].abs().sum(1).min()) > 0  # every used token's row
    # std parameters: rho of every weight (gmfvi), U and V of both LSTM kernels (ktied)
    if variant == "gmfvi":
        std_grads = dict(zip(mean_grads, method.split_params(method.rho.grad)))
        assert float(std_grads["lstm.weight_ih_l0"].abs().min()) > 0
        assert float(std_grads["lstm.weight_hh_l0"].abs().min()) > 0
    else:
        lstm = method.layers[1]
        assert isinstance(lstm.module, nn.LSTM)
        for key in ("u2_weight_ih_l0", "v2_weight_ih_l0", "u2_weight_hh_l0", "v2_weight_hh_l0"):
            assert float(method.variational[key].grad.abs().min()) > 0, key
        assert method.variational["rho1_weight"].shape == (7, 3)  # the embedding stays mean-field
    # the padding row of the embedding is the deterministic model's zero vector: no gradient, no noise
    assert float(mean_grads["embedding.weight"][0].abs().sum()) == 0
    samples = method.predict(x, 4)
    assert samples.shape == (4, 8, 1) and not torch.allclose(samples[0], samples[1])
    q = method.posterior()
    assert isinstance(q, DiagGaussian)
    prior = DiagGaussian(mean=torch.zeros_like(q.mean), prec_diag=problem.prior_precision)
    assert_close(method.kl_to_prior(), q.kl(prior))


def test_lstm_sampled_weights_have_the_posterior_moments() -> None:
    """The weights the LSTM path runs on are mu + sigma * eps (padding row: mu)."""
    method = _setup("ktied", _lstm_problem(), init_std=0.2)
    with torch.no_grad():
        thetas = method._draw_params(method._step_terms(with_kl=False), 20_000)
    std = method.posterior().variance().sqrt()
    padding = method.noise_free
    assert padding is not None and int(padding.sum()) == 3  # the embedding's row 0
    assert_close(thetas[:, padding], method.mean.detach()[padding].expand(20_000, -1), rtol=0, atol=0)
    # 5 standard errors: sigma / sqrt(n) for the mean, sigma^2 sqrt(2 / n) (1 %) for the variance
    assert bool(((thetas.mean(0) - method.mean.detach()).abs() <= 5 * std / math.sqrt(20_000)).all())
    assert_close(thetas.var(0)[~padding], std[~padding] ** 2, rtol=0.05, atol=0)


def test_ktied_conv_kernels_are_positive_products_reshaped() -> None:
    model = _build(TINY_CNN, in_features=3, out_features=4)
    method = _setup("ktied_conv", _problem(model, Categorical()), k=2, init_std=0.05)
    q = method.posterior()
    parts = method.split_params(q.variance().sqrt())
    conv_layers = [layer for layer in method.layers if isinstance(layer.module, nn.Conv2d)]
    stds = weight_stds(method)
    for layer, std in zip(conv_layers, stds):
        weight = layer.module.weight  # (C_out, C_in, 5, 5)
        u = F.softplus(method.variational[f"u{layer.index}"])  # U^T (k, C_in·25)
        v = F.softplus(method.variational[f"v{layer.index}"])  # V^T (k, C_out)
        assert u.shape == (2, weight[0].numel()) and v.shape == (2, weight.shape[0])
        assert_close(std, v.T @ u)  # (C_out, C_in·kh·kw)
        assert_close(parts[layer.weight_param], (v.T @ u).view(weight.shape))
        assert float(std.mean()) == pytest.approx(0.05, rel=1e-5) and bool((std > 0).all())
    untied = _setup("ktied", _problem(_build(TINY_CNN, in_features=3, out_features=4), Categorical()))
    assert "u1" not in untied.variational and untied.variational["rho1_weight"].shape == (2, 3, 5, 5)


def _expected_count(method: Method, k: int) -> int:
    """Table 1's formula: per tied weight matrix (n outputs × m inputs) mn + k_l(m + n), k_l = min(k, m, n);
    2 per parameter elsewhere (mean and std)."""
    total = 0
    for layer in method.layers:
        for p in layer.module.parameters(recurse=False):
            if method.is_tied(layer) and p.dim() >= 2:
                n, m = p.shape[0], p[0].numel()
                total += ktied_param_count(m, n, min(k, m, n))
            else:
                total += 2 * p.numel()
    return total


@pytest.mark.parametrize(
    ("model_cfg", "tie_conv", "expected"),
    [
        # conv 3→2 and 2→3 (5×5): 2·(152 + 153); dense 12→5 and 5→4: 60 + 2·17 + 2·5 and 20 + 2·9 + 2·4
        (TINY_CNN, False, 610 + 104 + 46),
        # tied kernels, (2 × 75) and (3 × 50) at rank 2: 150 + 2·77 + 2·2 and 150 + 2·53 + 2·3
        (TINY_CNN, True, 308 + 262 + 104 + 46),
        # embedding 7×3: 2·21; kernels (8 × 3), (8 × 2) at rank 2: 24 + 2·11, 16 + 2·10; biases 2·16;
        # head (1 × 2) at rank 1: 2 + 3, bias 2
        (TINY_LSTM, False, 42 + 46 + 36 + 32 + 7),
    ],
    ids=["cnn", "cnn_tie_conv", "lstm"],
)
def test_parameter_counts_follow_the_formula(model_cfg: dict, tie_conv: bool, expected: int) -> None:
    model = _build(model_cfg, in_features=3, out_features=4 if model_cfg is TINY_CNN else 1)
    method = _setup("ktied", _problem(model, Categorical()), k=2, tie_conv=tie_conv)
    assert method.n_variational_params() == _expected_count(method, 2) == expected
    gmfvi = _setup("gmfvi", _problem(model, Categorical()))
    assert gmfvi.n_variational_params() == 2 * sum(p.numel() for p in model.parameters())


def test_cnn_parameter_counts_of_the_paper_table_3() -> None:
    """k-tied Table 3, CIFAR-100 LeNet: 4,405k (mean field), 2,262k / 2,273k (1- / 3-tied dense layers, mean-field
    convolutions). Our 2-tied count, 2,267,408, prints as 2,267k where the paper has 2,268k."""
    paper_cnn = {**TINY_CNN, "image_size": 32, "channels": [32, 64], "hidden": 512}
    model = _build(paper_cnn, in_features=3, out_features=100)
    problem = _problem(model, Categorical())
    assert round(_setup("gmfvi", problem).n_variational_params() / 1000) == 4405
    counts = {k: _setup("ktied", problem, k=k).n_variational_params() for k in (1, 2, 3)}
    assert {k: round(c / 1000) for k, c in counts.items()} == {1: 2262, 2: 2267, 3: 2273}


@pytest.mark.parametrize("k", [0, -1])
def test_k_below_one_raises(k: int) -> None:
    with pytest.raises(ValueError, match=rf"ktied: method\.k={k} is out of range: it must be an integer >= 1"):
        make_method("ktied", k=k)


def test_k_above_the_rank_of_every_tied_matrix_names_them() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3))  # on 5×5 images
    problem = _problem(model, Categorical())
    with pytest.raises(ValueError, match=r"k=4 exceeds .* \(3; 3\.weight 18→3\); choose 1 <= k <= 3"):
        _setup("ktied", problem, k=4)  # the convolution is mean-field: only the dense weight is tied
    with pytest.raises(ValueError, match=r"k=4 exceeds .* \(3; 0\.weight 9→2, 3\.weight 18→3\)"):
        _setup("ktied_conv", problem, k=4)
    method = _setup("ktied_conv", problem, k=3)  # allowed: the convolution then uses min(3, 9, 2) = 2
    assert method.variational["u1"].shape == (2, 9) and method.variational["u2"].shape == (3, 18)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("tie_conv", "yes", "tie_conv must be true or false"), ("conv_estimator", "flipout", "conv_estimator must be")],
)
def test_bad_conv_options_raise(option: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_method("ktied", **{option: value})
    if option == "conv_estimator":
        with pytest.raises(ValueError, match=message):
            make_method("gmfvi", **{option: value})


@pytest.mark.parametrize(
    ("model_cfg", "layer"), [(TINY_CNN, "layer 0 is Conv2d"), (TINY_LSTM, "layer embedding is Embedding")]
)
def test_elrg_names_the_layer_it_does_not_handle(model_cfg: dict, layer: str) -> None:
    model = _build(model_cfg, in_features=3, out_features=1)
    with pytest.raises(ValueError, match=f"elrg: handles nn.Linear and parameter-free modules only; {layer}"):
        make_method("elrg").setup(_problem(model, Bernoulli()))


def test_unsupported_layers_and_lstm_dropout_are_named() -> None:
    problem = _problem(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), Categorical())
    with pytest.raises(ValueError, match="layer 1 is BatchNorm2d"):
        make_method("gmfvi").setup(problem)
    lstm = _build(TINY_LSTM, in_features=6, out_features=1)
    lstm.lstm = nn.LSTM(3, 2, num_layers=2, dropout=0.5, batch_first=True)
    with pytest.raises(ValueError, match="dropout"):
        make_method("ktied").setup(dataclasses.replace(_lstm_problem(), model=lstm))


@pytest.mark.parametrize("conv_estimator", ["local", "reparam"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cnn_train_steps_and_predict(variant: str, conv_estimator: str) -> None:
    model = _build(TINY_CNN, in_features=3, out_features=4)
    method = _setup(
        variant, _problem(model, Categorical()), n_train_mc_samples=2, conv_estimator=conv_estimator, snr_window=2
    )
    assert method.local and not method.dense
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    state = torch.get_rng_state()
    before = method.mean.detach().clone()
    outs = [method.train_step(x, y) for _ in range(2)]
    assert all(math.isfinite(o["loss"]) and o["kl"] > 0 for o in outs)
    assert not torch.equal(method.mean.detach(), before)
    samples = method.predict(x, 3)
    assert samples.shape == (3, 6, 4) and bool(torch.isfinite(samples).all())
    assert torch.equal(torch.get_rng_state(), state)  # all noise from the problem's generator
    layers = {"l1", "l2", "l3", "l4"}
    assert set(method.snr.records[0][1]) == {"all", "median"} | layers | {f"median_{k}" for k in layers}


@pytest.mark.parametrize("variant", ["gmfvi", "ktied"])
def test_lstm_train_steps_and_predict(variant: str) -> None:
    method = _setup(variant, _lstm_problem(), snr_window=2)
    x, y = _tokens(1)
    state = torch.get_rng_state()
    outs = [method.train_step(x, y) for _ in range(2)]
    assert all(math.isfinite(o["loss"]) for o in outs)
    assert method.predict(x, 3).shape == (3, 8, 1)
    assert torch.equal(torch.get_rng_state(), state)
    layers = {"l1", "l2", "l3"}
    assert set(method.snr.records[0][1]) == {"all", "median"} | layers | {f"median_{k}" for k in layers}


# ---------------------------------------------------------------- through the runner, on tiny archives
def test_runner_ktied_on_the_cifar100_cnn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compose_cfg) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    register_archive(monkeypatch, CIFAR100.key, write_cifar_archive(mirror / "cifar-100-binary.tar.gz", CIFAR100, 12))
    cfg = compose_cfg(
        [
            "method=ktied",
            "data=vision/cifar100",
            "model=cnn_ktied",
            "model.channels=[2,3]",
            "model.hidden=4",
            "data.n_val=2",
            f"data.root={tmp_path / 'cache'}",
            f"data.mirror={mirror}",
            "trainer.batch_size=5",
            "method.n_train_mc_samples=2",
        ]
    )
    result = run(cfg, tmp_path / "run")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert math.isfinite(metrics["nll"]) and math.isfinite(metrics["elbo"]) and metrics == pytest.approx(result.metrics)


def test_runner_gmfvi_on_the_imdb_lstm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compose_cfg) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    archive = write_imdb_archive(mirror / "aclImdb_v1.tar.gz")
    register_archive(monkeypatch, "imdb/aclImdb_v1.tar.gz", archive, md5=True)
    cfg = compose_cfg(
        [
            "method=gmfvi",
            "data=text/imdb",
            "model=lstm",
            "data.vocab_size=6",
            "data.max_len=4",
            "data.n_val=1",
            f"data.root={tmp_path / 'cache'}",
            f"data.mirror={mirror}",
            "model.embedding_dim=3",
            "model.hidden_size=2",
        ]
    )
    result = run(cfg, tmp_path / "run")
    assert math.isfinite(result.metrics["nll"]) and math.isfinite(result.metrics["elbo"])
    assert result.metrics["n_params"] == 6 * 3 + 4 * 2 * (3 + 2 + 2) + 2 + 1
