r"""Hamiltonian Monte Carlo on the full-batch posterior: the reference of Lee et al.'s toy figure.

Target (Neal 1996; 2011, "MCMC using Hamiltonian dynamics"):
:math:`\log p(\theta \mid \mathcal D) = -\sum_i \ell(f(x_i;\theta), y_i) - \tfrac12\sum_d\lambda_d\theta_d^2
+ \text{const}` with the run's likelihood and prior precision :math:`\lambda`. Each iteration draws a
momentum :math:`r \sim \mathcal N(0, M)`, runs ``n_leapfrog`` leapfrog steps of size :math:`\epsilon`
(jittered uniformly by ±10 % per iteration against periodic trajectories) and accepts with
probability :math:`\min(1, e^{-\Delta H})`.

Warm-up (``n_warmup`` iterations, discarded), as Stan does it in simplified form: the step size is
tuned by dual averaging (Hoffman & Gelman 2014, Alg. 5; :math:`\gamma = 0.05, t_0 = 10,
\kappa = 0.75`) to the acceptance rate ``target_accept``; over the middle half of warm-up the
per-coordinate variance of the chain is collected and becomes the diagonal inverse mass matrix
:math:`M^{-1}` (shrunk towards 1e-3 as Stan's regularisation), after which the step size adaptation
restarts. Then ``n_samples`` iterations are kept, every ``thin``-th.

The chain starts at the MAP: ``fit`` first runs the default MAP loop (Adam, ``lr``,
``trainer.n_epochs`` epochs), then samples right before the last epoch's callback (``PostHocMethod``).
All randomness comes from ``problem.generator`` (why no library sampler: NumPyro needs JAX, Pyro's NUTS
draws from torch's global RNG).
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from bdl_bench.methods._diag_vi import standard_normal
from bdl_bench.methods._shared import PREDICT_CHUNK, map_step
from bdl_bench.methods.base import PostHocMethod, Problem, register_method
from bdl_bench.models.params import flat_params, forward_with
from bdl_bench.ranges import COUNT, NON_NEGATIVE_INT, POSITIVE, UNIT_OPEN


class _DualAveraging:
    """Hoffman & Gelman (2014), Alg. 5: adapt log ε so the mean acceptance approaches ``target``."""

    def __init__(self, step_size: float, target: float) -> None:
        self.mu = math.log(10 * step_size)
        self.target = target
        self.t = 0
        self.h_bar = 0.0
        self.log_eps = math.log(step_size)
        self.log_eps_bar = 0.0

    def update(self, accept_prob: float) -> float:
        self.t += 1
        eta = 1.0 / (self.t + 10.0)
        self.h_bar = (1 - eta) * self.h_bar + eta * (self.target - accept_prob)
        self.log_eps = self.mu - math.sqrt(self.t) / 0.05 * self.h_bar
        weight = self.t**-0.75
        self.log_eps_bar = weight * self.log_eps + (1 - weight) * self.log_eps_bar
        return math.exp(self.log_eps)

    @property
    def final(self) -> float:
        return math.exp(self.log_eps_bar)


@register_method("hmc")
class HMC(PostHocMethod):
    """HMC with a warmed-up step size and diagonal mass matrix (see the module docstring)."""

    option_ranges = MappingProxyType(
        {
            "n_samples": COUNT,
            "n_warmup": NON_NEGATIVE_INT,
            "n_leapfrog": COUNT,
            "step_size": POSITIVE,
            "target_accept": UNIT_OPEN,
            "thin": COUNT,
            "lr": POSITIVE,
        }
    )
    adam_leaves = ("theta",)

    def __init__(
        self,
        *,
        n_samples: int,
        n_warmup: int,
        n_leapfrog: int,
        step_size: float,
        target_accept: float,
        thin: int,
        lr: float,
    ) -> None:
        self.keep_options(locals())
        self.samples: Tensor | None = None
        self.fit_info: dict[str, float] = {}

    def setup(self, problem: Problem) -> None:
        super().setup(problem)
        self.theta = flat_params(problem.model).requires_grad_(True)
        self.optimizer = torch.optim.Adam([self.theta], lr=self.lr)
        self.samples = None

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        """One MAP step (the chain's initialisation), as ``methods/map.py``."""
        return map_step(self.problem, self.theta, self.optimizer, x, y)

    @property
    def posterior_fitted(self) -> bool:
        return self.samples is not None

    def _potential_and_grad(self, theta: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        p = self.problem
        with torch.enable_grad():
            th = theta.detach().requires_grad_(True)
            u = p.likelihood.nll(forward_with(p.model, th, x), y).sum() + 0.5 * (p.prior_precision * th**2).sum()
            (g,) = torch.autograd.grad(u, th)
        return u.detach(), g

    def _uniform(self) -> float:
        g = self.problem.generator
        return float(torch.rand((), generator=g, device=g.device))

    def fit_posterior(self, x: Tensor, y: Tensor) -> None:
        """Run warm-up and sampling on all of ``(x, y)`` from the current parameters; stores ``samples``
        ``(n_kept, D)``."""
        theta = self.theta.detach().clone()
        u, grad = self._potential_and_grad(theta, x, y)
        inv_mass = torch.ones_like(theta)
        adapt = _DualAveraging(self.step_size, self.target_accept)
        eps = self.step_size
        window = (self.n_warmup // 4, 3 * self.n_warmup // 4)
        window_samples: list[Tensor] = []
        kept: list[Tensor] = []
        n_accepted = 0
        for it in range(self.n_warmup + self.n_samples):
            momentum = standard_normal(theta.shape, self.problem.generator, theta) / inv_mass.sqrt()  # r ~ N(0, M)
            step = eps * (0.9 + 0.2 * self._uniform())
            new_theta, new_momentum = theta.clone(), momentum - 0.5 * step * grad
            for leap in range(self.n_leapfrog):
                new_theta = new_theta + step * inv_mass * new_momentum
                new_u, new_grad = self._potential_and_grad(new_theta, x, y)
                if leap < self.n_leapfrog - 1:
                    new_momentum = new_momentum - step * new_grad
            new_momentum = new_momentum - 0.5 * step * new_grad
            h_old = u + 0.5 * (inv_mass * momentum**2).sum()
            h_new = new_u + 0.5 * (inv_mass * new_momentum**2).sum()
            log_accept = float(h_old - h_new)
            accept_prob = math.exp(min(0.0, log_accept)) if math.isfinite(log_accept) else 0.0
            if self._uniform() < accept_prob:
                theta, u, grad = new_theta, new_u, new_grad
                n_accepted += it >= self.n_warmup
            if it < self.n_warmup:
                eps = adapt.update(accept_prob)
                if window[0] <= it < window[1]:
                    window_samples.append(theta)
                if it == window[1] - 1 and len(window_samples) > 1:
                    n = len(window_samples)
                    var = torch.stack(window_samples).var(0)
                    inv_mass = (n / (n + 5.0)) * var + 1e-3 * (5.0 / (n + 5.0))
                    adapt = _DualAveraging(eps, self.target_accept)
                if it == self.n_warmup - 1:
                    eps = adapt.final
            elif (it - self.n_warmup) % self.thin == 0:
                kept.append(theta)
        self.samples = torch.stack(kept)
        self.fit_info = {"accept_rate": n_accepted / self.n_samples, "step_size": eps}
        with torch.no_grad():
            self.theta.copy_(self.samples[-1])

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """Outputs at ``n_samples`` evenly spaced kept states (cycled if more are asked for than kept)."""
        model = self.problem.model
        if self.samples is None:
            f = forward_with(model, self.theta.detach(), x)
            return f.unsqueeze(0).expand(n_samples, *f.shape)
        n_kept = self.samples.shape[0]
        if n_samples <= n_kept:
            index = torch.linspace(0, n_kept - 1, n_samples).round().long()
        else:
            index = torch.arange(n_samples) % n_kept
        thetas = self.samples[index.to(self.samples.device)]
        chunks = [
            torch.vmap(lambda th: forward_with(model, th, x))(thetas[s : s + PREDICT_CHUNK])
            for s in range(0, n_samples, PREDICT_CHUNK)
        ]
        return torch.cat(chunks) if chunks else forward_with(model, self.theta.detach(), x)[None][:0]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.samples is not None:
            state["samples"] = self.samples.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.samples = state.get("samples")
