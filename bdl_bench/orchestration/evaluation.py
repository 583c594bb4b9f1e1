"""What a run reports: test and OOD metrics of a fitted method, the ELBO per example (estimated, or exact for
logistic regression), an epoch's history row, and the stacked copies' final predictions made together."""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bdl_bench.data.base import Dataset
from bdl_bench.errors import ConfigError
from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood
from bdl_bench.methods import Method
from bdl_bench.metrics import gaussian_predictive_metrics, ood_metrics, predictive_metrics, uncertainty_arrays
from bdl_bench.results import atomic_write_bytes


@torch.no_grad()
def evaluate(
    method: Method,
    likelihood: Likelihood,
    dataset: Dataset,
    n_samples: int,
    part: str = "test",
    f_samples: torch.Tensor | None = None,
) -> dict[str, float]:
    """Predictive metrics of ``method`` on ``part`` (``test`` or ``val``) with ``n_samples`` MC samples
    (or the given output samples ``f_samples`` of that part).

    A regression method whose predictive is Gaussian in closed form (``predictive_moments``: the linearised
    Laplace) is scored on it: ``rmse``, ``test_ll`` and ``nll`` are exact, the MC mixture's LL is kept as
    ``test_ll_mc`` and ``test_ll_joint`` stays the MC estimate (it needs joint samples)."""
    x, y = getattr(dataset, f"x_{part}"), getattr(dataset, f"y_{part}")
    if f_samples is None:
        f_samples = method.predict(x, n_samples)
    metrics = predictive_metrics(likelihood, f_samples, y, y_mean=dataset.y_mean, y_std=dataset.y_std)
    moments = getattr(method, "predictive_moments", None)
    closed_form = moments(x) if isinstance(likelihood, Gaussian) and callable(moments) else None
    if closed_form is not None:
        metrics["test_ll_mc"] = metrics["test_ll"]
        metrics.update(gaussian_predictive_metrics(likelihood, *closed_form, y, y_std=dataset.y_std))
    return metrics


@torch.no_grad()
def evaluate_ood(
    likelihood: Likelihood, dataset: Dataset, run_dir: Path, f_test: torch.Tensor, f_ood: torch.Tensor
) -> dict[str, float]:
    """Predictive entropy on the out-of-distribution set against the test set (DEF Table 1) from output samples
    on both, and the AUROC of telling them apart by entropy; saves ``uncertainty.npz`` (``bdl-bench plot ood``)."""
    if not isinstance(likelihood, Bernoulli | Categorical):
        raise ValueError(f"OOD metrics need a classification likelihood, got {type(likelihood).__name__}")
    probs_test, probs_ood = likelihood.probs(f_test), likelihood.probs(f_ood)
    arrays = uncertainty_arrays(probs_test, dataset.y_test, probs_ood)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(run_dir / "uncertainty.npz", buffer.getbuffer())
    return ood_metrics(probs_test, probs_ood)


@torch.no_grad()
def prefix_metrics(
    method: Method,
    likelihood: Likelihood,
    dataset: Dataset,
    f_test: torch.Tensor,
    f_ood: torch.Tensor | None,
    k: int,
) -> dict[str, float]:
    """The test (and OOD) metrics of the first ``k`` of the run's test samples, keyed ``<metric>_s<k>``: what a run
    with ``trainer.n_test_mc_samples=k`` would have reported from the same draws (the samples are independent, so
    their first ``k`` are ``k`` samples), for the effect of the sample count at the cost of one run."""
    metrics = evaluate(method, likelihood, dataset, k, f_samples=f_test[:k])
    if f_ood is not None:
        metrics.update(ood_metrics(likelihood.probs(f_test[:k]), likelihood.probs(f_ood[:k])))
    return {f"{name}_s{k}": value for name, value in metrics.items()}


def save_predictive(run_dir: Path, likelihood: Likelihood, dataset: Dataset, f_test: torch.Tensor) -> None:
    """Write ``predictive.npz``: a regression run's predictive on the test inputs, in original units.

    ``f_mean`` and ``f_std`` are the mean and (population) standard deviation of the network output over the
    ``(S, N, 1)`` samples ``f_test`` (the epistemic part), ``noise_std`` the likelihood's noise standard
    deviation, and ``y_test`` the test targets; the toy figures (``bdl_bench.studies.def_toy``) draw from it.
    """
    if not isinstance(likelihood, Gaussian):
        raise ConfigError("trainer.save_predictive needs a regression run (Gaussian likelihood)")
    f = f_test.detach().reshape(f_test.shape[0], f_test.shape[1]).double().cpu()
    y_std = float(dataset.y_std)
    np.savez(
        run_dir / "predictive.npz",
        f_mean=(dataset.y_mean + y_std * f.mean(0)).numpy(),
        f_std=(y_std * f.std(0, unbiased=False)).numpy(),
        noise_std=np.float64(y_std / math.sqrt(float(likelihood.noise_precision))),
        y_test=(dataset.y_mean + y_std * dataset.y_test.double().cpu()).numpy(),
    )


@torch.no_grad()
def elbo_per_example(method: Method, likelihood: Likelihood, dataset: Dataset, n_samples: int) -> float | None:
    """``E_q[log p(D | θ)] / N − KL(q ‖ prior) / N`` on the training set, or ``None`` without a KL.

    The expectation is a Monte Carlo average over ``n_samples`` posterior samples, unless the
    method's posterior offers an exact value for this likelihood (logistic regression: quadrature).
    Regression log-likelihoods are those of the standardised targets the method was fitted on.
    """
    kl = method.kl_to_prior()
    if kl is None:
        return None
    expected_loglik = _exact_expected_loglik(method, likelihood, dataset)
    if expected_loglik is None:
        expected_loglik = _chunked_expected_loglik(method, likelihood, dataset.x_train, dataset.y_train, n_samples)
    return (expected_loglik - float(kl)) / dataset.n_train


ELBO_CHUNK_ELEMENTS = 2**26  # samples x rows x widest layer per forward pass: 256 MB of float32 activations


def _chunked_expected_loglik(method: Method, likelihood: Likelihood, x: torch.Tensor, y: torch.Tensor, n: int) -> float:
    """``(1/S) Σ_s Σ_i log p(y_i | x_i, θ_s)`` over memory-bounded chunks of rows. Every chunk replays the
    method generator's state, so the S posterior samples are the same for every chunk (a method that draws
    whole parameter vectors gives the one-pass value)."""
    widest = max((p.shape[0] for p in method.problem.model.parameters()), default=1)
    rows = max(1, ELBO_CHUNK_ELEMENTS // (n * widest))
    generator = method.problem.generator
    start_state = generator.get_state()
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, x.shape[0], rows):
        generator.set_state(start_state)
        f_samples = method.predict(x[start : start + rows], n)  # (S, rows, out)
        total += torch.stack([-likelihood.nll(f, y[start : start + rows]).sum() for f in f_samples]).double().sum()
    return float(total) / n


def elbo_without_bias_logdet(elbo: float, model: torch.nn.Module, prior: torch.Tensor, n_train: int) -> float | None:
    r"""The SLANG authors' ELBO for logistic regression: ours minus :math:`\tfrac12\log\lambda_{bias}/N`.

    Their reported ELBO (``chol_log_reg.m`` in aaronpmishkin/SLANG, used for every Table 1 column) sums
    the prior's log-precisions over ``lambda(2:end)`` only: the bias's :math:`\tfrac12\log\lambda_0`
    term of :math:`-\mathrm{KL}` is left out (their comment: "?why 2:end?"). With the bias prior
    precision 1e-5 that raises the ELBO by :math:`5.76/N` per example. ``None`` unless the model is one
    ``nn.Linear`` with a bias (our bias is the last coordinate of the flat parameter vector).
    """
    linear = _only_linear_layer(model)
    if linear is None or linear.bias is None:
        return None
    return elbo - 0.5 * math.log(float(prior[-1])) / n_train


def _only_linear_layer(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's one ``nn.Linear`` if it holds every parameter (logistic regression), else ``None``."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if len(linears) != 1 or len(list(model.parameters())) != len(list(linears[0].parameters())):
        return None
    return linears[0]


def _exact_expected_loglik(method: Method, likelihood: Likelihood, dataset: Dataset) -> float | None:
    """Quadrature value of ``Σ_i E_q[log p(y_i | x_i, θ)]`` for Bayesian logistic regression, else ``None``."""
    from bdl_bench.quadrature import expected_log_sigmoid

    posterior = method.posterior()
    model = method.problem.model
    linear = _only_linear_layer(model)  # not, e.g., the IMDB LSTM with its one linear head
    if not isinstance(likelihood, Bernoulli) or posterior is None or linear is None:
        return None
    x = dataset.x_train
    if linear.bias is not None:
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    mean, var = posterior.linear_moments(x.to(posterior.mean.dtype))
    sign = 2.0 * dataset.y_train.to(mean.dtype) - 1.0  # log p(y | f) = log σ(sign · f)
    return float(expected_log_sigmoid(sign * mean, var).sum())


def epoch_row(
    method: Method,
    likelihood: Likelihood,
    dataset: Dataset,
    epoch: int,
    train_stats: Mapping[str, float],
    *,
    elapsed: float,
    evaluate_now: bool,
    n_eval_samples: int,
    eval_generator: torch.Generator,
) -> dict[str, Any]:
    """One ``history.csv`` row: the epoch's training statistics, the training ELBO where the method
    has a KL, and (when ``evaluate_now``) test metrics from ``n_eval_samples`` posterior samples."""
    row: dict[str, Any] = {"epoch": epoch, **train_stats, "time_s": elapsed}
    kl = method.kl_to_prior()
    if kl is not None and "train/nll" in train_stats:
        row["train/elbo"] = -train_stats["train/nll"] - float(kl) / dataset.n_train
    if evaluate_now:
        with swap_generator(method, eval_generator):
            row.update({f"test/{k}": v for k, v in evaluate(method, likelihood, dataset, n_eval_samples).items()})
    return row


class SharedPredictions:
    """The final test and validation predictions of a stack's copies, made together where the method can
    (``predict_stack``: MC dropout draws each mask once for all copies) and every copy would make them
    alike: several copies, all evaluation generators in one state and every split's parts of one shape. Copies
    are predicted in groups of at most ``PREDICTION_ELEMENTS`` outputs per part; each group replays the shared
    generator state, and each copy's generator is then left where its own ``predict`` calls would leave it,
    so the metrics equal those of the copies predicted one by one (``finish_run`` without ``predictions``)."""

    PREDICTION_ELEMENTS = 2**26  # outputs (copies x samples x rows x out) held at once: 256 MB in float32

    def __init__(
        self, method: Any, datasets: Sequence[Any], generators: Sequence[torch.Generator], with_val: bool = True
    ) -> None:
        self.method, self.datasets, self.generators = method, list(datasets), list(generators)
        self.with_val = with_val  # False: the validation part is predicted per copy (its own sample count) or not
        self._group: list[int] = []
        self._outputs: dict[str, torch.Tensor] = {}
        self._end: torch.Tensor | None = None  # the generators' state after the present group's predictions
        states = [g.get_state() for g in self.generators]
        self.enabled = (
            len(self.datasets) > 1
            and callable(getattr(method, "predict_stack", None))
            and all(torch.equal(s, states[0]) for s in states)
            and all(self._shapes(d) == self._shapes(self.datasets[0]) for d in self.datasets)
        )

    @staticmethod
    def _shapes(dataset: Any) -> tuple:
        return tuple(tuple(getattr(dataset, f"x_{part}").shape) for part in ("test", "val"))

    def _parts(self) -> list[str]:
        return ["test"] + (["val"] if self.with_val and self.datasets[0].x_val.shape[0] > 0 else [])

    def of_copy(self, r: int, n_samples: int) -> dict[str, torch.Tensor] | None:
        """Copy ``r``'s ``{part: (S, N, out)}`` (``None`` where the copies are predicted one by one)."""
        if not self.enabled:
            return None
        if r not in self._group:
            rows = sum(getattr(self.datasets[0], f"x_{p}").shape[0] for p in self._parts())
            size = max(1, self.PREDICTION_ELEMENTS // (n_samples * rows))
            self._group = list(range(r, min(r + size, len(self.datasets))))  # copy r's generator is still at the start
            with swap_generator(self.method, self.generators[r]):
                self._outputs = {
                    p: self.method.predict_stack(
                        torch.stack([getattr(self.datasets[c], f"x_{p}") for c in self._group]), n_samples, self._group
                    )
                    for p in self._parts()
                }
            self._end = self.generators[r].get_state()
        self.generators[r].set_state(self._end)
        index = self._group.index(r)
        return {p: f[index] for p, f in self._outputs.items()}


@contextmanager
def swap_generator(method: Method, generator: torch.Generator) -> Iterator[None]:
    """Evaluate with a dedicated generator so that evaluation never shifts the training stream."""
    saved = method.problem
    method.problem = dataclasses.replace(saved, generator=generator)
    try:
        yield
    finally:
        method.problem = saved
