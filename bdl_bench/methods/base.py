"""The interface every inference method implements, and the method registry.

A method object holds only hyperparameters (keyword-only constructor arguments, the keys of
``conf/method/<name>.yaml`` apart from ``name``). ``setup`` receives the problem and creates the fitting
state; ``fit`` runs the default minibatch loop over ``train_step`` (for a :class:`PostHocMethod` followed by
one fit of the posterior). After fitting, ``predict`` draws samples of the network output, ``posterior``
returns the Gaussian over the flat parameters where there is one, and ``point_estimate`` the vector the
runner saves (``params.pt``).

**Stacked splits.** A :class:`StackedMethod` fits R independent copies at once, one per data split
(:mod:`bdl_bench.orchestration.stacked`); its single run is the stack of one copy. ``setup_stack``
receives one problem per split (same model and N; own likelihood and prior precision, so copies can be
trials of a search), ``stack_step`` takes minibatches ``(R, M, ...)`` and ``copy_at(r)`` returns
copy r alone. Copy r draws exactly the noise a single run of the same seed draws (one draw broadcast over
the copies), so a stacked fit equals R single runs up to rounding. Options in ``per_copy_options``
(dropout's ``dropout_rate``) may differ between copies (:meth:`Method.configure_stack`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from bdl_bench.errors import ConfigError, DivergenceError
from bdl_bench.likelihoods import Likelihood
from bdl_bench.models.params import flat_params
from bdl_bench.optim import load_adam_state
from bdl_bench.progress import delayed_bar
from bdl_bench.ranges import Range, out_of_range
from bdl_bench.registry import import_submodules, lookup, registrar


@dataclass(frozen=True)
class Problem:
    """Everything a method needs to know about what it fits. ``augmentation`` is applied to every training
    minibatch by the default loop (CIFAR's random crop and flip); ``generator`` is the only source of the
    method's randomness."""

    model: nn.Module  # its current parameters are the initial point
    likelihood: Likelihood  # p(y | f) on the (standardised) targets
    n_data: int  # N
    prior_precision: Tensor  # (D,) of the zero-mean Gaussian prior
    generator: torch.Generator
    augmentation: Callable[[Tensor, torch.Generator], Tensor] | None = None


class NonFiniteLossError(DivergenceError):
    """A training step produced a NaN or infinite loss."""


class CannotStack(NotImplementedError):
    """A method (or config) that cannot fit several splits at once; the job then fits them one by one."""


EpochCallback = Callable[[int, Mapping[str, float]], None]
StackEpochCallback = Callable[[int, Sequence[Mapping[str, float]]], None]


class Method(ABC):
    """Base class of inference methods (see module docstring)."""

    name: ClassVar[str]
    option_ranges: ClassVar[Mapping[str, Range]] = MappingProxyType({})
    """Each numeric option's range, for :meth:`check_options` and :func:`bdl_bench.config_checks.check_config`."""
    stacks: ClassVar[bool] = False
    per_copy_options: ClassVar[tuple[str, ...]] = ()
    """Constructor options whose value may differ between stacked copies (:meth:`configure_stack`)."""
    problem: Problem
    extra_metrics: Mapping[str, float] = MappingProxyType({})
    """Entries a finished fit adds to ``metrics.json`` (e.g. Laplace's chosen (N, τ))."""
    step_progress: bool = False
    """Whether long loops inside a fit show a delayed progress bar (``trainer.progress``)."""
    stop_requested: Callable[[], bool] = staticmethod(lambda: False)
    """Whether a SIGTERM has asked the run to stop (the runner sets it); long resumable work inside a fit
    (Laplace's grid search) checks it between its pieces and raises :class:`~bdl_bench.errors.Terminated`."""
    adam_leaves: ClassVar[tuple[str, ...]] = ()
    """Tensors that ``self.optimizer`` (an Adam) fits, which the default checkpoint holds with its state."""
    iid_predictive: ClassVar[bool] = False
    """Whether ``predict(x, n)``'s n samples are independent draws from the generator, so that they may be made
    a few at a time (the runner's resumable final predictions, :mod:`bdl_bench.orchestration.prediction_store`);
    not so for a method whose samples are fixed members (ensemble, HMC) or copies of one output (MAP)."""

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Raise :class:`ConfigError` on the first of ``options`` (a constructor's ``locals()``) out of its range."""
        for key, allowed in cls.option_ranges.items():
            if key in options and not allowed.accepts(options[key]):
                raise ConfigError(f"{cls.name}: {out_of_range(f'method.{key}', options[key], allowed)}")

    def keep_options(self, options: Mapping[str, Any]) -> None:
        """:meth:`check_options`, then keep each of ``options`` that has a range as the attribute of its name: an
        ``int`` where the range holds integers, else a ``float`` (``None`` stays ``None``)."""
        self.check_options(options)
        for key, allowed in self.option_ranges.items():
            if key in options:
                value = options[key]
                setattr(self, key, value if value is None else int(value) if allowed.integer else float(value))

    def setup(self, problem: Problem) -> None:
        """Create the fitting state for ``problem``; called once before ``fit``."""
        self.problem = problem

    def use_validation(self, x_val: Tensor, y_val: Tensor, run_dir: str | Path | None = None) -> None:
        """The run's validation data and folder, before fitting, for a method that uses them (Laplace's search)."""
        del x_val, y_val, run_dir

    @abstractmethod
    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float | Tensor]:
        """One update on a minibatch.

        Returns:
            At least ``{"loss": ...}``, the per-example objective the step descends (for VI methods
            the minibatch estimate of the negative ELBO divided by N), and where available
            ``"nll"``, the minibatch estimate of the expected negative log-likelihood per example; numbers
            or 0-dim tensors (detached, on the model's device: :meth:`fit` reads them once per epoch, so a
            step need not wait for the GPU).
        """

    @abstractmethod
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """Samples of the network output at ``x``: ``(n_samples, N, out)``."""

    def posterior(self) -> Any | None:
        """The Gaussian over the flat parameters (a ``StructuredGaussian``), or ``None``."""
        return None

    def point_estimate(self) -> Tensor | None:
        """The flat parameters ``(D,)`` kept in ``params.pt`` (``None`` for ensembles, HMC); by default the
        posterior mean."""
        posterior = self.posterior()
        return None if posterior is None else posterior.mean

    def kl_to_prior(self) -> Tensor | None:
        """KL(q ‖ prior) of a variational posterior, or ``None``; the runner then reports the ELBO per
        example, ``E_q[log p(D | θ)] / N − KL / N``, on the whole training set."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume fitting (tensors and plain numbers only): by default the
        ``adam_leaves`` and the state of ``self.optimizer``."""
        if not self.adam_leaves:
            return {}
        leaves = {name: getattr(self, name).detach().clone() for name in self.adam_leaves}
        return {**leaves, "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        if not self.adam_leaves:
            if state:
                raise NotImplementedError(f"method {self.name!r} cannot restore a checkpoint")
            return
        with torch.no_grad():
            for name in self.adam_leaves:
                getattr(self, name).copy_(state[name])
        load_adam_state(self.optimizer, state["optimizer"])

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
        """Default loop: ``n_epochs`` passes over shuffled minibatches of ``(x, y)``; each epoch's callback gets the
        means of the steps' statistics and :meth:`epoch_stats`.

        Raises:
            NonFiniteLossError: naming the epoch and first step whose loss is not finite. A tensor loss is
                checked at the end of its epoch (reading it every step would wait for the GPU).
        """
        augment = self.problem.augmentation

        def step(idx: Tensor) -> Mapping[str, float | Tensor]:
            return self.train_step(x[idx] if augment is None else augment(x[idx], data_generator), y[idx])

        def report(epoch: int, stats: Sequence[Mapping[str, float]]) -> None:
            if on_epoch_end is not None:
                on_epoch_end(epoch, {**stats[0], **self.epoch_stats()})

        self._epochs(step, x, None, n_epochs, batch_size, data_generator, report, start_epoch)

    def epoch_stats(self) -> Mapping[str, float]:
        """Entries of an epoch beyond the steps' means (the layer-wise VI methods' gradient SNR)."""
        return {}

    def _epochs(
        self,
        step: Callable[[Tensor], Mapping[str, float | Tensor]],
        x: Tensor,
        n_copies: int | None,
        n_epochs: int,
        batch_size: int,
        data_generator: torch.Generator,
        on_epoch_end: StackEpochCallback | None,
        start_epoch: int = 0,
    ) -> None:
        """The loop of :meth:`fit` (``n_copies`` ``None``) and :meth:`fit_stack` (``x`` ``(R, N, ...)``): epochs
        ``start_epoch + 1 .. n_epochs`` of ``step`` on a fresh permutation's minibatches, each epoch's losses
        checked and the steps' mean statistics passed on, one mapping per copy."""
        n = x.shape[0 if n_copies is None else 1]
        n_batches = math.ceil(n / min(batch_size, n))
        for epoch in range(start_epoch, n_epochs):
            totals: dict[str, float | Tensor] = {}
            losses: list[float | Tensor] = []
            try:
                batches = _minibatches(n, batch_size, data_generator, x.device)
                bar = delayed_bar(batches, desc=f"epoch {epoch + 1}", unit="step", enabled=self.step_progress)
                for idx in bar:
                    out = step(idx)
                    loss = out["loss"]
                    losses.append(loss)
                    if not isinstance(loss, Tensor) and not math.isfinite(loss):  # a number: checked now, at no cost
                        _check_losses(self.name, epoch, losses, n_copies)
                    for k, v in out.items():
                        totals[k] = totals[k] + v if k in totals else v
            except Exception as error:  # e.g. a Cholesky of a diverged precision: name the first divergence
                _check_losses(self.name, epoch, losses, n_copies, cause=error)
                raise
            _check_losses(self.name, epoch, losses, n_copies)
            if on_epoch_end is not None:
                means = dict(zip(totals, _rows(list(totals.values()))))
                copies = range(n_copies or 1)
                on_epoch_end(epoch + 1, [{f"train/{k}": v[r] / n_batches for k, v in means.items()} for r in copies])

    # ------------------------------------------------------------------ stacked splits (module docstring)
    def configure_stack(self, options: Sequence[Mapping[str, Any]]) -> None:
        """Give the next :meth:`setup_stack` each copy's method options; only ``per_copy_options`` may differ.

        Raises:
            CannotStack: naming an option that differs between copies but cannot.
        """
        keys = {k for o in options for k in o}
        differing = sorted(k for k in keys if len({repr(o.get(k)) for o in options}) > 1)
        fixed = [k for k in differing if k not in self.per_copy_options]
        if fixed:
            raise CannotStack(
                f"method {self.name!r}: stacked copies must share {', '.join(f'method.{k}' for k in fixed)}"
            )
        self._copy_options = [dict(o) for o in options]

    def setup_stack(self, problems: Sequence[Problem]) -> None:
        """Create the fitting state of ``len(problems)`` independent copies (one per split)."""
        raise CannotStack(f"method {self.name!r} cannot fit several splits at once")


class PostHocMethod(Method):
    """A method whose posterior is fitted once, on the whole training set, when training ends: the default loop
    trains its starting point (Laplace's and HMC's MAP), then :meth:`fit_posterior` runs right before the last
    epoch's callback, so the last ``history.csv`` row scores the posterior. With :attr:`trains_map` false
    (exact VI, Laplace on a given MAP) it is fitted at once and reported as epoch ``max(n_epochs, 1)``. A fit
    that ends without a posterior (a resumed run with no epoch left) fits it then, with no callback.
    """

    trains_map: bool = True

    @abstractmethod
    def fit_posterior(self, x: Tensor, y: Tensor) -> Mapping[str, float] | None:
        """Fit the posterior to all of ``(x, y)``; returns entries for the last epoch's statistics, or ``None``."""

    @property
    @abstractmethod
    def posterior_fitted(self) -> bool:
        """Whether the state holds a fitted posterior (a restored checkpoint's included)."""

    def fit(
        self,
        x: Tensor,
        y: Tensor,
        *,
        n_epochs: int,
        on_epoch_end: EpochCallback | None = None,
        start_epoch: int = 0,
        **loop: Any,
    ) -> None:
        """The training epochs, then :meth:`fit_posterior` (class docstring)."""
        last = max(n_epochs, 1)

        def report(epoch: int, stats: Mapping[str, float]) -> None:
            if epoch == last:
                stats = {**stats, **(self.fit_posterior(x, y) or {})}
            if on_epoch_end is not None:
                on_epoch_end(epoch, stats)

        if self.trains_map:
            super().fit(x, y, n_epochs=n_epochs, on_epoch_end=report, start_epoch=start_epoch, **loop)
        elif start_epoch < last:
            report(last, {})
        if not self.posterior_fitted:
            self.fit_posterior(x, y)


class StackedMethod(Method):
    """A method written once, for R stacked copies (leading dimension R of every state tensor); a single run
    is the stack of one copy, so the step's maths exists once.

    A subclass writes :meth:`setup_stack` (calling this one first), :meth:`stack_step`, and its
    evaluation for a one-copy state (reading copy 0 through :meth:`only_copy`). ``copy_state`` names the
    attributes holding ``(R, ...)`` tensors (or dataclasses of them), which :meth:`copy_at`
    slices. A config that cannot stack raises :class:`CannotStack` from :meth:`setup_stack` only when R > 1.
    """

    stacks = True
    copy_state: ClassVar[tuple[str, ...]] = ()

    def setup(self, problem: Problem) -> None:
        self.setup_stack([problem])

    def setup_stack(self, problems: Sequence[Problem]) -> None:
        """Record the copies' problems (``self.problem`` is the first: the shared model, N and generator)."""
        if not problems:
            raise ValueError(f"method {self.name!r}: a stack needs at least one copy")
        self.problem = problems[0]
        self._copy_problems = list(problems)

    @property
    def n_copies(self) -> int:
        return len(self._copy_problems)

    def stacked_start(self) -> tuple[Tensor, Tensor]:
        """Every copy's starting point, the model's flat parameters, and its prior precision: ``(R, D)`` each."""
        start = flat_params(self.problem.model)
        problems = self._copy_problems
        # one copy: a view of its problem's prior (never written), not a second (D,) tensor
        priors = (
            problems[0].prior_precision[None]
            if len(problems) == 1
            else torch.stack([p.prior_precision for p in problems])
        )
        priors = priors.to(start)
        return start.expand(self.n_copies, -1).clone(), priors

    @abstractmethod
    def stack_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """One update of every copy on its minibatch ``x`` ``(R, M, ...)``, ``y`` ``(R, M)``; the
        statistics of :meth:`train_step`, each as an ``(R,)`` tensor."""

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float | Tensor]:
        """:meth:`stack_step` of the one copy on ``(x, y)``."""
        out = self.stack_step(x.unsqueeze(0), y.unsqueeze(0))
        return {k: v[0] for k, v in out.items()}

    def fit_stack(self, x: Tensor, y: Tensor, *, on_epoch_end: StackEpochCallback | None = None, **loop: Any) -> None:
        """:meth:`fit`'s loop for stacked copies, ``x`` ``(R, N, ...)``, ``y`` ``(R, N)``: every copy sees its own
        data in the order a single run of the same seed uses (one permutation for all); a non-finite loss is
        reported naming its copy."""

        def step(idx: Tensor) -> Mapping[str, Tensor]:
            return self.stack_step(x.index_select(1, idx), y.index_select(1, idx))

        self._epochs(step, x, x.shape[0], on_epoch_end=on_epoch_end, **loop)

    def copy_values(self, key: str) -> list[Any]:
        """Each copy's value of option ``key`` (this method's own where :meth:`configure_stack` gave none)."""
        options = getattr(self, "_copy_options", None) or [{}] * self.n_copies
        if len(options) != self.n_copies:
            raise ValueError(f"configure_stack got {len(options)} option sets for {self.n_copies} copies")
        return [o.get(key, getattr(self, key)) for o in options]

    def copy_at(self, index: int) -> Method:
        """Copy ``index`` as an ordinary, set-up method: a stack of one, for evaluation (its own problem; state
        copied, not shared; its optimiser, if any, still holds the stack's tensors)."""
        options = {key: self.copy_values(key)[index] for key in self.per_copy_options}
        single = copy.copy(self)
        single.problem = self._copy_problems[index]
        single._copy_problems = [single.problem]
        single._copy_options = None
        for name in self.copy_state:
            setattr(single, name, _copy_of(getattr(self, name), index))
        for key, value in options.items():
            setattr(single, key, value)
        return single

    def only_copy(self, tensor: Tensor) -> Tensor:
        """``tensor[0]`` of a one-copy state; a stack of several copies raises (evaluate ``copy_at(r)``)."""
        if tensor.shape[0] != 1:
            raise RuntimeError(f"method {self.name!r} holds {tensor.shape[0]} stacked copies: evaluate copy_at(r)")
        return tensor[0]


def _copy_of(value: Any, index: int) -> Any:
    """Copy ``index`` of a stacked state value, keeping its copy dimension (``(R, ...)`` → ``(1, ...)``)."""
    if isinstance(value, Tensor):
        return value[index : index + 1].detach().clone()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _copy_of(getattr(value, f.name), index) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    return value


def _check_losses(
    name: str, epoch: int, losses: Sequence[float | Tensor], n_copies: int | None, cause: BaseException | None = None
) -> None:
    """Raise :class:`NonFiniteLossError` naming the first non-finite step loss of an epoch (and its copy)."""
    for step, row in enumerate(_rows(losses)):
        copy = next((r for r, v in enumerate(row) if not math.isfinite(v)), None)
        if copy is not None:
            where = "" if n_copies is None else f" in stacked copy {copy}"
            raise NonFiniteLossError(
                f"method {name!r}: non-finite loss {row[copy]}{where} at epoch {epoch + 1}, step {step + 1}"
                " — lower the learning rate or check the precisions"
            ) from cause


def _rows(values: Sequence[float | Tensor]) -> list[list[float]]:
    """Each of ``values`` (a number, 0-dim or ``(R,)`` tensor) as a list of numbers, read from the device at once."""
    tensors = [v.detach().reshape(1, -1) for v in values if isinstance(v, Tensor)]
    read = iter(torch.cat(tensors).tolist() if tensors else [])
    return [next(read) if isinstance(v, Tensor) else [float(v)] for v in values]


def _minibatches(n: int, batch_size: int, generator: torch.Generator, device: torch.device) -> list[Tensor]:
    """One epoch's minibatch indices: a fresh permutation of ``range(n)``, cut into slices of ``batch_size``."""
    order = torch.randperm(n, generator=generator).to(device)
    return list(order.split(min(batch_size, n)))


METHODS: dict[str, type[Method]] = {}
_register = registrar(METHODS, "method")


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    """Register a method class under the name users type after ``method=``."""

    def add(cls: type[Method]) -> type[Method]:
        cls.name = name
        return _register(name)(cls)

    return add


def build_method(cfg: Mapping[str, Any]) -> Method:
    """Instantiate ``cfg['name']`` with the remaining keys as keyword arguments."""
    import_submodules("bdl_bench.methods")
    cls = lookup(METHODS, cfg["name"], "method")
    return cls(**{k: v for k, v in cfg.items() if k != "name"})
