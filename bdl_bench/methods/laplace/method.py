"""``method=laplace``: the MAP fit, the curvature pass, and the posterior at the configured or searched (N, τ)."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from bdl_bench.curvature.pseudo_grads import CurvatureKind, KronLayout, iter_pseudo_grads, kron_layout
from bdl_bench.errors import ConfigError
from bdl_bench.gaussians import StructuredGaussian
from bdl_bench.gaussians.io import gaussian_class
from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods._shared import map_step, parse_choice
from bdl_bench.methods.base import PostHocMethod, Problem, register_method
from bdl_bench.methods.laplace.map_dir import load_map_parameters
from bdl_bench.methods.laplace.predictive import GaussianPredictive, Predictive, forward_rows
from bdl_bench.methods.laplace.search import (
    PROGRESS_FILE,
    SEARCH_FILE,
    LaplaceEvidence,
    MarglikSettings,
    SearchResult,
    SearchSettings,
    grid_search,
    maximise_evidence,
    parse_search,
    prior_groups,
    write_search_table,
)
from bdl_bench.methods.laplace.structures import (
    DEF_RANKS_FILE,
    STRUCTURES,
    KfacPrior,
    LaplaceStructure,
    NullSpace,
    Structure,
)
from bdl_bench.models.params import flat_params, forward_with
from bdl_bench.optim import adam
from bdl_bench.progress import delayed_bar
from bdl_bench.ranges import COUNT, NON_NEGATIVE_INT, POSITIVE, Range
from bdl_bench.results import atomic_write_text

_CURVATURE_DTYPES: dict[str, torch.dtype | None] = {"model": None, "float32": torch.float32, "float64": torch.float64}


@register_method("laplace")
class Laplace(GaussianPredictive, PostHocMethod):
    """Post-hoc Laplace approximation (the package docstring; options in ``conf/method/laplace.yaml`` and
    ``docs/laplace.md``). After a fit: ``fit_info`` (what the curvature pass and the assembly report),
    ``extra_metrics`` (the search's ``metrics.json`` entries), ``search_rows`` (``laplace_search.csv``),
    ``fitted_likelihood`` (the Gaussian at the noise ``search=marglik`` chose, which the runner scores with) and
    ``last_evidence`` (marglik's objective)."""

    adam_leaves = ("theta",)
    option_ranges = MappingProxyType(
        {
            "prior_precision": Range(0, nullable=True),  # null = the run's prior_precision; 0 needs null_space
            "dataset_scale": Range(0, low_open=True, nullable=True),  # null = the training-set size
            "lr": POSITIVE,
            "n_curvature_samples": COUNT,
            "curvature_batch_size": COUNT,
            "curvature_subset": Range(1, integer=True, nullable=True),
            "curvature_cache_mib": NON_NEGATIVE_INT,
            "rank": Range(1, integer=True, nullable=True),  # def: null = all eigenvalues
        }
    )

    def __init__(
        self,
        *,
        structure: str,
        curvature: str,
        n_curvature_samples: int,
        prior_precision: float | None,
        dataset_scale: float | None,
        rank: int | None,
        predictive: str,
        lr: float,
        map_dir: str | None,
        curvature_batch_size: int,
        curvature_dtype: str = "model",
        curvature_subset: int | None = None,
        curvature_cache_mib: int = 6144,
        search: Mapping[str, Any] | str | None = None,
        kfac_prior: str = "damped",
        null_space: str | None = None,
    ) -> None:
        self.structure = parse_choice(Structure, structure, "structure", "laplace")
        self.curvature = parse_choice(CurvatureKind, curvature, "curvature", "laplace")
        self.predictive = parse_choice(Predictive, predictive, "predictive", "laplace")
        self.kfac_prior = parse_choice(KfacPrior, kfac_prior, "kfac_prior", "laplace")
        self.null_space = parse_choice(NullSpace, null_space or "prior", "null_space", "laplace")
        self.keep_options(locals())
        if curvature_dtype not in _CURVATURE_DTYPES:
            raise ConfigError(
                f"laplace: unknown curvature_dtype {curvature_dtype!r}; choices: {', '.join(_CURVATURE_DTYPES)}"
            )
        self.curvature_dtype = _CURVATURE_DTYPES[curvature_dtype]
        self.map_dir = map_dir
        self.search = parse_search(search)
        self._check_null_space()
        self._posterior: StructuredGaussian | None = None
        self.fit_info: dict[str, float] = {}
        self.extra_metrics: dict[str, float] = {}
        self.search_rows: list[dict[str, Any]] = []
        self._val: tuple[Tensor, Tensor] | None = None
        self._run_dir: Path | None = None
        self.fitted_likelihood: Gaussian | None = None
        self.last_evidence: LaplaceEvidence | None = None

    # ------------------------------------------------------------------ MAP part
    def setup(self, problem: Problem) -> None:
        """Start the MAP fit from the model's parameters (or load them from ``map_dir``)."""
        super().setup(problem)
        if self.predictive is Predictive.AUTO:
            regression = isinstance(problem.likelihood, Gaussian)
            self.predictive = Predictive.LINEARISED if regression else Predictive.SAMPLE
        try:
            self._layout: KronLayout = kron_layout(problem.model)
        except ValueError as err:
            raise ConfigError(f"laplace: {err}") from None
        theta = flat_params(problem.model)
        if self.map_dir is not None:
            theta = load_map_parameters(self.map_dir, problem.model).to(theta)
        self.theta = theta.requires_grad_(True)
        self.optimizer = adam([self.theta], self.lr)
        self._posterior = None

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """One MAP step (as ``methods/map.py``)."""
        return map_step(self.problem, self.theta, self.optimizer, x, y)

    def fit(self, x: Tensor, y: Tensor, **options: Any) -> None:
        """:class:`PostHocMethod`'s fit, refused before any training when ``search`` has no validation set."""
        self._check_validation()
        super().fit(x, y, **options)

    @property
    def trains_map(self) -> bool:
        return self.map_dir is None

    @property
    def posterior_fitted(self) -> bool:
        return self._posterior is not None

    # ------------------------------------------------------------------ Laplace part
    def fit_posterior(self, x: Tensor, y: Tensor) -> None:
        """Compute the curvature at the current parameters (one data pass; EFB/DEF: a second one over the kept
        chunks) and build the posterior: at ``dataset_scale`` and ``prior_precision``, or at the (N, τ) that
        ``search`` picks."""
        p = self.problem
        self.fit_info, self.extra_metrics = {}, {}
        self._check_validation()
        theta = self.theta.detach().double()
        x_all, y_all = x, y
        x, y = self._curvature_data(x, y)
        theta_c = theta.to(self.curvature_dtype or self.theta.dtype)

        def batches(start: int = 0, labels: list[Tensor | None] | None = None):
            """Pseudo-gradients of the chunks of rows ``start:``, on ``labels`` (one entry per chunk) or new draws."""
            chunks = iter_pseudo_grads(
                p.model,
                theta_c,
                x[start:],
                y[start:],
                p.likelihood,
                batch_size=self.curvature_batch_size,
                kind=self.curvature,
                n_samples=self.n_curvature_samples,
                generator=p.generator,
                labels=None if self.curvature is CurvatureKind.GGN else labels,
            )
            n_chunks = math.ceil((x.shape[0] - start) / self.curvature_batch_size)
            return delayed_bar(chunks, desc="curvature pass", unit="chunk", enabled=self.step_progress, total=n_chunks)

        self._structure = STRUCTURES[self.structure](
            self._layout,
            self.fit_info,
            rank=self.rank,
            kfac_prior=self.kfac_prior,
            cache_mib=self.curvature_cache_mib,
            progress=self.step_progress,
        )
        started = time.perf_counter()
        curvature = self._structure.curvature(theta, batches)
        self.fit_info["n_curvature_examples"] = x.shape[0]
        ranks = getattr(self._structure, "layer_ranks", None)
        if ranks and self._run_dir is not None:  # DEF: the per-layer reduction (Lee et al., Table 2)
            atomic_write_text(self._run_dir / DEF_RANKS_FILE, pd.DataFrame(ranks).to_csv(index=False))
        scale = float(p.n_data) if self.dataset_scale is None else self.dataset_scale
        if self.search is None:
            self._posterior = self._cast(self._assemble(theta, curvature, scale, self._prior(theta)))
            return
        self.extra_metrics["curvature_time_s"] = time.perf_counter() - started
        if isinstance(self.search, MarglikSettings):
            started = time.perf_counter()
            self.last_evidence = self.evidence(self.search, theta, curvature, scale, x_all, y_all)
            result = maximise_evidence(self.search, self.last_evidence, self._prior(theta), self._cast, started)
            if result.likelihood is not None:
                self.fitted_likelihood = result.likelihood
        else:
            result = self._grid_search(theta, curvature)
        self.extra_metrics.update(result.metrics)
        self._posterior = result.posterior

    def _assemble(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> StructuredGaussian:
        """The structure's posterior at (N, τ), with its null space made deterministic where ``null_space`` says."""
        if self.null_space is NullSpace.DETERMINISTIC:
            eps = torch.finfo(self.curvature_dtype or self.theta.dtype).eps
            posterior = self._structure.assemble_deterministic(theta, curvature, scale, tau, eps)
            self.extra_metrics["n_deterministic"] = float(posterior.n_deterministic)  # into metrics.json
            return posterior
        return self._structure.assemble(theta, curvature, scale, tau)

    def _check_null_space(self) -> None:
        if self.prior_precision == 0 and self.null_space is not NullSpace.DETERMINISTIC:
            raise ConfigError(
                "laplace: method.prior_precision=0 leaves the precision singular wherever the data carry no "
                "information; set method.null_space=deterministic (zero variance there, Lee et al. App. E.1) or a "
                "prior_precision > 0"
            )
        if self.null_space is NullSpace.DETERMINISTIC:
            if isinstance(self.search, MarglikSettings):
                raise ConfigError(
                    "laplace: method.search=marglik needs log|P|, which is infinite with method.null_space="
                    "deterministic; use null_space=prior or a grid search"
                )
            if STRUCTURES[self.structure].dense_blocks is LaplaceStructure.dense_blocks:  # it forms no dense blocks
                raise ConfigError(
                    f"laplace: method.null_space=deterministic needs each layer's precision as a dense block, which "
                    f"structure={self.structure.value} does not form; use structure=block, efb or def, or null_space=prior"
                )

    def _prior(self, theta: Tensor) -> Tensor:
        """τ ``(D,)`` like ``theta``: ``prior_precision`` everywhere, or the run's per-parameter prior."""
        if self.prior_precision is None:
            return self.problem.prior_precision.detach().double()
        return torch.full_like(theta, self.prior_precision)

    def _curvature_data(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(x, y)``, or ``curvature_subset`` of its rows drawn without replacement (in their original order)."""
        if self.curvature_subset is None or self.curvature_subset >= x.shape[0]:
            return x, y
        generator = self.problem.generator
        keep = torch.randperm(x.shape[0], generator=generator, device=generator.device)[: self.curvature_subset]
        keep = keep.sort().values.to(x.device)
        return x[keep], y[keep]

    def _cast(self, posterior: StructuredGaussian) -> StructuredGaussian:
        """``posterior`` with its floating tensors in the model's dtype."""
        fields = {f.name: getattr(posterior, f.name) for f in dataclasses.fields(posterior)}
        dtype = self.theta.dtype
        return type(posterior)(**{k: v.to(dtype) if v.is_floating_point() else v for k, v in fields.items()})

    # ------------------------------------------------------------------ method.search
    def use_validation(self, x_val: Tensor, y_val: Tensor, run_dir: str | Path | None = None) -> None:
        """Give ``search`` its validation set (the runner passes the run's; never test data) and the run
        folder that receives the grid's ``laplace_search.csv``."""
        self._val = (x_val, y_val)
        self._run_dir = None if run_dir is None else Path(run_dir)

    def _check_validation(self) -> None:
        if isinstance(self.search, SearchSettings) and (self._val is None or self._val[0].shape[0] == 0):
            raise ConfigError(
                "laplace: method.search chooses (N, τ) on the validation set, but this run has none; give the data "
                "one (data.n_val=10000 for vision/mnist, data.val_fraction=0.1 for UCI) or set method.search=null"
            )

    def _grid_search(self, theta: Tensor, curvature: dict[str, Any]) -> SearchResult:
        """:func:`~.search.grid_search` on the validation set; its rows go to ``search_rows`` and, given a run
        folder, to ``laplace_search.csv`` there."""
        assert self._val is not None and isinstance(self.search, SearchSettings)
        result = grid_search(
            self.search,
            theta=theta,
            assemble=lambda scale, tau: self._cast(self._assemble(theta, curvature, scale, tau)),
            outputs=self._val_outputs,
            likelihood=self.problem.likelihood,
            generator=self.problem.generator,
            x_val=self._val[0],
            y_val=self._val[1],
            progress_path=None if self._run_dir is None else self._run_dir / PROGRESS_FILE,
            stop_requested=self.stop_requested,
        )
        self.search_rows = result.rows
        if self._run_dir is not None:
            write_search_table(result.rows, self._run_dir / SEARCH_FILE)
        return result

    def _val_outputs(self, posterior: StructuredGaussian | None, x: Tensor, n_samples: int, seed: int) -> Tensor:
        """Outputs at ``n_samples`` draws of ``posterior`` (``None``: the MAP), from a generator seeded
        with ``seed``: every grid point sees the same noise (common random numbers)."""
        generator = torch.Generator(device=self.problem.generator.device).manual_seed(seed)
        return self.sample_sets(posterior, {"val": x}, n_samples, generator)["val"]

    def evidence(
        self, settings: MarglikSettings, theta: Tensor, curvature: dict[str, Any], scale: float, x: Tensor, y: Tensor
    ) -> LaplaceEvidence:
        """The log marginal likelihood of ``settings`` as a function of (log τ per group, log γ), at the float64 MAP
        ``theta``, the curvature pass's output, the N ``scale`` and the training set ``(x, y)``."""
        model, map_theta = self.problem.model, self.theta.detach()
        with torch.no_grad():
            rows = forward_rows(model, map_theta, x)
            f = torch.cat([forward_with(model, map_theta, xs) for xs in x.split(rows)]).double()
        groups = prior_groups(settings.prior, self._layout.slots, theta)
        assemble = functools.partial(self._structure.assemble, theta, curvature)
        return LaplaceEvidence(assemble, theta, groups, f, y, self.problem.likelihood, scale)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The MAP and its Adam state (:class:`Method`'s), and the fitted posterior's fields."""
        state = super().state_dict()
        if self._posterior is not None:
            for f in dataclasses.fields(self._posterior):
                state[f"posterior.{f.name}"] = getattr(self._posterior, f.name).detach().clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        fields = {k.removeprefix("posterior."): v for k, v in state.items() if k.startswith("posterior.")}
        self._posterior = gaussian_class(set(fields))(**fields) if fields else None
