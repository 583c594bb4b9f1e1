r"""MC dropout (Gal & Ghahramani, 2016) with Adam, as in Gal's UCI code (yaringal/DropoutUncertaintyExps).

Dropout with rate p multiplies the input of every ``nn.Linear`` layer but the first, i.e. every hidden
layer's output, by an independent mask :math:`m / (1 - p)`, :math:`m \sim \mathrm{Bernoulli}(1 - p)`
(inverted dropout, as Keras does), drawn per example and unit. With ``dropout_inputs=True`` the network
inputs are dropped too: Gal's UCI code (``net/net.py``) puts a ``Dropout`` layer before *every* ``Dense``
layer, the first included, so ``conf/method/dropout.yaml`` sets it. Masks come from
``problem.generator`` only: the forward pass is written here over the ``nn.Sequential``'s ``nn.Linear``
layers and activations, and any ``nn.Dropout`` modules in the model are skipped.

Objective per training example, estimated on a minibatch B of size M with S = ``n_train_mc_samples``
mask draws (S = 1 is standard):

.. math::

    \mathcal L(\theta) = \frac1M \sum_{i \in B} \frac1S \sum_{s=1}^S -\log p(y_i \mid f(x_i; \theta, m_{s,i}))
        + \frac1{2N} \sum_d \lambda_d \theta_d^2,

with :math:`\lambda` = ``problem.prior_precision`` (as in ``map.py``). For a Gaussian likelihood of
precision :math:`\tau` this is Gal & Ghahramani's objective (2016, Eq. 1 and Sec. 4) multiplied by
:math:`\tau`: their :math:`\frac1{2N}\sum_i \|y_i - \hat y_i\|^2 + \lambda_{wd} \sum \|W\|^2` with
weight decay :math:`\lambda_{wd} = l^2 (1 - p) / (2 N \tau)` (prior length-scale l) corresponds to
:math:`\lambda_d = l^2 (1 - p)`. Their UCI code differs in two constant factors: Keras' mean squared error
has no 1/2, and its :math:`\tau` is in original target units while the loss is on standardised targets;
it regularises weights only, not biases. Reproducing it exactly therefore needs
:math:`\lambda_d = l^2 (1 - p)\, s_y^2 / 2` on weights (l = 0.01, :math:`s_y` the training-target std)
and a negligible bias precision. At test time ``predict`` averages over n stochastic forward passes
with fresh masks (MC dropout); the noise precision :math:`\tau` enters through ``problem.likelihood``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.methods.base import Method, Problem, register_method
from bdl_bench.models.params import flat_params, unflatten

_PREDICT_CHUNK = 64  # mask draws per vectorised forward pass in ``predict``


@register_method("dropout")
class MCDropout(Method):
    """MC dropout trained with Adam (see the module docstring).

    Args:
        lr: Adam learning rate.
        dropout_rate: the drop probability p, 0 < p < 1 (Gal's UCI grid: 0.005, 0.01, 0.05, 0.1).
        n_train_mc_samples: mask draws S averaged per training step.
        dropout_inputs: also drop the network inputs (Gal's UCI code does).

    Raises:
        ValueError: on a non-positive ``lr``, ``dropout_rate`` outside (0, 1), ``n_train_mc_samples < 1``
            or a non-bool ``dropout_inputs``.
    """

    def __init__(self, *, lr: float, dropout_rate: float, n_train_mc_samples: int, dropout_inputs: bool) -> None:
        if not lr > 0:
            raise ValueError(f"dropout: lr must be positive, got {lr}")
        if not 0 < dropout_rate < 1:
            raise ValueError(f"dropout: dropout_rate must satisfy 0 < p < 1, got {dropout_rate}")
        if int(n_train_mc_samples) != n_train_mc_samples or n_train_mc_samples < 1:
            raise ValueError(f"dropout: n_train_mc_samples must be an integer >= 1, got {n_train_mc_samples}")
        if not isinstance(dropout_inputs, bool):
            raise ValueError(f"dropout: dropout_inputs must be true or false, got {dropout_inputs!r}")
        self.lr = lr
        self.dropout_rate = float(dropout_rate)
        self.n_train_mc_samples = int(n_train_mc_samples)
        self.dropout_inputs = dropout_inputs

    def setup(self, problem: Problem) -> None:
        """Start from the model's parameters.

        Raises:
            ValueError: unless the model is an ``nn.Sequential`` whose only parametrised modules are
                ``nn.Linear``.
        """
        super().setup(problem)
        model = problem.model
        if not isinstance(model, nn.Sequential):
            raise ValueError(f"dropout: needs an nn.Sequential model, got {type(model).__name__}")
        for name, module in model.named_children():
            if not isinstance(module, nn.Linear) and any(True for _ in module.parameters()):
                raise ValueError(
                    f"dropout: handles nn.Linear layers and parameter-free modules only;"
                    f" layer {name} is {type(module).__name__}"
                )
        self.theta = flat_params(model).requires_grad_(True)  # (D,)
        self.optimizer = torch.optim.Adam([self.theta], lr=self.lr)

    def _drop(self, h: Tensor) -> Tensor:
        """``h`` times a fresh inverted-dropout mask from the generator, one entry per element."""
        g = self.problem.generator
        u = torch.rand(h.shape, generator=g, device=g.device, dtype=h.dtype).to(h.device)
        return h * (u >= self.dropout_rate).to(h.dtype) / (1 - self.dropout_rate)

    def _outputs(self, theta: Tensor, x: Tensor, n_samples: int) -> Tensor:
        """Network outputs under ``n_samples`` independent mask draws: ``(S, N, out)``."""
        model = self.problem.model
        params = unflatten(model, theta)
        h = x.unsqueeze(0).expand(n_samples, *x.shape)  # (S, N, in)
        first = True
        for name, module in model.named_children():
            if isinstance(module, nn.Linear):
                if not first or self.dropout_inputs:
                    h = self._drop(h)
                first = False
                h = F.linear(h, params[f"{name}.weight"], params.get(f"{name}.bias"))
            elif not isinstance(module, nn.modules.dropout._DropoutNd):
                h = module(h)
        return h

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        p = self.problem
        self.optimizer.zero_grad(set_to_none=True)
        f = self._outputs(self.theta, x, self.n_train_mc_samples)
        nll = torch.stack([p.likelihood.nll(f_s, y) for f_s in f]).mean()
        penalty = 0.5 * (p.prior_precision * self.theta**2).sum() / p.n_data
        loss = nll + penalty
        loss.backward()
        self.optimizer.step()
        return {"loss": loss.item(), "nll": nll.item()}

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """``n_samples`` stochastic forward passes with dropout active: ``(S, N, out)``."""
        theta = self.theta.detach()
        chunks = []
        for start in range(0, n_samples, _PREDICT_CHUNK):
            chunks.append(self._outputs(theta, x, min(_PREDICT_CHUNK, n_samples - start)))
        return torch.cat(chunks)

    def state_dict(self) -> dict[str, Any]:
        return {"theta": self.theta.detach().clone(), "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.theta.copy_(state["theta"])
        self.optimizer.load_state_dict(state["optimizer"])
