"""Likelihoods: per-example negative log-likelihood and the Monte Carlo predictive.

Every likelihood takes the network output ``f`` (``(N, out)``) and targets ``y`` (``(N,)``). The
predictive of a method is a mixture over posterior samples ``f_s``; its log density at ``y`` is
``log (1/S) Σ_s p(y | f_s)``, computed with ``logsumexp`` for stability.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bdl_bench.data.base import Dataset, Task


class Likelihood(ABC):
    """p(y | f) for one example; all methods work on batches."""

    @abstractmethod
    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        """Per-example negative log-likelihood ``-log p(y_i | f_i)``, shape ``(N,)``."""

    def log_predictive(self, f_samples: Tensor, y: Tensor) -> Tensor:
        """``log (1/S) Σ_s p(y_i | f_{s,i})`` for samples ``(S, N, out)``; returns ``(N,)``."""
        n_samples = f_samples.shape[0]
        log_liks = torch.stack([-self.nll(f, y) for f in f_samples])  # (S, N)
        return torch.logsumexp(log_liks, dim=0) - math.log(n_samples)


@dataclass(frozen=True)
class Gaussian(Likelihood):
    """``y ~ N(f, 1/noise_precision)`` on standardised targets.

    ``noise_precision`` here is in standardised units; configs give it in original target units
    (``τ_orig``), and :func:`build_likelihood` converts with ``τ = τ_orig · y_std²``.
    """

    noise_precision: float

    def __post_init__(self) -> None:
        if not self.noise_precision > 0:
            raise ValueError(f"noise_precision must be positive, got {self.noise_precision}")

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        tau = self.noise_precision
        return 0.5 * tau * (f.squeeze(-1) - y) ** 2 - 0.5 * math.log(tau / (2 * math.pi))


class Bernoulli(Likelihood):
    """``y ∈ {0, 1}`` with ``p(y=1) = σ(f)``."""

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(f.squeeze(-1), y.to(f.dtype), reduction="none")

    @staticmethod
    def probs(f_samples: Tensor) -> Tensor:
        """Predictive class probabilities ``(N, 2)`` averaged over samples ``(S, N, 1)``."""
        p1 = torch.sigmoid(f_samples.squeeze(-1)).mean(0)
        return torch.stack([1 - p1, p1], dim=-1)


class Categorical(Likelihood):
    """``y ∈ {0..C-1}`` with softmax probabilities."""

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(f, y.long(), reduction="none")

    @staticmethod
    def probs(f_samples: Tensor) -> Tensor:
        """Predictive class probabilities ``(N, C)`` averaged over samples ``(S, N, C)``."""
        return torch.softmax(f_samples, dim=-1).mean(0)


def build_likelihood(dataset: Dataset, noise_precision: float | None) -> Likelihood:
    """The likelihood for ``dataset.task``; ``noise_precision`` is in original target units."""
    if dataset.task is Task.REGRESSION:
        if noise_precision is None:
            raise ValueError("regression needs a noise precision: set method.noise_precision=<τ > 0>")
        if not noise_precision > 0:
            raise ValueError(f"noise_precision must be positive, got {noise_precision}")
        return Gaussian(noise_precision * dataset.y_std**2)
    if dataset.task is Task.BINARY:
        return Bernoulli()
    return Categorical()
