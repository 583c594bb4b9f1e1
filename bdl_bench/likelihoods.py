"""Likelihoods: per-example negative log-likelihood and the Monte Carlo predictive.

Every likelihood takes the network output ``f`` (``(N, out)``) and targets ``y`` (``(N,)``). The
predictive of a method is a mixture over posterior samples ``f_s``; its log density at ``y`` is
``log (1/S) Σ_s p(y | f_s)``, computed with ``logsumexp`` for stability."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bdl_bench.data.base import Dataset, Task
from bdl_bench.errors import ConfigError


class Likelihood(ABC):
    """p(y | f) for one example; all methods work on batches."""

    @abstractmethod
    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        """Per-example negative log-likelihood ``-log p(y_i | f_i)``, shape ``(N,)``."""

    def sample_nll(self, f_samples: Tensor, y: Tensor) -> Tensor:
        """``-log p(y_i | f_{s,i})`` of every sample, ``(S, N)``, for samples ``(S, N, out)``: one call of
        :meth:`nll` on all S·N rows (the targets repeated), not one per sample."""
        n_samples, n = f_samples.shape[:2]
        rows = f_samples.reshape(n_samples * n, f_samples.shape[-1])
        return self.nll(rows, y.expand(n_samples, n).reshape(-1)).view(n_samples, n)

    def log_predictive(self, f_samples: Tensor, y: Tensor) -> Tensor:
        """``log (1/S) Σ_s p(y_i | f_{s,i})`` for samples ``(S, N, out)``; returns ``(N,)``."""
        n_samples = f_samples.shape[0]
        return torch.logsumexp(self.sample_nll(f_samples, y).neg_(), dim=0) - math.log(n_samples)

    def hessian_sqrt(self, f: Tensor, y: Tensor) -> Tensor:
        r"""Square-root factors of the NLL's Hessian in the network output, ``(C, N, out)``: rows
        :math:`a_{ci}` with :math:`\sum_c a_{ci}a_{ci}^\top = \Lambda_i = \partial^2[-\log p(y_i\mid f_i)]/\partial f_i^2`
        for outputs ``f`` ``(N, out)`` and targets ``y`` ``(N,)`` (the GGN's :math:`J^\top\Lambda J` is then a
        sum of squares of the pseudo-gradients :math:`J^\top a_{ci}`).

        This default: the eigendecomposition of the autograd Hessian of :meth:`nll` per example (negative
        eigenvalues, possible for a non-convex likelihood, are set to 0; C = out). The built-in likelihoods
        override it with closed forms."""
        f = f.detach()

        def nll_one(f_i: Tensor, y_i: Tensor) -> Tensor:
            return self.nll(f_i.unsqueeze(0), y_i.unsqueeze(0)).squeeze(0)

        evals, evecs = torch.linalg.eigh(torch.func.vmap(torch.func.hessian(nll_one))(f, y))  # (N, out, out)
        return (evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)).permute(2, 0, 1)


@dataclass(frozen=True)
class Gaussian(Likelihood):
    """``y ~ N(f, 1/noise_precision)`` on standardised targets.

    ``noise_precision`` here is in standardised units; configs give it in original target units
    (``τ_orig``), and :func:`build_likelihood` converts with ``τ = τ_orig · y_std²``."""

    noise_precision: float

    def __post_init__(self) -> None:
        if not self.noise_precision > 0:
            raise ConfigError(f"noise_precision must be positive, got {self.noise_precision}")

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        tau = self.noise_precision
        return 0.5 * tau * (f.squeeze(-1) - y) ** 2 - 0.5 * math.log(tau / (2 * math.pi))

    def hessian_sqrt(self, f: Tensor, y: Tensor) -> Tensor:
        r""":math:`\Lambda_i = \tau`: the one factor :math:`\sqrt\tau`, ``(1, N, 1)``."""
        return torch.full((1, *f.shape), math.sqrt(self.noise_precision), dtype=f.dtype, device=f.device)


@dataclass(frozen=True)
class Bernoulli(Likelihood):
    """``y ∈ {0, 1}`` with ``p(y=1) = σ(f)``."""

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(f.squeeze(-1), y.to(f.dtype), reduction="none")

    def hessian_sqrt(self, f: Tensor, y: Tensor) -> Tensor:
        r""":math:`\Lambda_i = \sigma(f_i)\sigma(-f_i)`: its square root, ``(1, N, 1)``."""
        return (torch.sigmoid(f) * torch.sigmoid(-f)).sqrt_().unsqueeze(0)

    @staticmethod
    def probs(f_samples: Tensor) -> Tensor:
        """Predictive class probabilities ``(N, 2)`` averaged over samples ``(S, N, 1)``."""
        p1 = torch.sigmoid(f_samples.squeeze(-1)).mean(0)
        return torch.stack([1 - p1, p1], dim=-1)


@dataclass(frozen=True)
class Categorical(Likelihood):
    """``y ∈ {0..C-1}`` with softmax probabilities."""

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(f, y.long(), reduction="none")

    def hessian_sqrt(self, f: Tensor, y: Tensor) -> Tensor:
        r""":math:`\Lambda_i = \operatorname{diag}(p_i) - p_ip_i^\top` with :math:`p_i = \operatorname{softmax}(f_i)`:
        factors :math:`a_{ci} = \sqrt{p_{ic}}\,(e_c - p_i)`, ``(C, N, C)`` (their squares sum to
        :math:`\Lambda_i` because :math:`\sum_c p_{ic} = 1`)."""
        p = torch.softmax(f, dim=-1)  # (N, C)
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        return p.sqrt().mT[:, :, None] * (eye[:, None, :] - p[None, :, :])

    @staticmethod
    def probs(f_samples: Tensor) -> Tensor:
        """Predictive class probabilities ``(N, C)`` averaged over samples ``(S, N, C)``."""
        return torch.softmax(f_samples, dim=-1).mean(0)


def stacked_nll(likelihoods: Sequence[Likelihood], f: Tensor, y: Tensor) -> Tensor:
    """Per-example negative log-likelihoods ``(R, ..., M)`` of R stacked copies' outputs ``(R, ..., M, out)`` at
    targets ``(R, M)``, copy r under ``likelihoods[r]``: all of one class (Gaussians may differ in noise precision:
    each split has its own target scale)."""
    kinds = {type(lik) for lik in likelihoods}
    if len(kinds) != 1 or len(likelihoods) != f.shape[0]:
        raise ValueError(f"stacked_nll needs one likelihood of one class per copy, got {kinds} for {f.shape[0]} copies")
    targets = y.reshape(y.shape[0], *([1] * (f.dim() - 3)), y.shape[1])  # (R, 1.., M)
    if kinds == {Gaussian} and any(lik != likelihoods[0] for lik in likelihoods):  # one noise precision per copy
        shape = (len(likelihoods), *([1] * (f.dim() - 2)))
        tau = torch.tensor([lik.noise_precision for lik in likelihoods], dtype=f.dtype, device=f.device).view(shape)
        return 0.5 * tau * (f.squeeze(-1) - targets) ** 2 - 0.5 * torch.log(tau / (2 * math.pi))
    targets = targets.expand(f.shape[:-1])
    return likelihoods[0].nll(f.reshape(-1, f.shape[-1]), targets.reshape(-1)).view(f.shape[:-1])


def build_likelihood(dataset: Dataset, noise_precision: float | None) -> Likelihood:
    """The likelihood for ``dataset.task``; ``noise_precision`` is in original target units."""
    if dataset.task is Task.REGRESSION:
        if noise_precision is None:
            raise ConfigError("regression needs a noise precision: set method.noise_precision=<τ > 0>")
        if not noise_precision > 0:
            raise ConfigError(f"noise_precision must be positive, got {noise_precision}")
        return Gaussian(noise_precision * dataset.y_std**2)
    if dataset.task is Task.BINARY:
        return Bernoulli()
    return Categorical()
