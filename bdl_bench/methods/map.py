"""Maximum a posteriori estimate with Adam: the prior precision acts as weight decay.

Minimises ``(1/N) Σᵢ -log p(yᵢ | xᵢ, θ) + (1/2N) Σ_d λ_d θ_d²`` per example, estimated on minibatches.
A point estimate: ``predict`` returns the same output for every sample.
"""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from bdl_bench.methods._shared import map_step
from bdl_bench.methods.base import Method, Problem, register_method
from bdl_bench.models.params import flat_params, forward_with
from bdl_bench.optim import adam, load_adam_state
from bdl_bench.ranges import POSITIVE

__all__ = ["MAP"]


@register_method("map")
class MAP(Method):
    option_ranges = MappingProxyType({"lr": POSITIVE})

    def __init__(self, *, lr: float) -> None:
        self.check_options(locals())
        self.lr = lr

    def setup(self, problem: Problem) -> None:
        super().setup(problem)
        self.theta = flat_params(problem.model).requires_grad_(True)
        self.optimizer = adam([self.theta], self.lr)

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor | float]:
        return map_step(self.problem, self.theta, self.optimizer, x, y)

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        f = forward_with(self.problem.model, self.theta.detach(), x)
        return f.unsqueeze(0).expand(n_samples, *f.shape)

    def point_estimate(self) -> Tensor:
        return self.theta.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"theta": self.theta.detach().clone(), "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.theta.copy_(state["theta"])
        load_adam_state(self.optimizer, state["optimizer"])
