"""One run: config → data, model, likelihood, method → fit → evaluate → results folder.

``run(cfg, run_dir)`` is a plain function (the CLI's Hydra app calls it; tests call it with a
composed config). It is the one place that seeds torch's global RNG (for ``nn.init``); every other
source of randomness is a ``torch.Generator`` made here and passed down.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from bdl_bench.data import build_dataset
from bdl_bench.data.base import Dataset
from bdl_bench.gaussians.io import save_gaussian
from bdl_bench.likelihoods import Likelihood, build_likelihood
from bdl_bench.methods import Method, Problem, build_method
from bdl_bench.metrics import predictive_metrics
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector
from bdl_bench.results import HistoryWriter, write_config, write_metrics


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    metrics: dict[str, float]


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name!r} but no CUDA device is available; use trainer.device=auto or cpu")
    return device


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"trainer.dtype={name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _to_device(dataset: Dataset, device: torch.device, dtype: torch.dtype) -> Dataset:
    """Move every tensor to ``device``; floating tensors also to ``dtype`` (labels keep theirs)."""
    moved = {}
    for field in dataclasses.fields(dataset):
        value = getattr(dataset, field.name)
        if isinstance(value, torch.Tensor):
            value = value.to(device, dtype=dtype if value.is_floating_point() else value.dtype)
        moved[field.name] = value
    return Dataset(**moved)


@torch.no_grad()
def evaluate(
    method: Method, likelihood: Likelihood, dataset: Dataset, n_samples: int, part: str = "test"
) -> dict[str, float]:
    """Predictive metrics of ``method`` on ``part`` (``test`` or ``val``) with ``n_samples`` MC samples."""
    x, y = getattr(dataset, f"x_{part}"), getattr(dataset, f"y_{part}")
    f_samples = method.predict(x, n_samples)
    return predictive_metrics(likelihood, f_samples, y, y_mean=dataset.y_mean, y_std=dataset.y_std)


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
    exact = _exact_expected_loglik(method, likelihood, dataset)
    if exact is not None:
        expected_loglik = exact
    else:
        f_samples = method.predict(dataset.x_train, n_samples)
        expected_loglik = float(torch.stack([-likelihood.nll(f, dataset.y_train).sum() for f in f_samples]).mean())
    return (expected_loglik - float(kl)) / dataset.n_train


def _exact_expected_loglik(method: Method, likelihood: Likelihood, dataset: Dataset) -> float | None:
    """Quadrature value of ``Σ_i E_q[log p(y_i | x_i, θ)]`` for Bayesian logistic regression, else ``None``."""
    try:
        from bdl_bench.quadrature import expected_log_sigmoid
    except ImportError:
        return None
    from bdl_bench.likelihoods import Bernoulli

    posterior = method.posterior()
    model = method.problem.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not isinstance(likelihood, Bernoulli) or posterior is None or len(linears) != 1:
        return None
    x = dataset.x_train
    if linears[0].bias is not None:
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    mean, var = posterior.linear_moments(x.to(posterior.mean.dtype))
    sign = 2.0 * dataset.y_train.to(mean.dtype) - 1.0  # log p(y | f) = log σ(sign · f)
    return float(expected_log_sigmoid(sign * mean, var).sum())


def _cfg_get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default)


def run(cfg: DictConfig, run_dir: Path) -> RunResult:
    """Fit and evaluate the method described by ``cfg``; write the results into ``run_dir``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = cfg.trainer
    if trainer.threads is not None:
        torch.set_num_threads(int(trainer.threads))
    device = resolve_device(str(trainer.device))
    dtype = resolve_dtype(str(trainer.dtype))
    seed = int(trainer.seed)
    write_config(run_dir, OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]

    dataset = _to_device(build_dataset(OmegaConf.to_container(cfg.data, resolve=True)), device, dtype)  # type: ignore[arg-type]
    torch.manual_seed(seed)  # the one global seed: nn.init of the model
    model = build_model(
        OmegaConf.to_container(cfg.model, resolve=True),
        in_features=dataset.n_features,  # type: ignore[arg-type]
        out_features=dataset.n_outputs,
    ).to(device, dtype)
    likelihood = build_likelihood(dataset, _cfg_get(cfg, "noise_precision"))
    prior = prior_precision_vector(model, float(cfg.prior_precision), _cfg_get(cfg, "bias_prior_precision"))
    method = build_method(OmegaConf.to_container(cfg.method, resolve=True))  # type: ignore[arg-type]
    method_generator = torch.Generator(device=device).manual_seed(seed + 1)
    data_generator = torch.Generator().manual_seed(seed + 2)
    eval_generator = torch.Generator(device=device).manual_seed(seed + 3)
    method.setup(
        Problem(
            model=model,
            likelihood=likelihood,
            n_data=dataset.n_train,
            prior_precision=prior,
            generator=method_generator,
        )
    )

    history = HistoryWriter(run_dir / "history.csv")
    n_epochs = int(trainer.n_epochs)
    eval_every = int(trainer.eval_every)
    bar = tqdm(
        total=n_epochs,
        desc=f"{cfg.method.name} on {cfg.data.name}",
        unit="epoch",
        disable=not trainer.progress,
        leave=False,
    )
    start = time.perf_counter()

    def on_epoch_end(epoch: int, train_stats: Mapping[str, float]) -> None:
        row: dict[str, Any] = {"epoch": epoch, **train_stats, "time_s": time.perf_counter() - start}
        kl = method.kl_to_prior()
        if kl is not None and "train/nll" in train_stats:
            row["train/elbo"] = -train_stats["train/nll"] - float(kl) / dataset.n_train
        if eval_every > 0 and (epoch % eval_every == 0 or epoch == n_epochs):
            with _swap_generator(method, eval_generator):
                row.update(
                    {
                        f"test/{k}": v
                        for k, v in evaluate(method, likelihood, dataset, int(trainer.n_eval_mc_samples)).items()
                    }
                )
        history.append(row)
        bar.update(1)
        bar.set_postfix({k: f"{v:.3g}" for k, v in row.items() if k in ("train/loss", "test/rmse", "test/nll")})

    method.fit(
        dataset.x_train,
        dataset.y_train,
        n_epochs=n_epochs,
        batch_size=int(trainer.batch_size),
        data_generator=data_generator,
        on_epoch_end=on_epoch_end,
    )
    bar.close()
    train_time = time.perf_counter() - start

    with _swap_generator(method, eval_generator):
        metrics: dict[str, float] = evaluate(method, likelihood, dataset, int(trainer.n_test_mc_samples))
        if dataset.x_val.shape[0] > 0:
            metrics.update(
                {
                    f"val_{k}": v
                    for k, v in evaluate(method, likelihood, dataset, int(trainer.n_test_mc_samples), "val").items()
                }
            )
        elbo = elbo_per_example(method, likelihood, dataset, int(trainer.n_elbo_mc_samples))
    if elbo is not None:
        metrics["elbo"] = elbo
    metrics["train_time_s"] = train_time
    metrics["n_params"] = int(prior.numel())
    reference_cfg = _cfg_get(cfg, "reference")
    if reference_cfg is not None and method.posterior() is not None:
        metrics["sym_kl"] = _sym_kl_to_reference(method, reference_cfg, model, likelihood, prior, dataset, seed)
    posterior = method.posterior()
    if trainer.save_posterior and posterior is not None:
        save_gaussian(posterior, run_dir / "posterior.pt")
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"method {cfg.method.name!r}: non-finite final metrics {bad}; no metrics.json written")
    write_metrics(run_dir, metrics)
    return RunResult(run_dir=run_dir, metrics=metrics)


def _sym_kl_to_reference(
    method: Method,
    reference_cfg: Any,
    model: torch.nn.Module,
    likelihood: Likelihood,
    prior: torch.Tensor,
    dataset: Dataset,
    seed: int,
) -> float:
    """Symmetric KL between this method's posterior and a reference method's on the same split."""
    reference = build_method(OmegaConf.to_container(reference_cfg, resolve=True))  # type: ignore[arg-type]
    generator = torch.Generator(device=prior.device).manual_seed(seed + 4)
    reference.setup(
        Problem(model=model, likelihood=likelihood, n_data=dataset.n_train, prior_precision=prior, generator=generator)
    )
    reference.fit(
        dataset.x_train,
        dataset.y_train,
        n_epochs=1,
        batch_size=dataset.n_train,
        data_generator=torch.Generator().manual_seed(seed + 5),
    )
    return float(method.posterior().sym_kl(reference.posterior()))


@contextmanager
def _swap_generator(method: Method, generator: torch.Generator) -> Iterator[None]:
    """Evaluate with a dedicated generator so that evaluation never shifts the training stream."""
    saved = method.problem
    method.problem = dataclasses.replace(saved, generator=generator)
    try:
        yield
    finally:
        method.problem = saved
