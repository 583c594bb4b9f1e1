"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian
from bdl_bench.metrics import brier_score, expected_calibration_error, joint_test_ll, predictive_metrics


def test_ece_on_constructed_case() -> None:
    # Four predictions at confidence 0.9 (bin 14), three correct; two at 0.6 (bin 9), one correct.
    probs = torch.tensor([[0.9, 0.1]] * 4 + [[0.6, 0.4]] * 2)
    labels = torch.tensor([0, 0, 0, 1, 0, 1])
    expected = 4 / 6 * abs(0.75 - 0.9) + 2 / 6 * abs(0.5 - 0.6)
    assert math.isclose(expected_calibration_error(probs, labels), expected, rel_tol=1e-6)


def test_ece_zero_when_calibrated_and_bins_respected() -> None:
    probs = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert expected_calibration_error(probs, torch.tensor([0, 1])) == 0.0
    # Confidence exactly 1/15 * k falls into bin k-1; 0.5 is in bin 7 (not 8).
    probs = torch.tensor([[0.5, 0.5]])
    assert math.isclose(expected_calibration_error(probs, torch.tensor([0])), 0.5)


def test_brier_hand_computed() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    labels = torch.tensor([0, 1])
    expected = ((0.3**2 + 0.2**2 + 0.1**2) + (0.1**2 + 0.9**2 + 0.8**2)) / 2
    assert math.isclose(brier_score(probs, labels), expected, rel_tol=1e-6)


def test_gaussian_mixture_loglik_matches_direct_computation() -> None:
    g = torch.Generator().manual_seed(0)
    f = torch.randn(7, 5, 1, generator=g, dtype=torch.float64)
    y = torch.randn(5, generator=g, dtype=torch.float64)
    lik = Gaussian(noise_precision=2.0)
    direct = torch.zeros(5, dtype=torch.float64)
    for i in range(5):
        dens = [math.sqrt(2.0 / (2 * math.pi)) * math.exp(-0.5 * 2.0 * (f[s, i, 0] - y[i]) ** 2) for s in range(7)]
        direct[i] = math.log(sum(dens) / 7)
    assert_close(lik.log_predictive(f, y), direct)


def test_regression_metrics_in_original_units() -> None:
    g = torch.Generator().manual_seed(1)
    f = torch.randn(4, 6, 1, generator=g, dtype=torch.float64)
    y = torch.randn(6, generator=g, dtype=torch.float64)
    y_mean, y_std, tau_orig = 3.0, 2.5, 0.7
    lik = Gaussian(noise_precision=tau_orig * y_std**2)
    m = predictive_metrics(lik, f, y, y_mean=y_mean, y_std=y_std)
    # Direct computation in original units.
    f_orig, y_orig = y_mean + y_std * f.squeeze(-1), y_mean + y_std * y
    assert math.isclose(m["rmse"], float(((f_orig.mean(0) - y_orig) ** 2).mean().sqrt()), rel_tol=1e-9)
    logp = -0.5 * tau_orig * (f_orig - y_orig) ** 2 + 0.5 * math.log(tau_orig / (2 * math.pi))  # (S, N)
    mixture = (torch.logsumexp(logp, 0) - math.log(4)).mean()
    assert math.isclose(m["test_ll"], float(mixture), rel_tol=1e-9)
    joint = (torch.logsumexp(logp.sum(1), 0) - math.log(4)) / 6
    assert math.isclose(m["test_ll_joint"], float(joint), rel_tol=1e-9)
    assert m["test_ll_joint"] <= m["test_ll"] + 1e-12  # Jensen: the joint mixes whole test sets


def test_joint_ll_equals_mixture_for_one_sample() -> None:
    f = torch.randn(1, 5, 1, dtype=torch.float64)
    y = torch.randn(5, dtype=torch.float64)
    lik = Gaussian(noise_precision=1.3)
    assert_close(joint_test_ll(lik, f, y), lik.log_predictive(f, y).mean())


def test_classification_metrics() -> None:
    f = torch.tensor([[[2.0], [-1.0], [0.5]], [[1.0], [-3.0], [-1.5]]])  # (S=2, N=3, 1)
    y = torch.tensor([1.0, 0.0, 1.0])
    m = predictive_metrics(Bernoulli(), f, y)
    p1 = torch.sigmoid(f.squeeze(-1)).mean(0)
    expected_nll = -float(torch.where(y == 1, p1, 1 - p1).log().mean())
    assert math.isclose(m["nll"], expected_nll, rel_tol=1e-6)
    # p1 = (0.806, 0.158, 0.43): the third example (y = 1) is predicted as class 0.
    assert math.isclose(m["accuracy"], 2 / 3, rel_tol=1e-6)
    assert math.isclose(m["error"], 1 / 3, rel_tol=1e-6)


def test_categorical_predictive_averages_probabilities_not_logits() -> None:
    f = torch.tensor([[[10.0, 0.0]], [[0.0, 10.0]]])  # two confident, opposite samples
    probs = Categorical.probs(f)
    assert_close(probs, torch.tensor([[0.5, 0.5]]), atol=1e-4, rtol=0)
    m = predictive_metrics(Categorical(), f, torch.tensor([1]))
    assert math.isclose(m["nll"], math.log(2), rel_tol=1e-3)


@pytest.mark.parametrize("kind", ["gaussian", "bernoulli", "categorical"])
def test_sample_nll_equals_one_nll_per_sample(kind: str) -> None:
    """The vectorised per-sample NLL behind the MC predictive and the joint LL equals one ``nll`` call per sample."""
    g = torch.Generator().manual_seed(0)
    likelihood, out = {
        "gaussian": (Gaussian(3.0), 1),
        "bernoulli": (Bernoulli(), 1),
        "categorical": (Categorical(), 4),
    }[kind]
    f = torch.randn(7, 11, out, generator=g, dtype=torch.float64)
    if kind == "gaussian":
        y = torch.randn(11, generator=g, dtype=torch.float64)
    else:  # labels 0..1 (Bernoulli) or 0..3
        y = torch.randint(0, max(out, 2), (11,), generator=g).double()
    expected = torch.stack([likelihood.nll(fs, y) for fs in f])
    assert_close(likelihood.sample_nll(f, y), expected, rtol=1e-14, atol=0)
    assert_close(likelihood.log_predictive(f, y), torch.logsumexp(-expected, 0) - math.log(7), rtol=1e-14, atol=0)
