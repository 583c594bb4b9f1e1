r"""Shared machinery of the layer-wise Gaussian VI methods ``gmfvi``, ``ktied`` and ``elrg``.

The model is an ``nn.Sequential`` of ``nn.Linear`` layers and parameter-free modules (activations).
The variational posterior factorises over layers, :math:`q(\theta) = \prod_l q_l(W_l, b_l)`, each
:math:`q_l` Gaussian with the model's current parameters as initial mean :math:`\mu` (one flat vector in
the order of ``bdl_bench.models.params``). The prior is :math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})`
with ``problem.prior_precision``. Adam descends, per training example, the annealed negative ELBO

.. math::

    \mathcal L_t = \frac1M \sum_{i \in B} \frac1S \sum_{s=1}^S -\log p(y_i \mid f_s(x_i))
        + \frac{\beta_t}{N} \mathrm{KL}(q \,\|\, p), \qquad
    \beta_t = \min\bigl(1, t / T_{\text{anneal}}\bigr)

(step t = 1, 2, ...; ``kl_annealing_steps`` :math:`T_{\text{anneal}} = 0` means :math:`\beta_t = 1`:
linear KL annealing as in Swiatkowski et al. (2020), Sec. 3.1, after Sønderby et al. (2016)).

Training samples each linear layer's *pre-activations* with the local reparameterisation trick
(Kingma, Salimans & Welling 2015; Tomczak et al. 2020, Lemma 1 for the low-rank family): given the
layer input, the pre-activation is Gaussian and is drawn independently per example, so one step costs
a few matrix products per layer instead of one weight draw per example. Evaluation (``predict``)
draws whole weight vectors, so the S output samples are S networks.

Subclasses say how :math:`q_l` is parameterised: the per-step quantities (:meth:`_step_terms`, which
include the closed-form KL), the sampled pre-activation of one layer (:meth:`_local_preactivation`),
flat parameter samples (:meth:`_sample_params`) and the tensors whose gradient SNR is tracked.
With ``snr_window`` W > 0 the gradient SNR of those tensors (``bdl_bench.methods._grad_snr``) is
measured over windows of W steps and added to the per-epoch history as ``train/grad_snr`` (all layers)
and ``train/grad_snr_l<i>`` (i-th linear layer, from 1).
"""

from __future__ import annotations

import copy
import math
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bdl_bench.methods._grad_snr import GradientSNR
from bdl_bench.methods.base import EpochCallback, Method, Problem
from bdl_bench.models.params import flat_params

_PREDICT_CHUNK = 64  # weight samples per batched forward pass in ``predict``


@dataclass(frozen=True)
class LinearLayer:
    """Where one ``nn.Linear`` of the ``nn.Sequential`` model sits.

    Attributes:
        index: 1-based position among the linear layers ("Dense 2" is index 2).
        name: the child's name in the ``nn.Sequential``.
        in_features, out_features: the layer's widths (the weight is ``(out, in)``).
        weight_param: position of the weight in ``model.parameters()``.
        bias_param: position of the bias, or ``None`` without one.
    """

    index: int
    name: str
    in_features: int
    out_features: int
    weight_param: int
    bias_param: int | None

    @property
    def n_weights(self) -> int:
        return self.in_features * self.out_features

    @property
    def n_params(self) -> int:
        """Parameters of the layer (weight and bias): the dimension of :math:`q_l`."""
        return self.n_weights + (self.out_features if self.bias_param is not None else 0)


def linear_layers(model: nn.Module, method: str) -> list[LinearLayer]:
    """The linear layers of ``model`` in forward order.

    Raises:
        ValueError: unless ``model`` is an ``nn.Sequential`` whose parametrised children are all
            ``nn.Linear`` (and at least one is), or if it holds dropout (its noise would not come from
            the method's generator).
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"{method}: needs an nn.Sequential of nn.Linear layers, got {type(model).__name__}")
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        raise ValueError(f"{method}: the model contains dropout layers; build it with dropout=0")
    layers, position = [], 0
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            has_bias = module.bias is not None
            layers.append(
                LinearLayer(
                    index=len(layers) + 1,
                    name=name,
                    in_features=module.in_features,
                    out_features=module.out_features,
                    weight_param=position,
                    bias_param=position + 1 if has_bias else None,
                )
            )
            position += 2 if has_bias else 1
        elif any(True for _ in module.parameters()):
            raise ValueError(
                f"{method}: handles nn.Linear layers and parameter-free modules only; layer {name} is"
                f" {type(module).__name__}"
            )
    if not layers:
        raise ValueError(f"{method}: the model has no nn.Linear layer")
    return layers


def kl_annealing_weight(step: int, n_steps: int) -> float:
    r""":math:`\beta_t = \min(1, t / T)` for step ``t`` >= 1; 1 when ``n_steps`` T is 0."""
    return 1.0 if n_steps == 0 else min(1.0, step / n_steps)


def check_positive_int(method: str, name: str, value: Any, minimum: int = 1) -> int:
    """``int(value)``, or ``ValueError`` naming the option unless it is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < minimum:
        raise ValueError(f"{method}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def forward_flat_params(model: nn.Module, thetas: Tensor, x: Tensor) -> Tensor:
    """Outputs of ``model`` (an ``nn.Sequential`` of ``nn.Linear`` and parameter-free modules) at each
    flat parameter vector of ``thetas (S, D)`` and inputs ``x (N, in)``: ``(S, N, out)``, by batched
    matrix products (one pass per layer for all S networks)."""
    shapes = [p.shape for p in model.parameters()]
    parts = torch.split(thetas, [math.prod(s) for s in shapes], dim=-1)
    parts = [p.reshape(thetas.shape[0], *s) for p, s in zip(parts, shapes)]
    h = x.unsqueeze(0).expand(thetas.shape[0], *x.shape)
    index = 0
    for module in model.children():
        if isinstance(module, nn.Linear):
            bias = None
            if module.bias is not None:
                bias = parts[index + 1]
            h = batched_linear(h, parts[index], bias)
            index += 1 if module.bias is None else 2
        else:
            h = module(h)
    return h


def batched_linear(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``h[s] @ weight[s].T + bias[s]`` for every sample s: ``h (S, N, in)``, ``weight (S, out, in)``."""
    if bias is None:
        return torch.bmm(h, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))


class LayerwiseVI(Method):
    """Base of the layer-wise Gaussian VI methods (see the module docstring).

    Args:
        lr: Adam learning rate.
        n_train_mc_samples: MC samples S per training step.
        init_std: initial posterior standard deviation (each family says how it is used).
        kl_annealing_steps: steps over which the KL weight grows linearly from 0 to 1 (0: no annealing).
        snr_window: steps per gradient-SNR window (0: no SNR tracking; the paper uses 10).

    Raises:
        ValueError: on a non-positive ``lr`` or ``init_std``, ``n_train_mc_samples < 1``, a negative
            ``kl_annealing_steps``, or ``snr_window`` of 1 or below 0.
    """

    def __init__(
        self, *, lr: float, n_train_mc_samples: int, init_std: float, kl_annealing_steps: int, snr_window: int
    ) -> None:
        name = type(self).name
        if not lr > 0:
            raise ValueError(f"{name}: lr must be positive, got {lr}")
        if not init_std > 0:
            raise ValueError(f"{name}: init_std must be positive, got {init_std}")
        self.lr = float(lr)
        self.init_std = float(init_std)
        self.n_train_mc_samples = check_positive_int(name, "n_train_mc_samples", n_train_mc_samples)
        self.kl_annealing_steps = check_positive_int(name, "kl_annealing_steps", kl_annealing_steps, minimum=0)
        self.snr_window = check_positive_int(name, "snr_window", snr_window, minimum=0)
        if self.snr_window == 1:
            raise ValueError(f"{name}: snr_window must be 0 (off) or >= 2, got 1")

    # ------------------------------------------------------------------ family hooks
    @abstractmethod
    def _init_variational(self) -> dict[str, Tensor]:
        """Create the family's variational tensors (leaves with ``requires_grad``), keyed by name."""

    @abstractmethod
    def _step_terms(self, with_kl: bool) -> Any:
        """Differentiable per-step quantities shared by all layers; ``.kl`` is KL(q ‖ p) when asked."""

    @abstractmethod
    def _local_preactivation(
        self, terms: Any, layer: LinearLayer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        """A locally reparameterised sample of layer ``layer``'s pre-activation, ``(..., out)``."""

    @abstractmethod
    def _sample_params(self, terms: Any, n_samples: int) -> Tensor:
        """``n_samples`` draws of the flat parameter vector from q: ``(n_samples, D)``."""

    @abstractmethod
    def _snr_grads(self, layer: LinearLayer) -> list[Tensor]:
        """After ``backward``: the gradients of the tensors that parameterise ``layer``'s weight
        standard deviations (the quantities whose SNR the k-tied paper compares)."""

    # ------------------------------------------------------------------ setup and training
    def setup(self, problem: Problem) -> None:
        """Start from :math:`\\mu` = the model's parameters; the family initialises the rest."""
        super().setup(problem)
        self.layers = linear_layers(problem.model, self.name)
        self.mean = flat_params(problem.model).requires_grad_(True)  # (D,)  mu
        self.param_shapes = [p.shape for p in problem.model.parameters()]
        self.param_sizes = [p.numel() for p in problem.model.parameters()]
        self.prior_precision = problem.prior_precision.to(self.mean)  # (D,)  lambda
        self.variational = self._init_variational()
        leaves = [self.mean, *self.variational.values()]
        self.optimizer = torch.optim.Adam(leaves, lr=self.lr, fused=self.mean.device.type in ("cpu", "cuda"))
        self.n_steps = 0
        self.snr = GradientSNR(self.snr_window) if self.snr_window else None

    def split_params(self, flat: Tensor) -> list[Tensor]:
        """``flat (..., D)`` → one tensor per model parameter, shaped ``(..., *param.shape)`` (views)."""
        lead = flat.shape[:-1]
        parts = torch.split(flat, self.param_sizes, dim=-1)
        return [p.reshape(*lead, *shape) for p, shape in zip(parts, self.param_shapes)]

    def _layer_means(self, layer: LinearLayer, parts: list[Tensor]) -> tuple[Tensor, Tensor | None]:
        return parts[layer.weight_param], None if layer.bias_param is None else parts[layer.bias_param]

    def _outputs_local(self, terms: Any, x: Tensor, n_samples: int) -> Tensor:
        """Network outputs with locally reparameterised pre-activations: ``(S, N, out)``."""
        parts = self.split_params(self.mean)
        h = x if n_samples == 1 else x.unsqueeze(0).expand(n_samples, *x.shape)
        layers = iter(self.layers)
        for module in self.problem.model.children():
            if isinstance(module, nn.Linear):
                layer = next(layers)
                h = self._local_preactivation(terms, layer, h, *self._layer_means(layer, parts))
            else:
                h = module(h)
        return h.unsqueeze(0) if n_samples == 1 else h

    def kl_weight(self, step: int) -> float:
        """The KL annealing factor :math:`\\beta_t` of step ``step`` (1-based)."""
        return kl_annealing_weight(step, self.kl_annealing_steps)

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        p = self.problem
        self.n_steps += 1
        beta = self.kl_weight(self.n_steps)
        self.optimizer.zero_grad(set_to_none=True)
        terms = self._step_terms(with_kl=True)
        f = self._outputs_local(terms, x, self.n_train_mc_samples)
        nll = torch.stack([p.likelihood.nll(f_s, y) for f_s in f]).mean()
        kl = terms.kl / p.n_data
        loss = nll + beta * kl
        loss.backward()
        if self.snr is not None:
            self.snr.update(self.n_steps, {f"l{layer.index}": self._snr_grads(layer) for layer in self.layers})
        self.optimizer.step()
        return {"loss": loss.item(), "nll": nll.item(), "kl": kl.item(), "kl_weight": beta}

    def fit(
        self,
        x: Tensor,
        y: Tensor,
        *,
        n_epochs: int,
        batch_size: int,
        data_generator: torch.Generator,
        on_epoch_end: EpochCallback | None = None,
        start_epoch: int = 0,
    ) -> None:
        """The default loop; with SNR tracking, each epoch's stats also get the mean SNR of the windows
        completed in that epoch (``train/grad_snr``, ``train/grad_snr_l<i>``; absent if none completed)."""
        callback = on_epoch_end
        if self.snr is not None and on_epoch_end is not None:

            def callback(epoch: int, stats: Mapping[str, float]) -> None:
                snr = self.snr.pop_means()
                extra = {("train/grad_snr" if k == "all" else f"train/grad_snr_{k}"): v for k, v in snr.items()}
                on_epoch_end(epoch, {**stats, **extra})

        super().fit(
            x,
            y,
            n_epochs=n_epochs,
            batch_size=batch_size,
            data_generator=data_generator,
            on_epoch_end=callback,
            start_epoch=start_epoch,
        )

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """Outputs of ``n_samples`` networks drawn from q (whole weight vectors): ``(S, N, out)``."""
        terms = self._step_terms(with_kl=False)
        chunks = []
        for start in range(0, n_samples, _PREDICT_CHUNK):
            thetas = self._sample_params(terms, min(_PREDICT_CHUNK, n_samples - start))
            chunks.append(self.forward_params(thetas, x))
        return torch.cat(chunks)

    def forward_params(self, thetas: Tensor, x: Tensor) -> Tensor:
        """Outputs of the networks with flat parameters ``thetas (S, D)`` at ``x (N, in)``: ``(S, N, out)``."""
        return forward_flat_params(self.problem.model, thetas, x)

    @torch.no_grad()
    def kl_to_prior(self) -> Tensor:
        return self._step_terms(with_kl=True).kl.detach()

    def n_variational_params(self) -> int:
        """Number of optimised numbers: the mean plus the family's parameters (Table 1's count)."""
        return self.mean.numel() + sum(t.numel() for t in self.variational.values())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Mean, the family's tensors, Adam's state and the step count (the KL schedule's clock)."""
        return {
            "mean": self.mean.detach().clone(),
            "variational": {k: v.detach().clone() for k, v in self.variational.items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "n_steps": self.n_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; an SNR window in progress starts afresh."""
        with torch.no_grad():
            self.mean.copy_(state["mean"])
            for k, v in self.variational.items():
                v.copy_(state["variational"][k])
        self.optimizer.load_state_dict(state["optimizer"])
        self.n_steps = int(state["n_steps"])
        if self.snr is not None:
            self.snr.reset()


def sqrt_or_tiny(var: Tensor) -> Tensor:
    """``sqrt(var)``, with the variance clamped at the dtype's tiny so the gradient stays finite at 0."""
    return var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()
