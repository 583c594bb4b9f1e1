r"""Deep ensemble (Lakshminarayanan et al., 2017) as Lee et al. (2020, App. E.3.1) ran it.

M networks (``n_members``; 15 in Lee et al.) with different random initialisations, each fitted by
MAP (as ``methods/map.py``), without adversarial training. The predictive is the equal mixture
:math:`\frac1M\sum_m p(y \mid f(x;\theta_m))`.

Member 0 starts from the model's own parameters; members 1..M-1 are re-drawn from PyTorch's default
initialisation (:func:`default_init`) from ``problem.generator``. All members are trained as one ``(M, D)``
tensor on the sum of their losses; Adam acts elementwise, so this is exactly M independent Adam fits sharing
the minibatch order (the initialisations are the source of diversity, as in Lee et al.).

``predict(x, S)`` returns member ``s mod M`` as sample s, deterministically: the metrics are the
exact equal mixture when S is a multiple of M (set ``trainer.n_test_mc_samples`` to 15, 30, ...).
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch
from torch import Tensor, nn

from bdl_bench.methods._shared import add_prior_term
from bdl_bench.methods.base import Method, Problem, register_method
from bdl_bench.models.params import flat_params, forward_with
from bdl_bench.optim import adam
from bdl_bench.ranges import COUNT, POSITIVE


def default_init(model: nn.Module, generator: torch.Generator) -> Tensor:
    """A fresh flat parameter vector from PyTorch's default layer initialisation, drawn from ``generator``.

    Every module with a weight of 2 or more dimensions gets :math:`\\mathcal U(-b, b)`,
    :math:`b = 1/\\sqrt{\\text{fan-in}}`, on its weight and bias; other parameters keep their values.
    """
    theta = flat_params(model)
    offset = 0
    bounds: dict[str, float] = {}
    for name, p in model.named_parameters():
        prefix = name.rpartition(".")[0]
        if name.endswith("weight") and p.ndim >= 2:
            bounds[prefix] = 1.0 / math.sqrt(p[0].numel())
        bound = bounds.get(prefix) if name.endswith(("weight", "bias")) else None
        if bound is not None:
            u = torch.rand(p.numel(), generator=generator, dtype=theta.dtype, device=generator.device)
            theta[offset : offset + p.numel()] = (2 * u - 1).to(theta.device) * bound
        offset += p.numel()
    return theta


@register_method("ensemble")
class DeepEnsemble(Method):
    """M independently initialised MAP networks (see the module docstring)."""

    option_ranges = MappingProxyType({"n_members": COUNT, "lr": POSITIVE})
    adam_leaves = ("thetas",)

    def __init__(self, *, n_members: int, lr: float) -> None:
        self.keep_options(locals())

    def setup(self, problem: Problem) -> None:
        super().setup(problem)
        first = flat_params(problem.model)
        others = [default_init(problem.model, problem.generator) for _ in range(self.n_members - 1)]
        self.thetas = torch.stack([first, *others]).requires_grad_(True)  # (M, D)
        self.optimizer = adam([self.thetas], self.lr)

    def _outputs(self, thetas: Tensor, x: Tensor) -> Tensor:
        """``(M, N, out)``: the members' outputs, one forward pass each (``torch.func.vmap`` over the members is
        slower on DEF's LeNet)."""
        model = self.problem.model
        return torch.stack([forward_with(model, theta, x) for theta in thetas])

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor | float]:
        """One Adam step of every member; reports the members' mean loss and nll."""
        p = self.problem
        self.optimizer.zero_grad(set_to_none=True)
        f = self._outputs(self.thetas, x)
        nll = p.likelihood.nll(f.reshape(-1, f.shape[-1]), y.repeat(self.n_members)).view(self.n_members, -1).mean(1)
        nll.sum().backward()
        penalty = add_prior_term(self.thetas, p.prior_precision, p.n_data)  # (M,)
        self.optimizer.step()
        nll = nll.detach()
        return {"loss": (nll + penalty).mean(), "nll": nll.mean()}

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """Sample s is member ``s mod M``: ``(n_samples, N, out)``."""
        f = self._outputs(self.thetas.detach(), x)
        return f[torch.arange(n_samples, device=f.device) % self.n_members]
