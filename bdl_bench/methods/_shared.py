r"""Helpers several methods share (it registers no method): option parsing, the :class:`Covariance` choice,
``predict`` in chunks of samples, the SLANG authors' step-size schedule, and one Adam step on the per-example MAP objective

.. math:: \frac1N\textstyle\sum_i -\log p(y_i\mid x_i,\theta) + \frac1{2N}\sum_d \lambda_d\theta_d^2,

estimated on a minibatch (``method=map``, and the MAP phase of ``laplace`` and ``hmc``).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from bdl_bench.errors import ConfigError
from bdl_bench.methods.base import Problem
from bdl_bench.models.params import forward_with


def parse_choice(enum_cls: type[Enum], value: Any, what: str, method: str) -> Any:
    """``enum_cls(value)``, or a :class:`ConfigError` naming the bad value and listing the choices."""
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(str(e.value) for e in enum_cls)
        raise ConfigError(f"{method}: unknown {what} {value!r}; choices: {choices}") from None


class Covariance(str, Enum):
    """Structure of a Gaussian posterior's precision."""

    FULL = "full"
    """Dense D x D precision ("Full-Gaussian" in SLANG Table 1)."""
    DIAG = "diag"
    """Diagonal precision ("Mean-Field" in SLANG Table 1)."""


PREDICT_CHUNK = 64  # weight samples per vectorised forward pass in ``predict``


def in_chunks(n_samples: int, draw: Callable[[int], Tensor], chunk: int = PREDICT_CHUNK) -> Tensor:
    """``draw(count)`` (``count`` output samples) for consecutive chunks of at most ``chunk`` of ``n_samples``,
    concatenated along the first dimension."""
    return torch.cat([draw(min(chunk, n_samples - start)) for start in range(0, n_samples, chunk)])


def decayed_rate(rate: float, decay: float, step: int) -> float:
    """``rate / (1 + step**decay)`` for ``decay > 0``, else ``rate``, at update ``step`` t >= 1 (the SLANG
    authors' ``decay_rates``)."""
    return rate / (1.0 + step**decay) if decay > 0 else rate


@torch.no_grad()
def add_prior_term(theta: Tensor, prior_precision: Tensor, n_data: int) -> Tensor:
    r"""The prior's part of the per-example objective, :math:`\frac{1}{2N}\sum_d \lambda_d \theta_d^2` for each row
    of ``theta`` (``(D,)`` or ``(M, D)``), whose gradient :math:`\lambda \theta / N` this adds to ``theta.grad``;
    ``prior_precision`` is ``(D,)`` or ``(1, D)`` (one for all rows), or ``(M, D)`` (a row's own: stacked copies).
    Two passes over θ, where autograd through the same expression makes about ten.
    """
    theta.grad.addcmul_(theta, prior_precision, value=1.0 / n_data)
    squares = theta * theta
    if prior_precision.dim() == 1 or prior_precision.shape[0] == 1:
        return squares @ prior_precision.view(-1) * (0.5 / n_data)
    return torch.linalg.vecdot(squares, prior_precision) * (0.5 / n_data)


def map_step(
    problem: Problem, theta: Tensor, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor
) -> dict[str, Tensor]:
    """One step of ``optimizer`` on the per-example MAP objective (module docstring) at the leaf ``theta`` ``(D,)``."""
    optimizer.zero_grad(set_to_none=True)
    nll = problem.likelihood.nll(forward_with(problem.model, theta, x), y).mean()
    nll.backward()
    penalty = add_prior_term(theta, problem.prior_precision, problem.n_data)
    optimizer.step()
    return {"loss": nll.detach() + penalty, "nll": nll.detach()}
