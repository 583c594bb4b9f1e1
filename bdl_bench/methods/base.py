"""The interface every inference method implements, and the method registry.

A method object holds only hyperparameters (keyword-only constructor arguments, exactly the keys
of ``conf/method/<name>.yaml`` apart from ``name``). ``setup`` receives the problem and creates the
fitting state; ``fit`` runs the default minibatch loop over ``train_step`` (iterative methods), for a
:class:`PostHocMethod` followed by one fit of the posterior (Laplace, HMC, exact VI's L-BFGS). After fitting, ``predict`` draws samples of the network output,
``posterior`` returns the Gaussian over the flat parameter vector where the method has one, and
``point_estimate`` the single parameter vector the runner saves (``params.pt``).

**Stacked splits.** A method with ``supports_replicas = True`` can also fit R independent copies of
itself at once, one per data split (:mod:`bdl_bench.orchestration.stacked`). Such a method derives from
:class:`StackedMethod`: its step is written once, for R copies, and its single run is the stack of one
copy. ``setup_replicas`` receives one problem per split (same model and N; their own likelihood and prior
precision, so that the copies can also be trials of a hyperparameter search, :mod:`bdl_bench.orchestration.search`),
``train_step_replicas`` takes minibatches ``(R, M, ...)`` and ``replica(r)`` returns a set-up method
holding copy r's state alone (for evaluation). Copy r draws exactly the noise a single run of the same
seed draws (one draw broadcast over the copies), so a stacked fit equals R single runs up to
floating-point rounding. The options in ``replica_options`` (dropout's ``dropout_rate``) may differ
between copies too (:meth:`Method.configure_replicas`).
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
from bdl_bench.progress import delayed_bar
from bdl_bench.ranges import Range, out_of_range


@dataclass(frozen=True)
class Problem:
    """Everything a method needs to know about what it fits.

    Attributes:
        model: the network; its current parameters are the initial point (methods may copy them).
        likelihood: p(y | f) on the (standardised) targets.
        n_data: number of training examples N (the likelihood term of the ELBO is scaled to N).
        prior_precision: per-parameter precision of the zero-mean Gaussian prior, ``(D,)``.
        generator: the only source of randomness for MC sampling inside the method.
        augmentation: ``(x_batch, generator) -> x_batch`` applied to every training minibatch by the
            default loop (CIFAR's random crop and flip), or ``None``.
    """

    model: nn.Module
    likelihood: Likelihood
    n_data: int
    prior_precision: Tensor  # (D,)
    generator: torch.Generator
    augmentation: Callable[[Tensor, torch.Generator], Tensor] | None = None


class NonFiniteLossError(DivergenceError):
    """Raised when a training step produces a NaN or infinite loss."""


class CannotStack(NotImplementedError):
    """:meth:`Method.setup_replicas` of a method (or of this config of it) that cannot fit several splits at
    once; a job given several splits then fits them one after another (:func:`bdl_bench.orchestration.sweep.run_job`)."""


EpochCallback = Callable[[int, Mapping[str, float]], None]
ReplicaEpochCallback = Callable[[int, Sequence[Mapping[str, float]]], None]


class Method(ABC):
    """Base class of inference methods (see module docstring)."""

    name: ClassVar[str]
    option_ranges: ClassVar[Mapping[str, Range]] = MappingProxyType({})
    """The range of each numeric constructor option: the one source that the constructor
    (:meth:`check_options`) and the config check before a run (:func:`bdl_bench.config_checks.check_config`) use."""
    supports_replicas: ClassVar[bool] = False
    replica_options: ClassVar[tuple[str, ...]] = ()
    """Constructor options whose value may differ between stacked copies (:meth:`configure_replicas`)."""
    problem: Problem
    extra_metrics: Mapping[str, float] = MappingProxyType({})
    """Entries a finished fit adds to ``metrics.json`` (e.g. Laplace's chosen (N, τ)); none by default."""
    step_progress: bool = False
    """Whether long loops inside a fit (an epoch's steps, a curvature pass) show a bar once they have run
    :data:`bdl_bench.progress.BAR_DELAY_S` (the runner sets it from ``trainer.progress``)."""

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Refuse the first of ``options`` (a constructor's arguments, e.g. its ``locals()``) that
        ``option_ranges`` names and does not accept.

        Raises:
            ConfigError: ``<method>: method.<option>=<value> is out of range: it must be <range>``.
        """
        for key, allowed in cls.option_ranges.items():
            if key in options and not allowed.accepts(options[key]):
                raise ConfigError(f"{cls.name}: {out_of_range(f'method.{key}', options[key], allowed)}")

    def setup(self, problem: Problem) -> None:
        """Create the fitting state for ``problem``; called once before ``fit``."""
        self.problem = problem

    def use_validation(self, x_val: Tensor, y_val: Tensor, run_dir: str | Path | None = None) -> None:
        """Receive the run's validation data (never test data) and run folder before fitting, for a method
        that tunes itself on validation (Laplace's (N, τ) search); ignored by default."""
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
        """The flat parameters ``(D,)`` a finished run keeps in ``params.pt``: the point estimate
        (MAP, MC dropout's weights) or the posterior mean, or ``None`` where there is no single one
        (ensembles, HMC). By default the mean of :meth:`posterior`."""
        posterior = self.posterior()
        return None if posterior is None else posterior.mean

    def kl_to_prior(self) -> Tensor | None:
        """KL(q ‖ prior) of a variational posterior (a scalar tensor), or ``None``.

        With it the runner reports the ELBO per training example,
        ``E_q[log p(D | θ)] / N − KL / N``, estimated on the whole training set.
        """
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume fitting (tensors and plain numbers only)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        if state:
            raise NotImplementedError(f"method {self.name!r} cannot restore a checkpoint")

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
            NonFiniteLossError: naming the method, epoch and the first step whose loss is not finite. A
                loss returned as a tensor is checked at the end of its epoch (or when a later step of the
                epoch raises), not after every step: reading it would make every step wait for the GPU.
        """
        augment = self.problem.augmentation

        def step(idx: Tensor) -> Mapping[str, float | Tensor]:
            return self.train_step(x[idx] if augment is None else augment(x[idx], data_generator), y[idx])

        def report(epoch: int, stats: Sequence[Mapping[str, float]]) -> None:
            if on_epoch_end is not None:
                on_epoch_end(epoch, {**stats[0], **self.epoch_stats()})

        self._epochs(step, x, None, n_epochs, batch_size, data_generator, report, start_epoch)

    def epoch_stats(self) -> Mapping[str, float]:
        """Entries of a single run's epoch beyond the means of the steps' statistics (the layer-wise VI methods'
        gradient SNR), read once per epoch by :meth:`fit`; none by default."""
        return {}

    def _epochs(
        self,
        step: Callable[[Tensor], Mapping[str, float | Tensor]],
        x: Tensor,
        n_copies: int | None,
        n_epochs: int,
        batch_size: int,
        data_generator: torch.Generator,
        on_epoch_end: ReplicaEpochCallback | None,
        start_epoch: int = 0,
    ) -> None:
        """The loop of :meth:`fit` (``n_copies`` ``None``) and :meth:`fit_replicas` (``x`` ``(R, N, ...)``):
        epochs ``start_epoch + 1 .. n_epochs`` of ``step`` on the minibatch indices of a fresh permutation of the N
        examples, each epoch's losses checked and the means of the steps' statistics (numbers, 0-dim tensors, or
        the copies' ``(R,)`` tensors) passed on, one mapping per copy."""
        n = x.shape[0 if n_copies is None else 1]
        n_batches = math.ceil(n / min(batch_size, n))
        for epoch in range(start_epoch, n_epochs):
            totals: dict[str, float | Tensor] = {}
            losses: list[float | Tensor] = []
            try:
                for idx in _step_bar(_minibatches(n, batch_size, data_generator, x.device), epoch, self.step_progress):
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
    def configure_replicas(self, options: Sequence[Mapping[str, Any]]) -> None:
        """Give the next :meth:`setup_replicas` each copy's method options (its config); only the keys of
        ``replica_options`` may differ between copies (the others are this method's, built from the first).

        Raises:
            CannotStack: naming an option that differs between copies but cannot.
        """
        keys = {k for o in options for k in o}
        differing = sorted(k for k in keys if len({repr(o.get(k)) for o in options}) > 1)
        fixed = [k for k in differing if k not in self.replica_options]
        if fixed:
            raise CannotStack(
                f"method {self.name!r}: stacked copies must share {', '.join(f'method.{k}' for k in fixed)}"
            )
        self._replica_options = [dict(o) for o in options]

    def replica_option(self, key: str) -> list[Any]:
        """Each copy's value of option ``key`` (this method's own where :meth:`configure_replicas` gave none)."""
        n_copies = len(self._replica_problems)
        options = getattr(self, "_replica_options", None) or [{}] * n_copies
        if len(options) != n_copies:
            raise ValueError(f"configure_replicas got {len(options)} option sets for {n_copies} copies")
        return [o.get(key, getattr(self, key)) for o in options]

    def setup_replicas(self, problems: Sequence[Problem]) -> None:
        """Create the fitting state of ``len(problems)`` independent copies (one per split).

        Raises:
            CannotStack: for methods without ``supports_replicas`` (and configs a method cannot stack).
        """
        raise CannotStack(f"method {self.name!r} cannot fit several splits at once")

    def train_step_replicas(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """One update of every copy on its minibatch ``x`` ``(R, M, ...)``, ``y`` ``(R, M)``; the
        statistics of :meth:`train_step`, each as an ``(R,)`` tensor."""
        raise NotImplementedError(f"method {self.name!r} has no stacked training step")

    def replica(self, index: int) -> Method:
        """Copy ``index`` as an ordinary, set-up method (its own problem; state copied, not shared)."""
        raise NotImplementedError(f"method {self.name!r} has no stacked copies")

    def fit_replicas(
        self, x: Tensor, y: Tensor, *, on_epoch_end: ReplicaEpochCallback | None = None, **loop: Any
    ) -> None:
        """:meth:`fit`'s loop for stacked copies: ``x`` ``(R, N, ...)``, ``y`` ``(R, N)``, and ``loop``,
        :meth:`fit`'s ``n_epochs``, ``batch_size``, ``data_generator`` and ``start_epoch``. Every copy sees its
        own data in the order a single run of the same seed uses (one permutation for all).

        Raises:
            NonFiniteLossError: naming the copy, epoch and first step whose loss is not finite (checked at
                the end of each epoch, or when a later step raises: see :meth:`fit`).
        """

        def step(idx: Tensor) -> Mapping[str, Tensor]:
            return self.train_step_replicas(x.index_select(1, idx), y.index_select(1, idx))

        self._epochs(step, x, x.shape[0], on_epoch_end=on_epoch_end, **loop)


class PostHocMethod(Method):
    """A method whose posterior is fitted once, on the whole training set, when training ends: the default loop's
    epochs train the point it starts from (``train_step``: Laplace's and HMC's MAP), then :meth:`fit_posterior` runs
    right before the last epoch's callback, so that the last ``history.csv`` row scores the posterior. A method
    with nothing to train (:attr:`trains_map` false: exact VI's L-BFGS, Laplace on a given MAP) fits it at once and
    reports it as epoch ``n_epochs`` (1 for ``n_epochs = 0``). A fit that ends without a posterior (no epoch left
    to train, and a checkpoint that held none) fits it then, with no callback.
    """

    trains_map: bool = True
    """Whether :meth:`fit` runs the default loop's epochs before :meth:`fit_posterior`."""

    @abstractmethod
    def fit_posterior(self, x: Tensor, y: Tensor) -> Mapping[str, float] | None:
        """Fit the posterior to all of ``(x, y)`` from the current state; returns entries of the last epoch's
        statistics (e.g. exact VI's ELBO), or ``None``."""

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
        """The training epochs (``loop``: the default loop's ``batch_size`` and ``data_generator``), then
        :meth:`fit_posterior` (see the class docstring)."""
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
    """A method written once, for R stacked copies: every tensor of its fitting state carries a leading copy
    dimension R, and a single run is the stack of one copy (R = 1).

    A subclass writes :meth:`setup_replicas` (calling this one first), :meth:`train_step_replicas`, and its
    evaluation (``predict``, ``posterior``, ``kl_to_prior``) for a one-copy state, reading copy 0's tensors
    through :meth:`only_copy`. It names in ``copy_state`` the attributes that hold ``(R, ...)`` tensors (or
    dataclasses, lists or dicts of them), which :meth:`replica` slices. Its single-run ``setup`` and
    ``train_step`` are derived here, so the step's maths exists once; a method whose state cannot carry the
    copy dimension for some configs raises :class:`CannotStack` from :meth:`setup_replicas` only when R > 1.
    """

    supports_replicas = True
    copy_state: ClassVar[tuple[str, ...]] = ()
    """Attributes holding the copies' state, each ``(R, ...)`` (sliced by :meth:`replica`)."""

    def setup(self, problem: Problem) -> None:
        """A single run: the stack of one copy."""
        self.setup_replicas([problem])

    def setup_replicas(self, problems: Sequence[Problem]) -> None:
        """Record the copies' problems (``self.problem`` is the first: the shared model, N and generator)."""
        if not problems:
            raise ValueError(f"method {self.name!r}: a stack needs at least one copy")
        self.problem = problems[0]
        self._replica_problems = list(problems)

    @property
    def n_copies(self) -> int:
        """R, the number of stacked copies (1 for a single run)."""
        return len(self._replica_problems)

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float | Tensor]:
        """:meth:`train_step_replicas` of the one copy on ``(x, y)``."""
        out = self.train_step_replicas(x.unsqueeze(0), y.unsqueeze(0))
        return {k: v[0] for k, v in out.items()}

    def replica(self, index: int) -> Method:
        """Copy ``index`` as a stack of one: each ``copy_state`` attribute sliced (copied, not shared) and its
        own ``replica_options``; for evaluation (its optimiser, if any, still holds the stack's tensors)."""
        options = {key: self.replica_option(key)[index] for key in self.replica_options}
        single = copy.copy(self)
        single.problem = self._replica_problems[index]
        single._replica_problems = [single.problem]
        single._replica_options = None
        for name in self.copy_state:
            setattr(single, name, _copy_of(getattr(self, name), index))
        for key, value in options.items():
            setattr(single, key, value)
        return single

    def only_copy(self, tensor: Tensor) -> Tensor:
        """``tensor[0]`` of a one-copy state (``(1, ...)`` → ``(...)``).

        Raises:
            RuntimeError: for a stack of several copies (evaluate ``replica(r)`` instead).
        """
        if tensor.shape[0] != 1:
            raise RuntimeError(f"method {self.name!r} holds {tensor.shape[0]} stacked copies: evaluate replica(r)")
        return tensor[0]


def _copy_of(value: Any, index: int) -> Any:
    """Copy ``index`` of a stacked state value, keeping its copy dimension (``(R, ...)`` → ``(1, ...)``)."""
    if isinstance(value, Tensor):
        return value[index : index + 1].detach().clone()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _copy_of(getattr(value, f.name), index) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    if isinstance(value, list | tuple):
        return type(value)(_copy_of(v, index) for v in value)
    if isinstance(value, dict):
        return {k: _copy_of(v, index) for k, v in value.items()}
    return value


def stacked_prior(problems: Sequence[Problem]) -> Tensor:
    """The copies' prior precisions, ``(R, D)``."""
    return torch.stack([p.prior_precision for p in problems])


def _check_losses(
    name: str, epoch: int, losses: Sequence[float | Tensor], n_copies: int | None, cause: BaseException | None = None
) -> None:
    """Raise :class:`NonFiniteLossError` naming the first of an epoch's step losses that is not finite and, for
    stacked copies (``n_copies`` not ``None``: each loss an ``(R,)`` tensor), its copy (one read of the device)."""
    for step, row in enumerate(_rows(losses)):
        copy = next((r for r, v in enumerate(row) if not math.isfinite(v)), None)
        if copy is not None:
            where = "" if n_copies is None else f" in stacked copy {copy}"
            raise NonFiniteLossError(
                f"method {name!r}: non-finite loss {row[copy]}{where} at epoch {epoch + 1}, step {step + 1}"
                " — lower the learning rate or check the precisions"
            ) from cause


def _rows(values: Sequence[float | Tensor]) -> list[list[float]]:
    """Each of ``values`` (a number, a 0-dim tensor or stacked copies' ``(R,)`` tensor) as a list of numbers, the
    tensors among them read from their device at once."""
    tensors = [v.detach().reshape(1, -1) for v in values if isinstance(v, Tensor)]
    read = iter(torch.cat(tensors).tolist() if tensors else [])
    return [next(read) if isinstance(v, Tensor) else [float(v)] for v in values]


def _step_bar(batches: list[Tensor], epoch: int, enabled: bool) -> Any:
    return delayed_bar(batches, desc=f"epoch {epoch + 1}", unit="step", enabled=enabled, total=len(batches))


def _minibatches(n: int, batch_size: int, generator: torch.Generator, device: torch.device) -> list[Tensor]:
    """One epoch's minibatch indices: a fresh permutation of ``range(n)`` from ``generator``, cut into
    ``ceil(n / batch_size)`` slices (the last one shorter)."""
    order = torch.randperm(n, generator=generator).to(device)
    return list(order.split(min(batch_size, n)))


METHODS: dict[str, type[Method]] = {}


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    """Register a method class under the name users type after ``method=``."""

    def add(cls: type[Method]) -> type[Method]:
        if name in METHODS:
            raise ValueError(f"method name {name!r} is registered twice")
        cls.name = name
        METHODS[name] = cls
        return cls

    return add


def build_method(cfg: Mapping[str, Any]) -> Method:
    """Instantiate ``cfg['name']`` with the remaining keys as keyword arguments."""
    from bdl_bench.methods import import_all

    import_all()
    name = cfg["name"]
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name](**{k: v for k, v in cfg.items() if k != "name"})
