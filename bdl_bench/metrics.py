"""Evaluation metrics computed from Monte Carlo samples of the network output.

Regression metrics are in original target units: with standardised targets ``y = (y_orig − m)/s``,
the predictive mean maps back as ``m + s·ŷ`` and densities pick up the Jacobian ``−log s``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood


def expected_calibration_error(probs: Tensor, labels: Tensor, n_bins: int = 15) -> float:
    """ECE ``Σ_b (n_b / N) |accuracy_b − confidence_b|`` of probabilities ``(N, C)`` against integer labels
    ``(N,)``, with ``n_bins`` equal-width confidence bins on [0, 1], the first including 0 (Guo et al., 2017)."""
    confidence, predicted = probs.max(dim=-1)
    correct = (predicted == labels.long()).to(probs.dtype)
    bin_index = torch.clamp(torch.ceil(confidence * n_bins).long() - 1, min=0, max=n_bins - 1)
    ece = torch.zeros((), dtype=probs.dtype, device=probs.device)
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

    Differs from the per-point mixture (see paper_numbers/README.md); reported beside it."""
    joint = likelihood.sample_nll(f_samples, y).sum(-1).neg_()  # (S,)
    return (torch.logsumexp(joint, 0) - math.log(len(joint))) / y.shape[0]


def predictive_metrics(
    likelihood: Likelihood, f_samples: Tensor, y: Tensor, *, y_mean: float = 0.0, y_std: float = 1.0
) -> dict[str, float]:
    """Test metrics of the MC predictive ``(1/S) Σ_s p(y | f_s)`` of outputs ``(S, N, out)`` at targets ``(N,)``
    (standardised for regression: ``y_mean``, ``y_std`` report in original units). Regression: ``rmse``,
    ``test_ll`` (mean per-point log predictive density), ``test_ll_joint``, ``nll`` (= −test_ll). Classification:
    ``nll``, ``test_ll``, ``test_ll_joint`` (the SLANG authors' BNN test log-loss), ``accuracy``, ``error``, ``ece``,
    ``brier``."""
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
            "test_ll_joint": float(joint_test_ll(likelihood, f_samples, y)),
            "accuracy": accuracy,
            "error": 1.0 - accuracy,
            "ece": expected_calibration_error(probs, labels),
            "brier": brier_score(probs, labels),
        }
    raise TypeError(f"no metrics for likelihood {type(likelihood).__name__}")


def gaussian_predictive_metrics(
    likelihood: Gaussian, mean: Tensor, variance: Tensor, y: Tensor, *, y_std: float = 1.0
) -> dict[str, float]:
    """Test metrics of a closed-form Gaussian predictive :math:`\\mathcal N(y; m, v + 1/\\gamma)` (a linearised
    Laplace's; γ the likelihood's noise precision, the function's mean and variance ``(N,)`` or ``(N, 1)``), at
    standardised targets: ``rmse``, ``test_ll`` and ``nll`` in original units like :func:`predictive_metrics`."""
    mean, total = mean.reshape(-1).double(), variance.reshape(-1).double() + 1.0 / likelihood.noise_precision
    diff = y.double() - mean
    log_density = -0.5 * (math.log(2 * math.pi) + total.log() + diff.square() / total)
    test_ll = float(log_density.mean()) - math.log(y_std)
    return {"rmse": float(diff.square().mean().sqrt()) * y_std, "test_ll": test_ll, "nll": -test_ll}


# --- calibration and out-of-distribution detection (DEF Table 1 and Fig. 6) ---------------------------------


def predictive_entropy(probs: Tensor, *, normalise: bool = True) -> Tensor:
    """Entropy ``−Σ_c p_c log p_c`` ``(N,)`` of predictive probabilities ``(N, C)``, C ≥ 2; with ``normalise``
    divided by the maximum ``log C``, so values lie in [0, 1] (DEF Table 1)."""
    if probs.dim() != 2 or probs.shape[-1] < 2:
        raise ValueError(f"probs must be (N, C) with C >= 2, got shape {tuple(probs.shape)}")
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    return entropy / math.log(probs.shape[-1]) if normalise else entropy


def ood_auroc(in_probs: Tensor, ood_probs: Tensor) -> float:
    """Area under the ROC curve for telling out-of-distribution from in-distribution inputs by entropy.

    OOD inputs are the positive class and the predictive entropy is the score, so 1.0 means every
    OOD input is more uncertain than every in-distribution one, 0.5 chance. Ties count one half."""
    from sklearn.metrics import roc_auc_score

    if in_probs.shape[0] == 0 or ood_probs.shape[0] == 0:
        raise ValueError("ood_auroc needs at least one in-distribution and one OOD example")
    scores = torch.cat([predictive_entropy(in_probs), predictive_entropy(ood_probs)]).double().cpu().numpy()
    is_ood = [0] * in_probs.shape[0] + [1] * ood_probs.shape[0]
    return float(roc_auc_score(is_ood, scores))


def ood_metrics(in_probs: Tensor, ood_probs: Tensor) -> dict[str, float]:
    """DEF Table 1's OOD columns (the normalised entropy's mean and std on the OOD set), the same on the
    in-distribution test set, and the AUROC."""
    h_in, h_ood = predictive_entropy(in_probs), predictive_entropy(ood_probs)
    return {
        "ood_entropy_mean": float(h_ood.mean()),
        "ood_entropy_std": float(h_ood.std()) if h_ood.numel() > 1 else 0.0,
        "in_entropy_mean": float(h_in.mean()),
        "in_entropy_std": float(h_in.std()) if h_in.numel() > 1 else 0.0,
        "ood_auroc": ood_auroc(in_probs, ood_probs),
    }


@dataclass(frozen=True)
class ReliabilityDiagram:
    """Per-bin accuracy against confidence (Guo et al., 2017), with the bins of
    :func:`expected_calibration_error`; accuracy and confidence are NaN in an empty bin."""

    bin_edges: Tensor  # (B + 1,)
    counts: Tensor  # (B,)
    accuracy: Tensor  # (B,)
    confidence: Tensor  # (B,)

    @property
    def ece(self) -> float:
        """``Σ_b (n_b / N) |accuracy_b − confidence_b|`` — equals :func:`expected_calibration_error`."""
        filled = self.counts > 0
        weights = self.counts[filled].double() / self.counts.sum()
        return float((weights * (self.accuracy[filled] - self.confidence[filled]).abs().double()).sum())


def reliability_from_confidence(confidence: Tensor, correct: Tensor, n_bins: int = 15) -> ReliabilityDiagram:
    """:class:`ReliabilityDiagram` from per-example top-class confidence ``(N,)`` and correctness ``(N,)``."""
    confidence = confidence.double().cpu()
    correct = correct.double().cpu()
    bin_index = torch.clamp(torch.ceil(confidence * n_bins).long() - 1, min=0, max=n_bins - 1)
    counts = torch.bincount(bin_index, minlength=n_bins)
    sums_correct = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bin_index, correct)
    sums_conf = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bin_index, confidence)
    denom = counts.double()
    nan = torch.full((n_bins,), math.nan, dtype=torch.float64)
    return ReliabilityDiagram(
        bin_edges=torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64),
        counts=counts,
        accuracy=torch.where(counts > 0, sums_correct / denom.clamp_min(1), nan),
        confidence=torch.where(counts > 0, sums_conf / denom.clamp_min(1), nan),
    )


def uncertainty_arrays(probs: Tensor, labels: Tensor, ood_probs: Tensor | None = None) -> dict[str, np.ndarray]:
    """Per-example arrays for reliability diagrams and entropy histograms (``uncertainty.npz``):
    ``test_confidence``, ``test_correct``, ``test_entropy`` (normalised) and, with ``ood_probs``, ``ood_entropy``."""
    confidence, predicted = probs.max(dim=-1)
    out = {
        "test_confidence": confidence.double().cpu().numpy(),
        "test_correct": (predicted == labels.long()).cpu().numpy(),
        "test_entropy": predictive_entropy(probs).double().cpu().numpy(),
    }
    if ood_probs is not None:
        out["ood_entropy"] = predictive_entropy(ood_probs).double().cpu().numpy()
    return out
