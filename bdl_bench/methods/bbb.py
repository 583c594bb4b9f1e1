r"""Bayes by Backprop: mean-field Gaussian variational inference with Adam (Blundell et al., 2015).

The variational posterior over the flat parameter vector :math:`\theta \in \mathbb R^D` (the order of
``bdl_bench.models.params``) is :math:`q(\theta) = \mathcal N(\mu, \operatorname{diag}(\sigma^2))` with
:math:`\sigma = \operatorname{softplus}(\rho)` (Blundell et al. 2015, Sec. 3.2). The prior is
:math:`p(\theta) = \mathcal N(0, \operatorname{diag}(\lambda)^{-1})` with the per-parameter precision
``problem.prior_precision``. Adam descends, per training example, the negative ELBO divided by N:

.. math::

    \mathcal L(\mu, \rho) = \frac1M \sum_{i \in B} \frac1S \sum_{s=1}^S -\log p(y_i \mid f(x_i; \theta_s))
        + \frac1N \mathrm{KL}(q \,\|\, p),

an unbiased estimate of :math:`-\frac1N\bigl(\mathbb E_q[\log p(\mathcal D \mid \theta)] - \mathrm{KL}\bigr)`
from a minibatch :math:`B` of size M and S = ``n_train_mc_samples`` Monte Carlo samples, with the KL in
closed form (:func:`~bdl_bench.methods._diag_vi.kl_diag_to_prior`). Two gradient estimators of the expected log-likelihood (``estimator``):

- ``reparam``: :math:`\theta_s = \mu + \sigma \odot \epsilon_s`, :math:`\epsilon_s \sim \mathcal N(0, I)`;
  one weight draw per MC sample, shared by the minibatch (Blundell et al. 2015, Sec. 3.1).
- ``local_reparam``: the local reparameterisation trick (Kingma, Salimans & Welling 2015, Sec. 2.3).
  For each ``nn.Linear`` layer with input :math:`a` the pre-activation is Gaussian given :math:`a`, so it
  is sampled directly, independently per example: mean :math:`a \mu_W^\top + \mu_b`, variance
  :math:`a^2 (\sigma_W^2)^\top + \sigma_b^2`. Needs an ``nn.Sequential`` of ``nn.Linear`` layers and
  parameter-free modules.

``lr_decay`` :math:`\alpha` (``None``: a constant step) makes update t = 1, 2, ... take the step
:math:`\mathrm{lr}/(1+t)^{\alpha}` (the SLANG authors' ``ScheduledAdam``, their App. F.1 toy).

``predict`` always samples whole weight vectors (so the S output samples are S networks). Initially
:math:`\mu` is the model's parameters and :math:`\sigma = ` ``init_std`` everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.errors import ConfigError
from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.kernels.local_reparam import StackedLocalLinear
from bdl_bench.likelihoods import stacked_nll
from bdl_bench.methods._diag_vi import kl_diag_to_prior, softplus_inverse, standard_normal
from bdl_bench.methods._shared import in_chunks, parse_choice
from bdl_bench.methods.base import Problem, StackedMethod, register_method
from bdl_bench.models.params import forward_with, unflatten_stacked
from bdl_bench.optim import adam
from bdl_bench.ranges import COUNT, POSITIVE, Range


class Estimator(str, Enum):
    """Gradient estimator of the expected log-likelihood (module docstring)."""

    REPARAM = "reparam"
    LOCAL_REPARAM = "local_reparam"


@register_method("bbb")
class BayesByBackprop(StackedMethod):
    r"""Mean-field Gaussian VI with Adam on :math:`(\mu, \rho)` (module docstring), for R stacked copies:
    means and ρ's ``(R, D)``, one Adam over both (per coordinate, so R independent Adams)."""

    option_ranges = MappingProxyType(
        {"lr": POSITIVE, "n_train_mc_samples": COUNT, "init_std": POSITIVE, "lr_decay": Range(0, nullable=True)}
    )
    copy_state = ("mean", "rho", "prior_precision")
    adam_leaves = ("mean", "rho")

    def __init__(
        self, *, lr: float, n_train_mc_samples: int, estimator: str, init_std: float, lr_decay: float | None = None
    ) -> None:
        self.keep_options(locals())
        self.estimator = parse_choice(Estimator, estimator, "estimator", "bbb")

    def setup_stack(self, problems: Sequence[Problem]) -> None:
        r"""Every copy starts from :math:`\mu` = the model's parameters, :math:`\sigma` = ``init_std``; a model
        with dropout is refused (its noise would not come from the generator)."""
        super().setup_stack(problems)
        model = self.problem.model
        if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
            raise ConfigError("bbb: the model contains dropout layers; build it with dropout=0")
        if self.estimator is Estimator.LOCAL_REPARAM:
            _check_linear_sequential(model)
        self.mean, self.prior_precision = self.stacked_start()  # (R, D)  mu, and each copy's prior precision
        self.mean.requires_grad_(True)
        init = torch.full_like(self.mean, float(self.init_std))
        self.rho = softplus_inverse(init).requires_grad_(True)  # (R, D)  sigma = softplus(rho)
        self.optimizer = adam([self.mean, self.rho], self.lr)

    def std(self) -> Tensor:
        return F.softplus(self.rho)

    def _outputs_reparam(self, x: Tensor, n_samples: int) -> Tensor:
        """Network outputs of every copy on its inputs ``x`` ``(R, M, in)`` for ``n_samples`` weight draws:
        ``(R, S, M, out)``. One ``(S, D)`` draw, shared by the copies."""
        eps = standard_normal((n_samples, self.mean.shape[-1]), self.problem.generator, self.mean)
        thetas = self.mean[:, None] + self.std()[:, None] * eps  # (R, S, D)
        model = self.problem.model
        if x.shape[0] == 1:  # one copy: its S networks on one input
            return torch.func.vmap(lambda theta: forward_with(model, theta, x[0]))(thetas[0]).unsqueeze(0)
        per_copy = torch.func.vmap(lambda theta, x_r: forward_with(model, theta, x_r), in_dims=(0, None))
        return torch.func.vmap(per_copy)(thetas, x)

    def _outputs_local(self, x: Tensor, n_samples: int) -> Tensor:
        """Network outputs with locally reparameterised pre-activations, every copy on its inputs ``x``
        ``(R, M, in)``: ``(R, S, M, out)``. Each layer's noise is drawn once, ``(S, M, out)``, and shared
        by the copies; the first layer's products are shared by the S samples."""
        model = self.problem.model
        means = unflatten_stacked(model, self.mean)
        variances = unflatten_stacked(model, self.std() ** 2)
        n_copies, n_examples = x.shape[0], x.shape[1]
        h = x  # (R, M, in) until the first linear layer
        for name, module in model.named_children():
            if not isinstance(module, nn.Linear):
                h = module(h)
                continue
            bias_mean = means.get(f"{name}.bias")
            bias_var = variances.get(f"{name}.bias")
            weight_mean, weight_var = means[f"{name}.weight"], variances[f"{name}.weight"]
            eps = standard_normal((n_samples, n_examples, weight_mean.shape[1]), self.problem.generator, weight_mean)
            h = StackedLocalLinear.apply(h, weight_mean, bias_mean, weight_var, bias_var, eps.flatten(0, 1))
        return h.view(n_copies, n_samples, n_examples, -1)

    def stack_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Adam on the sum of the copies' objectives (each copy's gradient is its own objective's)."""
        likelihoods = [p.likelihood for p in self._copy_problems]
        self.optimizer.zero_grad(set_to_none=True)
        if self.estimator is Estimator.LOCAL_REPARAM:
            f = self._outputs_local(x, self.n_train_mc_samples)
        else:
            f = self._outputs_reparam(x, self.n_train_mc_samples)
        nll = stacked_nll(likelihoods, f, y).mean(dim=(1, 2))  # (R,)
        kl = kl_diag_to_prior(self.mean, self.std(), self.prior_precision) / self.problem.n_data
        loss = nll + kl
        loss.sum().backward()
        if self.lr_decay:  # update t = 1, 2, ... at lr / (1 + t)^lr_decay (Adam's step count is checkpointed)
            step = int(self.optimizer.state[self.mean].get("step", 0)) + 1
            self.optimizer.param_groups[0]["lr"] = self.lr / (1 + step) ** self.lr_decay
        self.optimizer.step()
        return {"loss": loss.detach(), "nll": nll.detach(), "kl": kl.detach()}

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """Outputs of ``n_samples`` networks drawn from q (whole weight vectors): ``(S, N, out)``."""
        self.only_copy(self.mean)
        return in_chunks(n_samples, lambda count: self._outputs_reparam(x.unsqueeze(0), count)[0])

    def posterior(self) -> DiagGaussian:
        r""":math:`q = \mathcal N(\mu, \operatorname{diag}(\sigma^2))` as precision ``1/σ²``."""
        with torch.no_grad():
            mean, std = self.only_copy(self.mean), self.only_copy(self.std())
            return DiagGaussian(mean=mean.detach().clone(), prec_diag=std.pow(-2))

    @torch.no_grad()
    def kl_to_prior(self) -> Tensor:
        return self.only_copy(kl_diag_to_prior(self.mean, self.std(), self.prior_precision))


def _check_linear_sequential(model: nn.Module) -> None:
    """Refuse a model other than an ``nn.Sequential`` of ``nn.Linear`` and parameter-free modules."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"bbb: estimator 'local_reparam' needs an nn.Sequential model, got {type(model).__name__}")
    for name, module in model.named_children():
        if not isinstance(module, nn.Linear) and any(True for _ in module.parameters()):
            raise ConfigError(
                f"bbb: estimator 'local_reparam' handles nn.Linear layers and parameter-free modules only;"
                f" layer {name} is {type(module).__name__} (use estimator 'reparam')"
            )
