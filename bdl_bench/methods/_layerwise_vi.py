r"""Shared machinery of the layer-wise Gaussian VI methods ``gmfvi``, ``ktied`` and ``elrg``.

The model's parametrised modules are ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding`` and ``nn.LSTM`` layers
(``elrg``: ``nn.Linear`` only); every other module must be parameter-free, and none may hold dropout. The
posterior factorises over layers, :math:`q(\theta) = \prod_l q_l(\theta_l)`, each :math:`q_l` Gaussian with the
model's parameters as initial mean :math:`\mu`; the prior is :math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})`.
Adam descends, per training example, the annealed negative ELBO (KL in closed form)

.. math::

    \mathcal L_t = \frac1M \sum_{i \in B} \frac1S \sum_{s=1}^S -\log p(y_i \mid f_s(x_i))
        + \frac{\beta_t}{N} \mathrm{KL}(q \,\|\, p), \qquad
    \beta_t = \min\bigl(1, t / T_{\text{anneal}}\bigr)

(step t = 1, 2, ...; :math:`T_{\text{anneal}} = 0` means :math:`\beta_t = 1`; linear KL annealing as in
Swiatkowski et al. 2020, Sec. 3.1).

**Training an ``nn.Sequential`` of ``nn.Linear``, zero-padded ``nn.Conv2d`` and parameter-free modules**: each
layer's output is sampled with the local reparameterisation trick (Kingma, Salimans & Welling 2015; Tomczak
et al. 2020, Lemma 1): given the input, every output element is Gaussian, with mean and variance from two
products with the input (for a convolution :math:`\operatorname{conv}(a, \mu_W) + \mu_b` and
:math:`\operatorname{conv}(a^2, \sigma_W^2) + \sigma_b^2`), drawn independently per example. With S > 1 samples,
dense networks carry them as a leading dimension, networks with convolutions fold them into the batch.
For a dense layer this is exact (one example's outputs use disjoint weights). For a convolution it is an
approximation: the elements of one feature map share the kernel, so under q they are correlated, and once a
later layer mixes positions the objective is no longer exactly the ELBO (the trick "is not valid for
convolutional layers", Swiatkowski et al. 2020, Sec. 4). ``conv_estimator="reparam"`` instead draws one kernel
per MC sample, shared by the minibatch (the paper's Eq. 6): unbiased, at a higher gradient variance.

**Training any other model** (the IMDB LSTM classifier): the trick does not apply through a recurrence, so each
MC sample draws one whole parameter vector :math:`\theta_s = \mu + \sigma \odot \epsilon_s`, shared by the
minibatch. The padding row of an ``nn.Embedding`` (the deterministic model's constant zero vector) is held
at its mean. ``predict`` always draws whole parameter vectors, so the S output samples are S networks.

Subclasses say how :math:`q_l` is parameterised (:meth:`_step_terms`, with the KL; :meth:`_local_preactivation`;
:meth:`_sample_params`) and which tensors' gradient SNR (:mod:`bdl_bench.methods._grad_snr`) ``snr_window`` tracks
per layer; ``record_every`` writes ``steps.csv`` (:mod:`bdl_bench.methods._step_records`).
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.errors import ConfigError
from bdl_bench.methods._diag_vi import standard_normal
from bdl_bench.methods._grad_snr import GradientSNR
from bdl_bench.methods._shared import PREDICT_CHUNK, in_chunks
from bdl_bench.methods._step_records import StepRecorder
from bdl_bench.methods.base import Method, Problem
from bdl_bench.models.params import flat_params, forward_with, param_layers, sequential_layers
from bdl_bench.optim import adam, load_adam_state
from bdl_bench.ranges import COUNT, NON_NEGATIVE_INT, POSITIVE

CONV_ESTIMATORS = ("local", "reparam")
LOCAL_LAYERS = (nn.Linear, nn.Conv2d)  # the layers whose outputs are sampled locally
VARIATIONAL_LAYERS = (nn.Linear, nn.Conv2d, nn.Embedding, nn.LSTM)  # what gmfvi and ktied take


@dataclass(frozen=True, eq=False)
class Layer:
    """One parametrised module of the model (found by :func:`bdl_bench.models.params.param_layers`)."""

    index: int  # 1-based position among the parametrised modules ("Dense 2" of an MLP is 2)
    name: str  # qualified name in the model ("2", "lstm")
    module: nn.Module
    params: dict[str, int]  # parameter name ("weight", "weight_ih_l0", ...) -> position in model.parameters()
    slices: dict[str, slice]  # the same parameters' entries in the flat vector

    @property
    def weight_param(self) -> int:
        """Position of ``module.weight`` (not for ``nn.LSTM``, whose weights are ``weight_ih_l0``, ...)."""
        return self.params["weight"]

    @property
    def bias_param(self) -> int | None:
        return self.params.get("bias")

    @property
    def weight_matrices(self) -> list[tuple[str, int]]:
        """``(name, position)`` of the module's weights: its parameters with two or more dimensions."""
        return [(n, i) for n, i in self.params.items() if getattr(self.module, n).dim() >= 2]

    @property
    def in_features(self) -> int:
        """Columns of the weight as a matrix (``nn.Linear``: in; ``nn.Conv2d``: in/groups·kh·kw)."""
        return self.module.weight[0].numel()

    @property
    def out_features(self) -> int:
        """Rows of the weight as a matrix (outputs, or output channels)."""
        return self.module.weight.shape[0]

    @property
    def n_weights(self) -> int:
        return self.in_features * self.out_features

    @property
    def n_params(self) -> int:
        """Parameters of the layer (weight and bias): the dimension of :math:`q_l`."""
        return sum(p.numel() for p in self.module.parameters(recurse=False))


def _kinds(types: tuple[type[nn.Module], ...]) -> str:
    return ", ".join(f"nn.{t.__name__}" for t in types)


def model_layers(model: nn.Module, method: str, supported: tuple[type[nn.Module], ...]) -> list[Layer]:
    """The parametrised modules of ``model`` in the flat parameter order; refuses a parametrised module not in
    ``supported``, dropout (its noise would not come from the generator), and a model without ``forward``."""
    if any(
        isinstance(m, nn.modules.dropout._DropoutNd) or (isinstance(m, nn.RNNBase) and m.dropout > 0)
        for m in model.modules()
    ):
        raise ConfigError(f"{method}: the model contains dropout layers; build it with dropout=0")
    layers = []
    for found in param_layers(model):
        if not isinstance(found.module, supported):
            raise ConfigError(
                f"{method}: handles {_kinds(supported)} and parameter-free modules only; layer"
                f" {found.name or '(the model)'} is {type(found.module).__name__}"
            )
        layers.append(Layer(len(layers) + 1, found.name, found.module, found.positions, found.slices))
    if not layers:
        raise ConfigError(f"{method}: the model has no {_kinds(supported)} layer")
    if type(model).forward is nn.Module.forward:
        raise ConfigError(
            f"{method}: the model ({type(model).__name__}) has no forward; use an nn.Sequential or a module"
            " with a forward"
        )
    return layers


def uses_local_reparameterisation(model: nn.Module, layers: list[Layer]) -> bool:
    """Whether training samples pre-activations locally: ``model`` is an ``nn.Sequential`` whose
    parametrised modules are all children of type ``nn.Linear`` or zero-padded ``nn.Conv2d``."""
    return isinstance(model, nn.Sequential) and all(
        "." not in layer.name
        and isinstance(layer.module, LOCAL_LAYERS)
        and getattr(layer.module, "padding_mode", "zeros") == "zeros"
        for layer in layers
    )


def conv2d(layer: Layer, a: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The convolution of ``layer`` (an ``nn.Conv2d``: its stride, padding, dilation, groups) with the
    given weight and bias."""
    m = layer.module
    return F.conv2d(a, weight, bias, m.stride, m.padding, m.dilation, m.groups)


def conv2d_per_sample(layer: Layer, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The convolution ``layer`` of ``S`` stacked minibatches ``h (S·N, C, H, W)``, block s with kernel
    ``weight[s]`` and bias ``bias[s]`` (``(S, C_out, ...)``, ``(S, C_out)``): one grouped convolution."""
    n_samples = weight.shape[0]
    if n_samples == 1:
        return conv2d(layer, h, weight[0], None if bias is None else bias[0])
    m = layer.module
    x = h.unflatten(0, (n_samples, -1)).transpose(0, 1).flatten(1, 2)  # (N, S·C, H, W)
    b = None if bias is None else bias.flatten()
    out = F.conv2d(x, weight.flatten(0, 1), b, m.stride, m.padding, m.dilation, m.groups * n_samples)
    return out.unflatten(1, (n_samples, -1)).transpose(0, 1).flatten(0, 1)


def kl_annealing_weight(step: int, n_steps: int) -> float:
    r""":math:`\beta_t = \min(1, t / T)` for step ``t`` >= 1; 1 when ``n_steps`` T is 0."""
    return 1.0 if n_steps == 0 else min(1.0, step / n_steps)


def is_dense(model: nn.Module, layers: list[Layer]) -> bool:
    """Whether ``model`` is an ``nn.Sequential`` whose parametrised modules are all children of type
    ``nn.Linear``: :func:`forward_flat_params` can run all weight samples in one batched pass per layer."""
    return uses_local_reparameterisation(model, layers) and all(isinstance(layer.module, nn.Linear) for layer in layers)


def forward_networks(model: nn.Module, thetas: Tensor, x: Tensor, dense: bool) -> Tensor:
    """Outputs ``(S, N, out)`` of ``model`` at each flat parameter vector of ``thetas (S, D)``: one batched pass
    per layer where the model is ``dense`` (:func:`is_dense`), else one pass per vector."""
    if dense:
        return forward_flat_params(model, thetas, x)
    return torch.stack([forward_with(model, theta, x) for theta in thetas])


def forward_flat_params(model: nn.Module, thetas: Tensor, x: Tensor) -> Tensor:
    """Outputs of ``model`` (an ``nn.Sequential`` of ``nn.Linear`` and parameter-free modules) at each
    flat parameter vector of ``thetas (S, D)`` and inputs ``x (N, in)``: ``(S, N, out)``, by batched
    matrix products (one pass per layer for all S networks)."""
    n_samples = thetas.shape[0]
    h = x.unsqueeze(0).expand(n_samples, *x.shape)
    for _, module, layer in sequential_layers(model):
        if isinstance(module, nn.Linear) and layer is not None:
            weight = thetas[:, layer.slices["weight"]].reshape(n_samples, *module.weight.shape)
            if module.bias is None:  # h[s] @ weight[s].T (+ bias[s]) for every sample s
                h = torch.bmm(h, weight.transpose(1, 2))
            else:
                h = torch.baddbmm(thetas[:, layer.slices["bias"]].unsqueeze(1), h, weight.transpose(1, 2))
        else:
            h = module(h)
    return h


def base_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``options`` (a family's constructor's ``locals()``) that :class:`LayerwiseVI` takes: its
    ranged options and ``conv_estimator``."""
    return {k: v for k, v in options.items() if k in LayerwiseVI.option_ranges or k == "conv_estimator"}


class LayerwiseVI(Method):
    """Base of the layer-wise Gaussian VI methods (see the module docstring); ``supported_layers`` are the
    parametrised modules a family handles."""

    supported_layers: tuple[type[nn.Module], ...] = VARIATIONAL_LAYERS
    option_ranges = MappingProxyType(
        {
            "lr": POSITIVE,
            "n_train_mc_samples": COUNT,
            "init_std": POSITIVE,
            "kl_annealing_steps": NON_NEGATIVE_INT,
            "snr_window": NON_NEGATIVE_INT,  # 1 is refused below (a window needs 2 steps)
            "record_every": NON_NEGATIVE_INT,
        }
    )

    def __init__(
        self,
        *,
        lr: float,
        n_train_mc_samples: int,
        init_std: float,
        kl_annealing_steps: int,
        snr_window: int,
        conv_estimator: str = "local",
        record_every: int = 0,
    ) -> None:
        name = type(self).name
        if conv_estimator not in CONV_ESTIMATORS:
            raise ConfigError(
                f"{name}: conv_estimator must be one of {', '.join(CONV_ESTIMATORS)}, got {conv_estimator!r}"
            )
        self.conv_estimator = conv_estimator
        self.keep_options(locals())
        if self.snr_window == 1:
            raise ConfigError(f"{name}: snr_window must be 0 (off) or >= 2, got 1")
        self.steps = StepRecorder(self.record_every) if self.record_every else None

    @abstractmethod
    def _init_variational(self) -> dict[str, Tensor]:
        """Create the family's variational tensors (leaves with ``requires_grad``), keyed by name."""

    @abstractmethod
    def _step_terms(self, with_kl: bool) -> Any:
        """Differentiable per-step quantities shared by all layers; ``.kl`` is KL(q ‖ p) when asked."""

    @abstractmethod
    def _local_preactivation(
        self, terms: Any, layer: Layer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        """A locally reparameterised sample of layer ``layer``'s output (``nn.Linear``: ``(..., out)``;
        ``nn.Conv2d``: ``(N, C_out, H', W')``)."""

    @abstractmethod
    def _sample_params(self, terms: Any, n_samples: int) -> Tensor:
        """``n_samples`` draws of the flat parameter vector from q: ``(n_samples, D)``, differentiable in
        the variational parameters (the reparameterisation trick)."""

    def _param_std(self, terms: Any, position: int) -> Tensor:
        """The standard deviations of the parameter at ``position``, in its shape (``conv_estimator="reparam"``)."""
        raise NotImplementedError(f"{self.name}: no per-parameter standard deviations")

    @abstractmethod
    def _snr_grads(self, layer: Layer) -> list[Tensor]:
        """After ``backward``: the gradients of the tensors that parameterise ``layer``'s weight
        standard deviations (the quantities whose SNR the k-tied paper compares)."""

    def use_validation(self, x_val: Tensor, y_val: Tensor, run_dir: str | Path | None = None) -> None:
        if self.steps is not None:
            self.steps.use_validation(x_val, y_val, run_dir)
            self.steps.check(self.name)

    def setup(self, problem: Problem) -> None:
        """Start from :math:`\\mu` = the model's parameters; the family initialises the rest."""
        super().setup(problem)
        model = problem.model
        self.layers = model_layers(model, self.name, self.supported_layers)
        self.local = uses_local_reparameterisation(model, self.layers)
        self.dense = is_dense(model, self.layers)
        self._layer_of = {layer.module: layer for layer in self.layers}
        self.mean = flat_params(model).requires_grad_(True)  # (D,)  mu
        self.param_shapes = [p.shape for p in model.parameters()]
        self.param_sizes = [p.numel() for p in model.parameters()]
        self.noise_free = self._padding_rows()
        self.prior_precision = problem.prior_precision.to(self.mean)  # (D,)  lambda
        self.variational = self._init_variational()
        leaves = [self.mean, *self.variational.values()]
        self.optimizer = adam(leaves, self.lr)
        self.n_steps = 0
        self.snr = GradientSNR(self.snr_window) if self.snr_window else None

    def split_params(self, flat: Tensor) -> list[Tensor]:
        """``flat (..., D)`` → one tensor per model parameter, shaped ``(..., *param.shape)`` (views)."""
        lead = flat.shape[:-1]
        parts = torch.split(flat, self.param_sizes, dim=-1)
        return [p.reshape(*lead, *shape) for p, shape in zip(parts, self.param_shapes)]

    def mean_parts(self) -> list[Tensor]:
        return self.split_params(self.mean)

    def _padding_rows(self) -> Tensor | None:
        """``(D,)`` mask of the padding rows of ``nn.Embedding`` layers, or ``None`` without any."""
        mask = torch.zeros(self.mean.numel(), dtype=torch.bool, device=self.mean.device)
        for layer in self.layers:
            if isinstance(layer.module, nn.Embedding) and layer.module.padding_idx is not None:
                self.split_params(mask)[layer.weight_param][layer.module.padding_idx] = True
        return mask if bool(mask.any()) else None

    def _layer_means(self, layer: Layer, parts: list[Tensor]) -> tuple[Tensor, Tensor | None]:
        return parts[layer.weight_param], None if layer.bias_param is None else parts[layer.bias_param]

    def _outputs_local(self, terms: Any, x: Tensor, n_samples: int) -> Tensor:
        """Network outputs with locally reparameterised layer outputs: ``(S, N, out)``."""
        h = self._local_forward(terms, x, n_samples)
        if n_samples == 1:
            return h.unsqueeze(0)
        return h if self.dense else h.unflatten(0, (n_samples, x.shape[0]))

    def _local_forward(self, terms: Any, x: Tensor, n_samples: int) -> Tensor:
        """:meth:`_outputs_local` without its sample dimension for S = 1: ``(N, out)`` (one sample),
        ``(S, N, out)`` (dense networks) or ``(S·N, ...)`` (networks with convolutions)."""
        parts = getattr(terms, "mean_parts", None)  # a family may pass the mean through its fused KL
        if parts is None:
            parts = self.mean_parts()
        if n_samples == 1:
            h = x
        elif not self.dense:
            h = x.repeat(n_samples, *([1] * (x.dim() - 1)))
        else:
            h = x.unsqueeze(0).expand(n_samples, *x.shape)
        for module in self.problem.model.children():
            layer = self._layer_of.get(module)
            if layer is None:
                h = module(h)
            elif self.conv_estimator == "reparam" and isinstance(module, nn.Conv2d):
                h = self._sampled_conv(terms, layer, h, *self._layer_means(layer, parts), n_samples)
            else:
                h = self._local_preactivation(terms, layer, h, *self._layer_means(layer, parts))
        return h

    def _sampled_conv(
        self, terms: Any, layer: Layer, h: Tensor, weight_mean: Tensor, bias_mean: Tensor | None, n_samples: int
    ) -> Tensor:
        """The convolution ``layer`` of ``h (S·N, C, H, W)`` with one kernel (and bias) drawn per MC sample."""
        g = self.problem.generator
        eps = standard_normal((n_samples, *weight_mean.shape), g, weight_mean)
        weight = weight_mean + self._param_std(terms, layer.weight_param) * eps
        bias = None
        if bias_mean is not None:
            eps = standard_normal((n_samples, *bias_mean.shape), g, bias_mean)
            bias = bias_mean + self._param_std(terms, layer.bias_param) * eps
        return conv2d_per_sample(layer, h, weight, bias)

    def _draw_params(self, terms: Any, n_samples: int) -> Tensor:
        """:meth:`_sample_params`, with the padding rows of embeddings held at their mean (no noise)."""
        thetas = self._sample_params(terms, n_samples)
        if self.noise_free is not None:
            thetas = torch.where(self.noise_free, self.mean, thetas)
        return thetas

    def kl_weight(self, step: int) -> float:
        return kl_annealing_weight(step, self.kl_annealing_steps)

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor | float]:
        p = self.problem
        self.n_steps += 1
        beta = self.kl_weight(self.n_steps)
        self.optimizer.zero_grad(set_to_none=True)
        terms = self._step_terms(with_kl=True)
        if self.local and self.n_train_mc_samples == 1:  # (N, out): the one sample's outputs
            nll = p.likelihood.nll(self._local_forward(terms, x, 1), y).mean()
        else:
            if self.local:
                f = self._outputs_local(terms, x, self.n_train_mc_samples)
            else:  # one weight draw per MC sample, shared by the minibatch
                f = self.forward_params(self._draw_params(terms, self.n_train_mc_samples), x)
            nll = torch.stack([p.likelihood.nll(f_s, y) for f_s in f]).mean()
        loss = torch.add(nll, terms.kl, alpha=beta / p.n_data)  # nll + beta KL / N
        loss.backward()
        if self.snr is not None:
            self.snr.update(self.n_steps, {f"l{layer.index}": self._snr_grads(layer) for layer in self.layers})
        self.optimizer.step()
        if self.steps is not None and self.steps.due(self.n_steps):
            self.steps.record(self, self.n_steps, beta, self.snr.records[-1] if self.snr and self.snr.records else None)
        return {"loss": loss.detach(), "nll": nll.detach(), "kl": terms.kl.detach() / p.n_data, "kl_weight": beta}

    def epoch_stats(self) -> dict[str, float]:
        """The mean SNR of the windows completed in the epoch (none without SNR tracking)."""
        snr = {} if self.snr is None else self.snr.pop_means()
        return {("train/grad_snr" if k == "all" else f"train/grad_snr_{k}"): v for k, v in snr.items()}

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """Outputs of ``n_samples`` networks drawn from q (whole weight vectors): ``(S, N, out)``."""
        terms = self._step_terms(with_kl=False)
        chunk = PREDICT_CHUNK if self.dense else 1  # beyond dense networks, S whole parameter vectors
        return in_chunks(n_samples, lambda count: self.forward_params(self._draw_params(terms, count), x), chunk)

    def forward_params(self, thetas: Tensor, x: Tensor) -> Tensor:
        """Outputs of the networks with flat parameters ``thetas (S, D)`` at ``x``: ``(S, N, out)``."""
        return forward_networks(self.problem.model, thetas, x, self.dense)

    @torch.no_grad()
    def kl_to_prior(self) -> Tensor:
        return self._step_terms(with_kl=True).kl.detach()

    def n_variational_params(self) -> int:
        """Number of optimised numbers: the mean plus the family's parameters (Table 1's count)."""
        return self.mean.numel() + sum(t.numel() for t in self.variational.values())

    def state_dict(self) -> dict[str, Any]:
        """Mean, the family's tensors, Adam's state and the step count (the KL schedule's clock)."""
        return {
            "mean": self.mean.detach().clone(),
            "variational": {k: v.detach().clone() for k, v in self.variational.items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "n_steps": self.n_steps,
            **({"step_rows": self.steps.state_dict()} if self.steps is not None else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; an SNR window in progress starts afresh."""
        with torch.no_grad():
            self.mean.copy_(state["mean"])
            for k, v in self.variational.items():
                v.copy_(state["variational"][k])
        load_adam_state(self.optimizer, state["optimizer"])
        self.n_steps = int(state["n_steps"])
        if self.snr is not None:
            self.snr.reset()
        if self.steps is not None:
            self.steps.load_state_dict(state.get("step_rows", []))
