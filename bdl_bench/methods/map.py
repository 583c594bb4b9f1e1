r"""Maximum a posteriori estimate with Adam: the prior precision acts as weight decay.

Minimises :math:`\frac1N\sum_i -\log p(y_i \mid x_i, \theta) + \frac1{2N}\sum_d \lambda_d\theta_d^2` per example,
estimated on minibatches. A point estimate: ``predict`` returns the same output for every sample.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import Tensor

from bdl_bench.methods._shared import map_step
from bdl_bench.methods.base import Method, Problem, register_method
from bdl_bench.models.params import flat_params, forward_with
from bdl_bench.optim import adam
from bdl_bench.ranges import POSITIVE


@register_method("map")
class MAP(Method):
    option_ranges = MappingProxyType({"lr": POSITIVE})
    adam_leaves = ("theta",)

    def __init__(self, *, lr: float) -> None:
        self.keep_options(locals())

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
