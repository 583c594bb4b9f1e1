"""Evaluation metrics computed from Monte Carlo samples of the network output.

Regression metrics are in original target units: with standardised targets ``y = (y_orig − m)/s``,
the predictive mean maps back as ``m + s·ŷ`` and densities pick up the Jacobian ``−log s``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood


def expected_calibration_error(probs: Tensor, labels: Tensor, n_bins: int = 15) -> float:
    """ECE with equal-width confidence bins (Guo et al., 2017).

    Args:
        probs: predictive class probabilities ``(N, C)``.
        labels: integer labels ``(N,)``.
        n_bins: number of bins on [0, 1]; the first bin includes 0.

    Returns:
        ``Σ_b (n_b / N) |accuracy_b − confidence_b|``.
    """
    confidence, predicted = probs.max(dim=-1)
    correct = (predicted == labels.long()).to(probs.dtype)
    bin_index = torch.clamp(torch.ceil(confidence * n_bins).long() - 1, min=0, max=n_bins - 1)
    ece = torch.zeros((), dtype=probs.dtype)
    for b in range(n_bins):
        in_bin = bin_index == b
        n_b = int(in_bin.sum())
        if n_b:
            ece += n_b / len(labels) * (correct[in_bin].mean() - confidence[in_bin].mean()).abs()
    return float(ece)


def brier_score(probs: Tensor, labels: Tensor) -> float:
    """Mean over examples of ``Σ_c (p_c − 1[y = c])²``."""
    one_hot = torch.nn.functional.one_hot(labels.long(), probs.shape[-1]).to(probs.dtype)
    return float(((probs - one_hot) ** 2).sum(-1).mean())


def joint_test_ll(likelihood: Likelihood, f_samples: Tensor, y: Tensor) -> Tensor:
    """The SLANG authors' test log-likelihood: ``log (1/S) Σ_s Π_i p(y_i | f_{s,i})`` divided by N.

    Differs from the per-point mixture (see paper_numbers/README.md); reported beside it.
    """
    joint = torch.stack([-likelihood.nll(f, y).sum() for f in f_samples])  # (S,)
    return (torch.logsumexp(joint, 0) - math.log(len(joint))) / y.shape[0]


def predictive_metrics(
    likelihood: Likelihood, f_samples: Tensor, y: Tensor, *, y_mean: float = 0.0, y_std: float = 1.0
) -> dict[str, float]:
    """Test metrics of the MC predictive ``(1/S) Σ_s p(y | f_s)``.

    Args:
        likelihood: the likelihood the method was fitted with.
        f_samples: network outputs ``(S, N, out)`` at posterior samples.
        y: targets ``(N,)`` (standardised for regression).
        y_mean, y_std: the regression target standardisation, to report in original units.

    Returns:
        Regression: ``rmse``, ``test_ll`` (mean per-point log predictive density), ``test_ll_joint``,
        ``nll`` (= −test_ll). Classification: ``nll``, ``test_ll``, ``accuracy``, ``error``, ``ece``,
        ``brier``.
    """
    log_pred = likelihood.log_predictive(f_samples, y)  # (N,)
    if isinstance(likelihood, Gaussian):
        jacobian = math.log(y_std)
        mean = f_samples.squeeze(-1).mean(0)
        rmse = float(((mean - y) ** 2).mean().sqrt()) * y_std
        test_ll = float(log_pred.mean()) - jacobian
        return {
            "rmse": rmse,
            "test_ll": test_ll,
            "test_ll_joint": float(joint_test_ll(likelihood, f_samples, y)) - jacobian,
            "nll": -test_ll,
        }
    if isinstance(likelihood, Bernoulli | Categorical):
        probs = likelihood.probs(f_samples)
        labels = y.long()
        accuracy = float((probs.argmax(-1) == labels).float().mean())
        test_ll = float(log_pred.mean())
        return {
            "nll": -test_ll,
            "test_ll": test_ll,
            "accuracy": accuracy,
            "error": 1.0 - accuracy,
            "ece": expected_calibration_error(probs, labels),
            "brier": brier_score(probs, labels),
        }
    raise TypeError(f"no metrics for likelihood {type(likelihood).__name__}")
