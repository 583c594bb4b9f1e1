r"""``method.search``: choose N and τ of :math:`P = N\mathbf I + \operatorname{diag}(\tau)` after one curvature pass
(they enter only the assembly, :mod:`.structures`): on a validation grid (:func:`grid_search`; Lee et al. 2020,
App. E.3.1) or by the Laplace marginal likelihood (:func:`maximise_evidence`; MacKay 1992, Immer et al. 2021)."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bdl_bench.curvature.pseudo_grads import KronSlot, block_index
from bdl_bench.errors import ConfigError, Terminated
from bdl_bench.gaussians import StructuredGaussian
from bdl_bench.likelihoods import Gaussian, Likelihood
from bdl_bench.metrics import predictive_metrics

logger = logging.getLogger(__name__)

SEARCH_FILE = "laplace_search.csv"  # the (N, τ) grid of method.search, one row per point
PROGRESS_FILE = "laplace_search.progress.jsonl"  # the points evaluated so far: a stopped search resumes from them
_SEARCH_COLUMNS = ("accuracy", "ece", "nll", "rmse")  # validation metrics kept per grid point (where defined)

Assemble = Callable[[Any, Tensor], StructuredGaussian]
"""``(N, τ (D,)) -> posterior`` at the fitted curvature (N a number or a 0-dim tensor)."""
Outputs = Callable[[StructuredGaussian | None, Tensor, int, int], Tensor]
"""``(posterior or None for the MAP, x, n_samples, seed) -> (n_samples, N, out)`` outputs, drawn from a generator
seeded with ``seed``."""


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """``method.search``: choose N and τ on the first ``max_val_examples`` validation examples (``None``: all) by
    :func:`grid_search` (Lee et al. 2020, App. E.3.1: N in {1, 50000, 100000}, 100 values of τ, the minimum-ECE
    point with accuracy like the MAP's)."""

    dataset_scale: tuple[float, ...]
    prior_precision: tuple[float, ...]
    n_samples: int = 5
    max_val_examples: int | None = 2000
    criterion: str = "ece"
    accuracy_tolerance: float | None = 0.005
    prune_accuracy_drop: float | None = 0.05

    @classmethod
    def parse(cls, cfg: Mapping[str, Any]) -> SearchSettings:
        _check_keys(cls, cfg, "method.search")
        out = dict(cfg)
        for key in ("dataset_scale", "prior_precision"):
            values = out.get(key)
            if isinstance(values, Mapping):
                values = _logspace(key, values)
            values = [values] if isinstance(values, int | float) else list(values or [])
            if not values or not all(float(v) > 0 for v in values):
                raise ConfigError(
                    f"laplace: method.search.{key} must be a non-empty list of positive numbers, got {values}"
                )
            out[key] = tuple(float(v) for v in values)
        settings = cls(**out)
        for name, value in (("n_samples", settings.n_samples), ("max_val_examples", settings.max_val_examples or 1)):
            if int(value) != value or value < 1:
                raise ConfigError(f"laplace: method.search.{name} must be an integer >= 1, got {value}")
        return settings


@dataclasses.dataclass(frozen=True)
class MarglikSettings:
    """``method.search=marglik``: maximise the Laplace log marginal likelihood (MacKay 1992; Immer et al. 2021)

    .. math::

        \\log p(\\mathcal D\\mid\\tau,\\gamma) \\approx \\log p(\\mathcal D\\mid\\theta_*,\\gamma)
        - \\tfrac12\\textstyle\\sum_d\\tau_d\\theta_{*d}^2 + \\tfrac12\\sum_d\\log\\tau_d - \\tfrac12\\log|P(\\tau,\\gamma)|

    over the prior precision τ (``prior``: one per weight layer, weights and bias alike, or one ``scalar``) and, for a
    Gaussian likelihood, the noise precision γ, at the MAP :math:`\\theta_*`, with the posterior's own precision
    :math:`P = N(\\gamma/\\gamma_0)\\mathbf I + \\operatorname{diag}(\\tau)` in the chosen ``structure``: the curvature of a
    Gaussian likelihood is linear in γ (GGN and Fisher alike), so its eigenvalues scale with it and the gradient
    of :math:`\\log|P|` in γ is exact. ``n_steps`` of Adam (``lr``) on :math:`\\log\\tau`, :math:`\\log\\gamma` from the
    run's values, one curvature pass; no validation data. ``noise`` (regression only): ``true`` fits γ, ``false`` keeps
    the run's, ``residual`` fixes :math:`\\gamma = n / \\sum_i (f_*(x_i) - y_i)^2` (laplace-torch's usual recipe)."""

    prior: str = "layer"
    noise: bool | str = "residual"
    n_steps: int = 300
    lr: float = 0.1

    @classmethod
    def parse(cls, cfg: Mapping[str, Any] | None) -> MarglikSettings:
        cfg = dict(cfg or {})
        _check_keys(cls, cfg, "method.search.marglik")
        settings = cls(**cfg)
        if settings.noise not in (True, False, "residual"):
            raise ConfigError(
                f"laplace: method.search.marglik.noise must be true, false or residual, got {settings.noise!r}"
            )
        if settings.prior not in ("layer", "scalar"):
            raise ConfigError(f"laplace: method.search.marglik.prior must be layer or scalar, got {settings.prior!r}")
        if int(settings.n_steps) != settings.n_steps or settings.n_steps < 1 or not settings.lr > 0:
            raise ConfigError(
                f"laplace: method.search.marglik needs n_steps >= 1 and lr > 0, got {settings.n_steps}, {settings.lr}"
            )
        return settings


def parse_search(search: Mapping[str, Any] | str | None) -> SearchSettings | MarglikSettings | None:
    """``method.search``: ``null``, ``marglik``, ``{marglik: {...}}`` or a validation grid (:class:`SearchSettings`)."""
    if search is None:
        return None
    if isinstance(search, str):
        if search != "marglik":
            raise ConfigError(
                f"laplace: method.search must be null, marglik, {{marglik: {{...}}}} or a grid mapping, got {search!r}"
            )
        return MarglikSettings.parse(None)
    if set(search) == {"marglik"}:
        return MarglikSettings.parse(search["marglik"])
    return SearchSettings.parse(search)


def _check_keys(cls: type, cfg: Mapping[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"laplace: unknown {where} keys {unknown}; known: {', '.join(sorted(known))}")


def _logspace(key: str, spec: Mapping[str, Any]) -> list[float]:
    """``{logspace: [a, b, n]}``: n values from 10^a to 10^b, evenly spaced in the logarithm."""
    triple = spec.get("logspace") if set(spec) == {"logspace"} else None
    if not isinstance(triple, list | tuple) or len(triple) != 3 or int(triple[2]) != triple[2] or triple[2] < 1:
        raise ConfigError(
            f"laplace: method.search.{key} must be a list of positive numbers or {{logspace: [a, b, n]}} "
            f"(n >= 1 values from 10^a to 10^b), got {dict(spec)}"
        )
    return torch.logspace(float(triple[0]), float(triple[1]), int(triple[2]), dtype=torch.float64).tolist()


@dataclasses.dataclass
class SearchResult:
    """What a search chose: the posterior (model dtype), the ``metrics.json`` entries reporting the choice, the
    grid's points (:func:`write_search_table`; empty for marglik) and the Gaussian likelihood at the noise marglik
    fitted or fixed."""

    posterior: StructuredGaussian
    metrics: dict[str, float]
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    likelihood: Gaussian | None = None


# ---------------------------------------------------------------------- the (N, τ) grid (DEF App. E.3.1)
def grid_search(
    settings: SearchSettings,
    *,
    theta: Tensor,
    assemble: Assemble,
    outputs: Outputs,
    likelihood: Likelihood,
    generator: torch.Generator,
    x_val: Tensor,
    y_val: Tensor,
    progress_path: Path | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> SearchResult:
    """Lee et al. (2020), App. E.3.1: every (N, τ) of the grid on one curvature fit; keep the lowest
    validation ``criterion`` among points whose validation accuracy is within ``accuracy_tolerance``
    of the MAP's. For each N, τ goes from large to small and, once accuracy falls more than
    ``prune_accuracy_drop`` below the MAP's, the smaller τ are skipped (``pruned``); either ``None``, or a
    likelihood without accuracy, turns that step off. Every point is scored on ``n_samples`` draws of the same
    posterior noise (one seed drawn from ``generator``: common random numbers). ``assemble`` gives the
    posterior in the model's dtype. ``progress_path``: each evaluated point is appended there as it is scored,
    and a search started again on the same fit (:class:`_Progress`) takes the points found there instead of
    scoring them again, so its rows and choice are those of an unbroken search. A SIGTERM (``stop_requested``)
    stops the search before its next unscored point with :class:`~bdl_bench.errors.Terminated`."""
    cfg = settings
    if cfg.max_val_examples is not None:
        x_val, y_val = x_val[: cfg.max_val_examples], y_val[: cfg.max_val_examples]
    started = time.perf_counter()
    reference = predictive_metrics(likelihood, outputs(None, x_val, 1, 0), y_val)
    if cfg.criterion not in reference:
        raise ConfigError(
            f"laplace: method.search.criterion={cfg.criterion!r} is not a validation metric of this likelihood "
            f"(choices: {', '.join(sorted(reference))})"
        )
    map_accuracy = reference.get("accuracy")
    seed = int(torch.randint(2**31 - 1, (1,), generator=generator, device=generator.device))
    fit = {"seed": seed, "map_metrics": reference, "n_val": int(y_val.shape[0]), "n_samples": cfg.n_samples}
    progress = _Progress(progress_path, fit)
    rows: list[dict[str, Any]] = []
    for scale in cfg.dataset_scale:
        pruned = False
        for tau in sorted(cfg.prior_precision, reverse=True):
            row: dict[str, Any] = {"dataset_scale": scale, "prior_precision": tau, "status": "pruned"}
            rows.append(row)
            if pruned:
                continue
            scored = progress.done.get((scale, tau))
            if scored is None:
                if stop_requested():  # the points so far are in the progress file: a rerun resumes after them
                    scored_so_far = sum(r["status"] == "evaluated" for r in rows)
                    kept = f"its {scored_so_far} scored points kept in {PROGRESS_FILE}" if progress_path else ""
                    raise Terminated(
                        f"stopped by SIGTERM during the Laplace search ({kept or 'no run folder'}); "
                        "run the same command to resume"
                    )
                tic = time.perf_counter()
                posterior = assemble(scale, torch.full_like(theta, tau))
                metrics = predictive_metrics(likelihood, outputs(posterior, x_val, cfg.n_samples, seed), y_val)
                scored = {f"val_{k}": metrics[k] for k in _SEARCH_COLUMNS if k in metrics}
                scored["time_s"] = time.perf_counter() - tic
                progress.record(scale, tau, scored)
                logger.info(
                    "laplace search: N=%g, tau=%.4g (point %d of at most %d): val %s %.4g, accuracy %s (%.0f s)",
                    scale,
                    tau,
                    sum(r["status"] == "evaluated" for r in rows) + 1,
                    len(cfg.dataset_scale) * len(cfg.prior_precision),
                    cfg.criterion,
                    scored[f"val_{cfg.criterion}"],
                    f"{scored['val_accuracy']:.4f}" if "val_accuracy" in scored else "-",
                    scored["time_s"],
                )
            row.update(scored, status="evaluated")
            if map_accuracy is not None and cfg.prune_accuracy_drop is not None:
                pruned = row["val_accuracy"] < map_accuracy - cfg.prune_accuracy_drop
    evaluated = [r for r in rows if r["status"] == "evaluated" and math.isfinite(r[f"val_{cfg.criterion}"])]
    if not evaluated:
        raise ConfigError("laplace: no grid point of method.search gave a finite validation criterion")
    for r in evaluated:
        r["eligible"] = (
            map_accuracy is None
            or cfg.accuracy_tolerance is None
            or r["val_accuracy"] >= map_accuracy - cfg.accuracy_tolerance
        )
    eligible = [r for r in evaluated if r["eligible"]]
    if not eligible:  # nothing keeps the MAP's accuracy: take the most accurate point
        logger.warning("laplace search: no grid point within the accuracy tolerance; taking the most accurate")
        best = max(evaluated, key=lambda r: r["val_accuracy"])
    else:
        best = min(eligible, key=lambda r: r[f"val_{cfg.criterion}"])
    best["chosen"] = True
    chosen_scale, chosen_tau = best["dataset_scale"], best["prior_precision"]
    logger.info(
        "laplace search: N=%g, τ=%g (validation %s %.4g) of %d grid points in %.0f s",
        chosen_scale,
        chosen_tau,
        cfg.criterion,
        best[f"val_{cfg.criterion}"],
        len(evaluated),
        time.perf_counter() - started,
    )
    posterior = assemble(chosen_scale, torch.full_like(theta, chosen_tau))
    chosen = {
        "chosen_dataset_scale": chosen_scale,
        "chosen_prior_precision": chosen_tau,
        f"search_val_{cfg.criterion}": best[f"val_{cfg.criterion}"],
        "search_n_evaluated": len(evaluated),
        "search_n_resumed": len(progress.done),  # points scored by an earlier, stopped attempt
        "search_time_s": time.perf_counter() - started,
        **({"search_map_val_accuracy": map_accuracy} if map_accuracy is not None else {}),
        **({"search_val_accuracy": best["val_accuracy"]} if "val_accuracy" in best else {}),
    }
    return SearchResult(posterior, chosen, rows)


class _Progress:
    """The search's points scored so far, one JSON line each after a header line naming the fit they belong to
    (the common-random-numbers seed, the MAP's validation metrics, the validation size and sample count). Points
    of another fit (a changed MAP, generator stream or setting) are discarded with a warning. JSON keeps every
    float exactly, so resumed points are the unbroken search's bit for bit."""

    def __init__(self, path: Path | None, fit: dict[str, Any]) -> None:
        self.path, self.done = path, {}
        if path is None:
            return
        header = json.dumps({"fit": fit})
        lines = path.read_text().splitlines() if path.exists() else []
        if lines and lines[0] == header:
            for line in lines[1:]:
                try:
                    point = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill
                    break
                self.done[(point.pop("dataset_scale"), point.pop("prior_precision"))] = point
            logger.info("laplace search: resuming with %d scored points from %s", len(self.done), path)
        elif lines:
            logger.warning("laplace search: %s belongs to another fit; scoring the grid from the start", path)
        with open(path, "w") as handle:  # the header and the usable points: a torn last line goes
            handle.write(header + "\n")
            handle.writelines(
                json.dumps({"dataset_scale": k[0], "prior_precision": k[1], **v}) + "\n" for k, v in self.done.items()
            )

    def record(self, scale: float, tau: float, scored: dict[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"dataset_scale": scale, "prior_precision": tau, **scored}) + "\n")


def write_search_table(rows: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """:func:`grid_search`'s rows as a CSV (``laplace_search.csv`` in a run folder): N, τ, status (``evaluated`` or
    ``pruned``), the validation metrics, ``eligible``, ``chosen`` and the seconds per point."""
    columns = ["dataset_scale", "prior_precision", "status", *(f"val_{k}" for k in _SEARCH_COLUMNS)]
    columns += ["eligible", "chosen", "time_s"]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**r, "chosen": r.get("chosen", False)} for r in rows)


# ---------------------------------------------------------------------- the marginal likelihood (method.search=marglik)
def prior_groups(prior: str, slots: Sequence[KronSlot], theta: Tensor) -> Tensor:
    """``(D,)`` the prior group of each parameter: its layer's index (``prior: layer``) or 0 (``scalar``)."""
    groups = torch.zeros(theta.shape[0], dtype=torch.long, device=theta.device)
    if prior == "layer":
        for k, slot in enumerate(slots):
            groups[block_index(slot, theta.device)] = k
    return groups


class LaplaceEvidence:
    """:class:`MarglikSettings`' log marginal likelihood at a fitted MAP and curvature, differentiable in
    (log τ per group, log γ). ``assemble``: the float64 posterior at (N, τ), differentiable in both; ``groups``:
    :func:`prior_groups`; ``f``: the MAP's float64 outputs on the training set ``(n, out)``; ``scale``: the N of the
    curvature at the run's noise γ₀ (``noise0``, 1 for classification). ``data_term``: Σ (f_* − y)² for a Gaussian
    likelihood (standardised targets), else the summed NLL at θ_*."""

    def __init__(
        self,
        assemble: Assemble,
        theta: Tensor,
        groups: Tensor,
        f: Tensor,
        y: Tensor,
        likelihood: Likelihood,
        scale: float,
    ) -> None:
        self._assemble, self.theta, self._scale = assemble, theta, scale
        self.groups, self.n_data = groups, y.shape[0]
        self.gaussian = isinstance(likelihood, Gaussian)
        self.noise0 = float(likelihood.noise_precision) if isinstance(likelihood, Gaussian) else 1.0
        self.data_term = ((f.squeeze(-1) - y.double()) ** 2).sum() if self.gaussian else likelihood.nll(f, y).sum()

    def posterior(self, log_tau: Tensor, log_gamma: Tensor) -> StructuredGaussian:
        """The float64 posterior of precision :math:`N(\\gamma/\\gamma_0)\\mathbf I + \\operatorname{diag}(\\tau)`."""
        ratio = (log_gamma - math.log(self.noise0)).exp() if self.gaussian else 1.0
        return self._assemble(self._scale * ratio, log_tau.exp()[self.groups])

    def __call__(self, log_tau: Tensor, log_gamma: Tensor) -> Tensor:
        """:math:`\\log p(\\mathcal D\\mid\\theta_*,\\gamma) - \\frac12\\sum\\tau_d\\theta_d^2 + \\frac12\\sum\\log\\tau_d
        - \\frac12\\log|P|` (the 2π of prior and posterior cancel)."""
        tau = log_tau.exp()[self.groups]
        if self.gaussian:
            n = self.n_data
            log_lik = 0.5 * n * (log_gamma - math.log(2 * math.pi)) - 0.5 * log_gamma.exp() * self.data_term
        else:
            log_lik = -self.data_term
        prior = -0.5 * (tau * self.theta.square()).sum() + 0.5 * log_tau[self.groups].sum()
        return log_lik + prior - 0.5 * self.posterior(log_tau, log_gamma).logdet_precision()


def maximise_evidence(
    settings: MarglikSettings,
    objective: LaplaceEvidence,
    prior: Tensor,
    cast: Callable[[StructuredGaussian], StructuredGaussian],
    started: float | None = None,
) -> SearchResult:
    """Adam on ``objective`` from the run's prior ``prior`` ``(D,)`` (its mean per group) and noise; the posterior
    at the optimum, ``cast`` to the model's dtype. ``started``: the ``time.perf_counter()`` the search's time counts
    from (default: now)."""
    started = time.perf_counter() if started is None else started
    theta = objective.theta
    n_groups = int(objective.groups.max()) + 1
    start = torch.zeros(n_groups, dtype=theta.dtype, device=theta.device).index_add_(0, objective.groups, prior)
    counts = torch.bincount(objective.groups, minlength=n_groups).to(theta)
    log_tau = (start / counts).log().requires_grad_(True)
    log_gamma = torch.tensor(math.log(objective.noise0), dtype=theta.dtype, device=theta.device)
    residual_noise = objective.gaussian and settings.noise == "residual"
    if residual_noise:  # γ = n / Σ residual² of the MAP, held fixed
        log_gamma = torch.log(objective.n_data / objective.data_term.detach()).to(log_gamma)
    fit_noise = objective.gaussian and settings.noise is True
    params = [log_tau, log_gamma.requires_grad_(True)] if fit_noise else [log_tau]
    optimizer = torch.optim.Adam(params, lr=settings.lr)
    with torch.no_grad():
        initial = float(objective(log_tau, log_gamma))
    for _ in range(settings.n_steps):
        optimizer.zero_grad()
        loss = -objective(log_tau, log_gamma)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        value = float(objective(log_tau, log_gamma))
        tau = log_tau.exp()
        posterior = cast(objective.posterior(log_tau, log_gamma))
    if not math.isfinite(value):
        raise FloatingPointError("laplace: the marginal likelihood is not finite at the end of method.search=marglik")
    metrics: dict[str, float] = {
        "marglik": value / objective.n_data,
        "marglik_initial": initial / objective.n_data,
        "search_time_s": time.perf_counter() - started,
    }
    metrics.update({f"chosen_prior_precision_{k}": float(t) for k, t in enumerate(tau)})
    likelihood = None
    if fit_noise or residual_noise:
        gamma = float(log_gamma.detach().exp())
        metrics["chosen_noise_precision"] = gamma  # standardised targets
        likelihood = Gaussian(gamma)
    logger.info(
        "laplace marglik: log p(D)/n %.4g -> %.4g, τ %s%s in %.1f s",
        metrics["marglik_initial"],
        metrics["marglik"],
        [f"{float(t):.3g}" for t in tau],
        f", γ {metrics['chosen_noise_precision']:.3g}" if likelihood is not None else "",
        metrics["search_time_s"],
    )
    return SearchResult(posterior, metrics, likelihood=likelihood)
