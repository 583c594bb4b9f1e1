"""One run: config → data, model, likelihood, method → fit → evaluate → results folder.

``run(cfg, run_dir)`` is a plain function (the CLI's Hydra app calls it through
:func:`bdl_bench.sweep.run_job`; tests call it with a composed config). It is the one place that seeds
torch's global RNG (for ``nn.init``); every other source of randomness is a ``torch.Generator`` made
here and passed down.

Every ``trainer.checkpoint_every`` epochs the run saves a checkpoint (``checkpoint.pt``, see
:mod:`bdl_bench.checkpoint`); a run started in a folder holding one continues from it and ends with the
same metrics as an unbroken run (bit for bit on the CPU with one thread). The checkpoint is removed
once ``metrics.json`` is written; a method with a point estimate or a posterior mean
(``Method.point_estimate``) leaves its final flat parameters in ``params.pt`` (what ``method.map_dir``
of ``method=laplace`` reads).

:func:`fit_job` is the one training loop: a single run is a job of one member, and a stacked job
(:mod:`bdl_bench.stacked`: several splits, or the trials of a search) goes through the same loop with R
members.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from bdl_bench.checkpoint import Checkpoint, load_checkpoint, save_checkpoint, save_params
from bdl_bench.config_checks import check_config
from bdl_bench.data import build_dataset
from bdl_bench.data.base import Dataset
from bdl_bench.errors import ConfigError, DivergenceError, Interrupted, Terminated, UserError
from bdl_bench.gaussians.io import save_gaussian
from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood, build_likelihood
from bdl_bench.methods import Method, Problem, build_method
from bdl_bench.metrics import gaussian_predictive_metrics, ood_metrics, predictive_metrics, uncertainty_arrays
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector
from bdl_bench.reference import reference_posterior
from bdl_bench.results import (
    CHECKPOINT_FILE,
    HISTORY_FILE,
    PARAMS_FILE,
    HistoryWriter,
    atomic_write_bytes,
    config_hash,
    read_history,
    update_run_record,
    write_config,
    write_metrics,
)
from bdl_bench.sigterm import stop_at_epoch_end
from bdl_bench.threads import set_threads


@dataclass
class EpochProgress:
    """Where a fit stands, for the line Ctrl-C prints: the last finished epoch, the last checkpoint's."""

    done: int
    n_epochs: int
    checkpoint_every: int
    checkpoint_path: Path
    in_epochs: bool = False  # the fit's epochs are running (a SIGTERM waits for the present one's end)
    stop_requested: bool = False  # a SIGTERM arrived while they ran (bdl_bench.sigterm)

    def interrupted(self, terminated: bool = False) -> Interrupted:
        """The interrupt's line (for SIGTERM with ``terminated``); the checkpoint's epoch is read from the
        file (Ctrl-C may land between writing it and any note of it)."""
        try:
            checkpoint = load_checkpoint(self.checkpoint_path)
        except (OSError, ValueError, RuntimeError):
            checkpoint = None
        done = max(self.done, checkpoint.epoch if checkpoint is not None else 0)
        where = f"at epoch {done + 1}" if done < self.n_epochs else f"after epoch {done} (evaluating)"
        what, error = "interrupted", Interrupted
        if terminated:
            what, error = "stopped by SIGTERM", Terminated
            where = f"after epoch {done}" + (" (evaluating)" if done >= self.n_epochs else "")
        if checkpoint is not None:
            return error(f"{what} {where}; checkpoint at epoch {checkpoint.epoch}; run the same command to resume")
        every = self.checkpoint_every
        why = f"none yet, one every {every} epochs" if every > 0 else "trainer.checkpoint_every=0 writes none"
        return error(f"{what} {where}; no checkpoint ({why}); run the same command to start it again")


@contextmanager
def stop_on_interrupt(progress: EpochProgress) -> Iterator[None]:
    """Turn Ctrl-C inside the block into :class:`~bdl_bench.errors.Interrupted` saying where the fit stood
    (checkpoints, ``history.csv`` rows and ``metrics.json`` are written whole, so an interrupt leaves the
    previous file or the new one), and SIGTERM into :class:`~bdl_bench.errors.Terminated` (at the end of
    the epoch under way: :func:`stop_if_terminated`)."""
    try:
        with stop_at_epoch_end(progress):
            yield
    except Terminated as stop:
        if str(stop):
            raise
        raise progress.interrupted(terminated=True) from None
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise progress.interrupted() from None


def stop_if_terminated(progress: EpochProgress, epoch: int, save: Callable[[int], None], saved: bool) -> None:
    """At the end of ``epoch``: when a SIGTERM asked to stop, write a checkpoint there (``save``, unless
    ``saved`` already) and raise :class:`~bdl_bench.errors.Terminated`."""
    if progress.stop_requested:
        progress.in_epochs = False
        if not saved:
            save(epoch)
        progress.done = epoch
        raise Terminated()


def announce_resume(run_dir: Path, epoch: int) -> None:
    """The line a resumed run prints (on stderr, with the run folder)."""
    print(f"{run_dir}: resuming from epoch {epoch} (its {CHECKPOINT_FILE})", file=sys.stderr, flush=True)


class CheckpointDeviceError(UserError, ValueError):
    """A checkpoint written on one device type (``cpu``, ``cuda``) found by a run on another."""


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
        raise ConfigError(f"trainer.device={name!r} but no CUDA device is available; use trainer.device=auto or cpu")
    return device


def device_record(device: torch.device) -> dict[str, Any]:
    """What ``run.json`` records of the device a run used: its type (``cpu``, ``cuda``), the GPU's name,
    the torch and CUDA versions (results of different devices differ in the last digits), and the installed
    versions of the main packages (``packages``: Python, numpy, pandas, Hydra, Optuna, …)."""
    from bdl_bench.catalogue import package_versions

    record: dict[str, Any] = {
        "device": device.type,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "packages": package_versions(),
    }
    if device.type == "cuda":
        record["device_name"] = torch.cuda.get_device_name(device)
    return record


def use_deterministic(on: bool) -> None:
    """``trainer.deterministic``: with ``on``, PyTorch's deterministic algorithms only (an op without one
    raises), TF32 off for matrix products and convolutions, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (what
    cuBLAS needs to repeat itself). A CPU run with one thread repeats bit for bit either way; this makes a GPU
    run repeat too, at some cost in speed. Process-wide; ``on=False`` does nothing."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"trainer.dtype={name!r} is not supported; choose one of {', '.join(DTYPES)}")
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
    method: Method,
    likelihood: Likelihood,
    dataset: Dataset,
    n_samples: int,
    run_dir: Path,
    f_test: torch.Tensor | None = None,
    f_ood: torch.Tensor | None = None,
) -> dict[str, float]:
    """Predictive entropy on the out-of-distribution set against the test set (DEF Table 1) and the
    AUROC of telling them apart by entropy; saves ``uncertainty.npz`` for ``bdl-bench plot kind=ood``.
    ``f_test`` and ``f_ood`` are output samples already drawn on those sets (else predicted here)."""
    if not isinstance(likelihood, Bernoulli | Categorical):
        raise ValueError(f"OOD metrics need a classification likelihood, got {type(likelihood).__name__}")
    probs_test = likelihood.probs(method.predict(dataset.x_test, n_samples) if f_test is None else f_test)
    probs_ood = likelihood.probs(method.predict(dataset.x_ood, n_samples) if f_ood is None else f_ood)
    arrays = uncertainty_arrays(probs_test, dataset.y_test, probs_ood)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(run_dir / "uncertainty.npz", buffer.getbuffer())
    return ood_metrics(probs_test, probs_ood)


def save_predictive(run_dir: Path, likelihood: Likelihood, dataset: Dataset, f_test: torch.Tensor) -> Path:
    """Write ``predictive.npz``: a regression run's predictive on the test inputs, in original units.

    ``f_mean`` and ``f_std`` are the mean and (population) standard deviation of the network output over the
    ``(S, N, 1)`` samples ``f_test`` (the epistemic part), ``noise_std`` the likelihood's noise standard
    deviation, and ``y_test`` the test targets; the toy figures (``bdl_bench.studies.def_toy``) draw from it.
    Set ``trainer.save_predictive: true`` in an experiment to get it (off by default, so absent from the
    other runs' configs).
    """
    if not isinstance(likelihood, Gaussian):
        raise ConfigError("trainer.save_predictive needs a regression run (Gaussian likelihood)")
    f = f_test.detach().reshape(f_test.shape[0], f_test.shape[1]).double().cpu()
    y_std = float(dataset.y_std)
    path = run_dir / "predictive.npz"
    np.savez(
        path,
        f_mean=(dataset.y_mean + y_std * f.mean(0)).numpy(),
        f_std=(y_std * f.std(0, unbiased=False)).numpy(),
        noise_std=np.float64(y_std / math.sqrt(float(likelihood.noise_precision))),
        y_test=(dataset.y_mean + y_std * dataset.y_test.double().cpu()).numpy(),
    )
    return path


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
        expected_loglik = _chunked_expected_loglik(method, likelihood, dataset.x_train, dataset.y_train, n_samples)
    return (expected_loglik - float(kl)) / dataset.n_train


ELBO_CHUNK_ELEMENTS = 2**26
"""Rows of the training set per forward pass of the ELBO: at most this many (samples × rows × widest layer)
activations (256 MB in float32), instead of the whole set at once (≈ 1.6 GB per activation on MNIST)."""


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
    try:
        from bdl_bench.quadrature import expected_log_sigmoid
    except ImportError:
        return None
    from bdl_bench.likelihoods import Bernoulli

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


def _cfg_get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default)


@functools.lru_cache(maxsize=2)
def _cached_dataset(data_json: str) -> Dataset:
    return build_dataset(json.loads(data_json))


def run_prior(model: torch.nn.Module, cfg: DictConfig, dataset: Dataset) -> torch.Tensor:
    """The run's prior precision per parameter: ``prior_precision`` (``bias_prior_precision`` on biases).

    With ``gal_lengthscale`` l (set by Gal & Ghahramani's dropout protocol, ``tune=slang_table2``), the
    weights' precision is instead l²(1 − p) s_y² / 2 (p = ``method.dropout_rate``, s_y the training
    targets' std): then our objective is their Keras loss, mean squared error on standardised targets plus
    the l2 weight decay l²(1 − p) / (2 N τ), times τ s_y² / 2 (``bdl_bench.methods.dropout``).
    """
    precision = float(cfg.prior_precision)
    lengthscale = _cfg_get(cfg, "gal_lengthscale")
    if lengthscale is not None:
        precision = float(lengthscale) ** 2 * (1 - float(cfg.method.dropout_rate)) * float(dataset.y_std) ** 2 / 2
    return prior_precision_vector(model, precision, _cfg_get(cfg, "bias_prior_precision"))


def load_dataset(data_cfg: Mapping[str, Any]) -> Dataset:
    """The dataset of a ``data`` config, loaded once per process (a sweep worker runs many splits of a
    few datasets); every call returns fresh copies of the tensors, so no run can alter another's data."""
    cached = _cached_dataset(json.dumps(dict(data_cfg), sort_keys=True, default=str))
    return Dataset(
        **{
            f.name: v.clone() if isinstance(v := getattr(cached, f.name), torch.Tensor) else v
            for f in dataclasses.fields(cached)
        }
    )


EpochHook = Callable[[int], None]


def run(cfg: DictConfig, run_dir: Path, *, epoch_hook: EpochHook | None = None) -> RunResult:
    """Fit and evaluate the method described by ``cfg``; write the results into ``run_dir``.

    Args:
        cfg: the composed root config.
        run_dir: the run folder; a ``checkpoint.pt`` there (of the same config) is resumed from.
        epoch_hook: called with the epoch number after each epoch's history row and checkpoint are
            written (tests use it to simulate a crash).

    Raises:
        ConfigError: when a config value is out of its range (:mod:`bdl_bench.config_checks`; before any
            work), or ``run_dir`` holds a checkpoint of a different config.
    """
    check_config(cfg)
    run_dir = Path(run_dir)
    return fit_job(cfg, {0: cfg}, {0: run_dir}, run_dir, epoch_hook=epoch_hook, single=True)[0]


def fit_job(
    cfg: DictConfig,
    members: Mapping[Hashable, DictConfig],
    member_dirs: Mapping[Hashable, Path],
    job_dir: Path,
    *,
    epoch_hook: EpochHook | None = None,
    single: bool = False,
) -> dict[Hashable, RunResult]:
    """The one training loop: fit ``cfg``'s method on R members at once and write each member's run folder.

    A member is a config that differs from ``cfg`` only where copies of a method may differ (the split, the
    likelihood's and prior's precisions, the method's ``replica_options``: :mod:`bdl_bench.stacked` checks
    that). One member is fitted through the method's single-run API (``setup``, ``use_validation``, ``fit``,
    its ``fitted_likelihood`` and ``extra_metrics``), so a stack of one equals that member's single run bit
    for bit; several through the stacked one (``setup_replicas``, ``fit_replicas``, ``replica(r)``:
    :class:`~bdl_bench.methods.base.CannotStack` for a method that cannot), on splits of equal size and
    without training augmentation.

    Every ``trainer.checkpoint_every`` epochs the job checkpoints into ``job_dir``. With ``single`` (a
    single run: one member whose folder is ``job_dir``) the checkpoint is that of the member's config (one of
    another config is refused with :class:`~bdl_bench.errors.ConfigError`) and holds a single run's
    generators and history count; otherwise it is the stack's, one of another set of members is discarded
    with a warning, and each member's metrics say ``stack_size``. ``train_time_s`` and ``cpu_time_s`` are
    the job's divided by R.

    Raises:
        ValueError: when several members' splits differ in size or width, or the data are augmented.
        CannotStack: when the method cannot fit several members at once.
    """
    checkpoint_every = int(_cfg_get(cfg, "trainer.checkpoint_every", 0) or 0)
    progress = EpochProgress(0, int(cfg.trainer.n_epochs), checkpoint_every, Path(job_dir) / CHECKPOINT_FILE)
    with stop_on_interrupt(progress):
        return _fit_job(cfg, members, member_dirs, Path(job_dir), epoch_hook, progress, single)


def _fit_job(
    cfg: DictConfig,
    members: Mapping[Hashable, DictConfig],
    member_dirs: Mapping[Hashable, Path],
    job_dir: Path,
    epoch_hook: EpochHook | None,
    progress: EpochProgress,
    single: bool,
) -> dict[Hashable, RunResult]:
    """:func:`fit_job`; ``progress`` follows the epochs (for Ctrl-C's line)."""
    keys, dirs = list(members), {k: Path(member_dirs[k]) for k in members}
    one = len(keys) == 1
    trainer = cfg.trainer
    if trainer.threads is not None:
        set_threads(int(trainer.threads))
    device = resolve_device(str(trainer.device))
    use_deterministic(bool(_cfg_get(cfg, "trainer.deterministic", False)))
    dtype, seed = resolve_dtype(str(trainer.dtype)), int(trainer.seed)
    configs = {k: OmegaConf.to_container(m, resolve=True) for k, m in members.items()}
    hashes = {k: config_hash(c) for k, c in configs.items()}  # type: ignore[arg-type]
    job_hash = hashes[keys[0]] if single else config_hash({"members": [hashes[k] for k in keys]})
    job_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_path = job_dir / CHECKPOINT_FILE
    checkpoint = _job_checkpoint(checkpoint_path, job_hash, single, keys)
    record = device_record(device)
    for k in keys:
        dirs[k].mkdir(parents=True, exist_ok=True)
        write_config(dirs[k], configs[k])  # type: ignore[arg-type]
        update_run_record(dirs[k], **record)

    datasets = {k: _to_device(load_dataset(configs[k]["data"]), device, dtype) for k in keys}  # type: ignore[index]
    if not one:
        _check_stackable(datasets, cfg)
    first = datasets[keys[0]]
    torch.manual_seed(seed)  # the one global seed: nn.init of the model (every member's initial network)
    model = build_model(
        OmegaConf.to_container(cfg.model, resolve=True),  # type: ignore[arg-type]
        in_features=first.n_features,
        out_features=first.n_outputs,
    ).to(device, dtype)
    likelihoods = {k: build_likelihood(datasets[k], _cfg_get(members[k], "noise_precision")) for k in keys}
    priors = {k: run_prior(model, members[k], datasets[k]) for k in keys}
    options = [configs[k]["method"] for k in keys]  # type: ignore[index]
    method = build_method(options[0])  # type: ignore[arg-type]
    if any(o != options[0] for o in options):
        method.configure_replicas(options)  # type: ignore[arg-type]
    method_generator = torch.Generator(device=device).manual_seed(seed + 1)
    data_generator = torch.Generator().manual_seed(seed + 2)
    eval_generators = {k: torch.Generator(device=device).manual_seed(seed + 3) for k in keys}
    problems = [
        Problem(
            model=model,
            likelihood=likelihoods[k],
            n_data=first.n_train,
            prior_precision=priors[k],
            generator=method_generator,
            augmentation=datasets[k].augmentation,
        )
        for k in keys
    ]
    if one:
        method.setup(problems[0])
        method.use_validation(first.x_val, first.y_val, dirs[keys[0]])
    else:
        method.setup_replicas(problems)  # a method that cannot stack says how to run the members instead
    method.step_progress = bool(trainer.progress)

    def copy_of(r: int) -> Method:
        """Member ``r``'s fitted method, to evaluate (the method itself for one member)."""
        return method if one else method.replica(r)

    generators = {"method": method_generator, "data": data_generator}
    if single:
        generators["eval"] = eval_generators[keys[0]]
    else:
        generators.update({f"eval_{k}": g for k, g in eval_generators.items()})
    start_epoch, elapsed_before, histories = 0, 0.0, [[] for _ in keys]
    if checkpoint is not None:
        restore_checkpoint(checkpoint, method, generators, device)
        start_epoch, elapsed_before = checkpoint.epoch, checkpoint.elapsed_s
        histories = _checkpoint_histories(checkpoint, [dirs[k] / HISTORY_FILE for k in keys], single)
        progress.done = start_epoch
        announce_resume(job_dir, start_epoch)
    writers = [HistoryWriter(dirs[k] / HISTORY_FILE, rows) for k, rows in zip(keys, histories)]
    n_epochs, eval_every = int(trainer.n_epochs), int(trainer.eval_every)
    checkpoint_every = progress.checkpoint_every
    bar = tqdm(
        total=n_epochs,
        initial=start_epoch,
        desc=f"{cfg.method.name} on {cfg.data.name}" + ("" if one else f", {len(keys)} splits stacked"),
        unit="epoch",
        disable=not trainer.progress,
        leave=False,
    )
    start = time.perf_counter() - elapsed_before
    cpu_start = time.process_time()

    def save(epoch: int) -> None:
        rows = [len(w.rows) for w in writers]
        state = make_checkpoint(
            epoch, job_hash, method, generators, device, rows[0] if single else rows, time.perf_counter() - start
        )
        save_checkpoint(checkpoint_path, state)

    def on_epoch_end(epoch: int, stats: Sequence[Mapping[str, float]]) -> None:
        evaluate_now = eval_every > 0 and (epoch % eval_every == 0 or epoch == n_epochs)
        for r, k in enumerate(keys):
            row = epoch_row(
                copy_of(r),
                likelihoods[k],
                datasets[k],
                epoch,
                stats[r],
                elapsed=time.perf_counter() - start,
                evaluate_now=evaluate_now,
                n_eval_samples=int(trainer.n_eval_mc_samples),
                eval_generator=eval_generators[k],
            )
            writers[r].append(row)
        saved = checkpoint_every > 0 and epoch % checkpoint_every == 0 and epoch < n_epochs
        if saved:
            save(epoch)
        bar.update(1)
        if one:
            bar.set_postfix({k: f"{v:.3g}" for k, v in row.items() if k in ("train/loss", "test/rmse", "test/nll")})
        progress.done = epoch
        if epoch_hook is not None:
            epoch_hook(epoch)
        stop_if_terminated(progress, epoch, save, saved)

    progress.in_epochs = True
    try:
        fit_options = {"n_epochs": n_epochs, "batch_size": int(trainer.batch_size), "start_epoch": start_epoch}
        if one:
            method.fit(
                first.x_train,
                first.y_train,
                data_generator=data_generator,
                on_epoch_end=lambda epoch, stats: on_epoch_end(epoch, [stats]),
                **fit_options,
            )
        else:
            method.fit_replicas(
                torch.stack([datasets[k].x_train for k in keys]),
                torch.stack([datasets[k].y_train for k in keys]),
                data_generator=data_generator,
                on_epoch_end=on_epoch_end,
                **fit_options,
            )
    finally:
        progress.in_epochs = False
        bar.close()
    if progress.stop_requested:  # a SIGTERM during work of the fit after its last epoch: stop now
        raise Terminated()
    train_time = (time.perf_counter() - start) / len(keys)
    cpu_time = (time.process_time() - cpu_start) / len(keys)
    progress.done = max(progress.done, n_epochs)
    shared = SharedPredictions(method, list(datasets.values()), list(eval_generators.values()))
    results = {}
    for r, k in enumerate(keys):
        fitted = copy_of(r)
        results[k] = finish_run(
            members[k],
            dirs[k],
            fitted,
            # a method that fitted the noise (Laplace's method.search=marglik) is scored with it
            likelihood=getattr(fitted, "fitted_likelihood", None) or likelihoods[k],
            dataset=datasets[k],
            prior=priors[k],
            config_hash_=hashes[k],
            train_time=train_time,
            cpu_time=cpu_time,
            eval_generator=eval_generators[k],
            extra_metrics={**fitted.extra_metrics, **({} if single else {"stack_size": float(len(keys))})},
            predictions=shared.of_copy(r, int(_cfg_get(members[k], "trainer.n_test_mc_samples"))),
        )
    checkpoint_path.unlink(missing_ok=True)
    return results


def _job_checkpoint(path: Path, job_hash: str, single: bool, keys: Sequence[Hashable]) -> Checkpoint | None:
    """The job's checkpoint to resume from, if any. One of another config is refused for a single run; for a
    stack it is one of another set of unfinished members (e.g. left by a stack killed while writing its
    splits' results), discarded with a warning: the members start afresh."""
    checkpoint = load_checkpoint(path)
    if checkpoint is None or checkpoint.config_hash == job_hash:
        return checkpoint
    if single:
        raise ConfigError(
            f"{path} belongs to another config (hash {checkpoint.config_hash}, this run {job_hash}); "
            "delete it or re-run with force=true"
        )
    warnings.warn(
        f"{path} belongs to another stack of splits (hash {checkpoint.config_hash}, this job {job_hash}); "
        f"starting the splits {list(keys)} from scratch",
        stacklevel=4,
    )
    return None


def _checkpoint_histories(checkpoint: Checkpoint, paths: Sequence[Path], single: bool) -> list[list[dict[str, Any]]]:
    """Each member's history rows at the checkpoint: read back from ``paths`` (their ``history.csv``), or
    the rows stored in a checkpoint written before checkpoints kept only the row counts."""
    if single:
        return [checkpoint_history(checkpoint, paths[0])]
    if checkpoint.history_rows is None:
        return list(checkpoint.history)
    return [read_history(p, int(n)) for p, n in zip(paths, checkpoint.history_rows)]  # type: ignore[arg-type]


class SharedPredictions:
    """The final test and validation predictions of a stack's copies, made together where the method can
    (``predict_replicas``: MC dropout draws each mask once for all copies) and every copy would make them
    alike: several copies, all evaluation generators in one state and every split's parts of one shape. Copies
    are predicted in groups of at most ``PREDICTION_ELEMENTS`` outputs per part; each group replays the shared
    generator state, and each copy's generator is then left where its own ``predict`` calls would leave it,
    so the metrics equal those of the copies predicted one by one (``finish_run`` without ``predictions``)."""

    PREDICTION_ELEMENTS = 2**26  # outputs (copies x samples x rows x out) held at once: 256 MB in float32

    def __init__(self, method: Any, datasets: Sequence[Any], generators: Sequence[torch.Generator]) -> None:
        self.method, self.datasets, self.generators = method, list(datasets), list(generators)
        self._group: list[int] = []
        self._outputs: dict[str, torch.Tensor] = {}
        self._end: torch.Tensor | None = None  # the generators' state after the present group's predictions
        states = [g.get_state() for g in self.generators]
        self.enabled = (
            len(self.datasets) > 1
            and callable(getattr(method, "predict_replicas", None))
            and all(torch.equal(s, states[0]) for s in states)
            and all(self._shapes(d) == self._shapes(self.datasets[0]) for d in self.datasets)
        )

    @staticmethod
    def _shapes(dataset: Any) -> tuple:
        return tuple(tuple(getattr(dataset, f"x_{part}").shape) for part in ("test", "val"))

    def _parts(self) -> list[str]:
        return ["test"] + (["val"] if self.datasets[0].x_val.shape[0] > 0 else [])

    def of_copy(self, r: int, n_samples: int) -> dict[str, torch.Tensor] | None:
        """Copy ``r``'s ``{part: (S, N, out)}`` (``None`` where the copies are predicted one by one)."""
        if not self.enabled:
            return None
        if r not in self._group:
            rows = sum(getattr(self.datasets[0], f"x_{p}").shape[0] for p in self._parts())
            size = max(1, self.PREDICTION_ELEMENTS // (n_samples * rows))
            self._group = list(range(r, min(r + size, len(self.datasets))))  # copy r's generator is still at the start
            with _swap_generator(self.method, self.generators[r]):
                self._outputs = {
                    p: self.method.predict_replicas(
                        torch.stack([getattr(self.datasets[c], f"x_{p}") for c in self._group]), n_samples, self._group
                    )
                    for p in self._parts()
                }
            self._end = self.generators[r].get_state()
        self.generators[r].set_state(self._end)
        index = self._group.index(r)
        return {p: f[index] for p, f in self._outputs.items()}


def _check_stackable(datasets: Mapping[Hashable, Dataset], cfg: DictConfig) -> None:
    """Refuse splits that cannot share one stacked fit, naming what differs."""
    sizes = {k: (d.n_train, tuple(d.x_train.shape[1:]), d.task) for k, d in datasets.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"split {k}: {n} examples of shape {s}" for k, (n, s, _) in sizes.items())
        raise ConfigError(
            f"{cfg.data.name}: stacked splits need equal training sets ({listed}); run the splits one per job "
            "(data.split=range(...)) instead of a list"
        )
    if any(d.augmentation is not None for d in datasets.values()):
        raise ConfigError(
            f"{cfg.data.name}: stacked splits do not support training augmentation; run one split per job"
        )


def peak_rss_mib(model: torch.nn.Module) -> float:
    """The process's peak resident memory in MiB (Linux's ``ru_maxrss`` is in KiB, macOS's in bytes); on a GPU,
    the peak memory torch allocated there instead."""
    device = next(model.parameters(), torch.empty(0)).device
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def make_checkpoint(
    epoch: int,
    chash: str,
    method: Method,
    generators: Mapping[str, torch.Generator],
    device: torch.device,
    history_rows: int | list[int],
    elapsed_s: float,
) -> Checkpoint:
    """What a killed run needs to continue after ``epoch``: the method's state, every generator's and
    torch's global (and CUDA) RNG state, the number of history rows so far (per split for a stack) and the
    time spent."""
    return Checkpoint(
        epoch=epoch,
        config_hash=chash,
        device=device.type,
        method=method.state_dict(),
        generators={name: gen.get_state() for name, gen in generators.items()},
        torch_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        history_rows=history_rows,
        elapsed_s=elapsed_s,
    )


def checkpoint_history(checkpoint: Checkpoint, path: Path) -> list[dict[str, Any]]:
    """The history rows of a single run's checkpoint: read back from ``path`` (``history.csv``), or the
    rows stored in a checkpoint written before checkpoints kept only the row count."""
    if checkpoint.history_rows is None:
        return list(checkpoint.history)
    return read_history(path, int(checkpoint.history_rows))  # type: ignore[arg-type]


def restore_checkpoint(
    checkpoint: Checkpoint, method: Method, generators: Mapping[str, torch.Generator], device: torch.device
) -> None:
    """Inverse of :func:`make_checkpoint` for a method already set up (history and time are the caller's).

    Raises:
        CheckpointDeviceError: when the checkpoint was written on another device type (its generators'
            states do not fit this device's; the run is not resumed but refused, naming the fix).
    """
    if checkpoint.device is not None and checkpoint.device != device.type:
        raise CheckpointDeviceError(
            f"the run's {CHECKPOINT_FILE} was written on {checkpoint.device} and this run is on {device.type}: "
            f"a checkpoint resumes only on its own device type; re-run with trainer.device={checkpoint.device}, "
            "or with force=true to start over"
        )
    method.load_state_dict(checkpoint.method)
    for name, gen in generators.items():
        gen.set_state(checkpoint.generators[name])
    torch.set_rng_state(checkpoint.torch_rng)
    if checkpoint.cuda_rng is not None and device.type == "cuda":
        torch.cuda.set_rng_state(checkpoint.cuda_rng, device)


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
        with _swap_generator(method, eval_generator):
            row.update({f"test/{k}": v for k, v in evaluate(method, likelihood, dataset, n_eval_samples).items()})
    return row


def finish_run(
    cfg: DictConfig,
    run_dir: Path,
    method: Method,
    *,
    likelihood: Likelihood,
    dataset: Dataset,
    prior: torch.Tensor,
    config_hash_: str,
    train_time: float,
    eval_generator: torch.Generator,
    cpu_time: float | None = None,
    extra_metrics: Mapping[str, float] | None = None,
    predictions: Mapping[str, torch.Tensor] | None = None,
) -> RunResult:
    """A fitted run's final metrics (test, validation, ELBO, OOD, ``sym_kl``), ``posterior.pt``,
    ``params.pt`` and ``metrics.json`` (written last: its presence marks the run finished); removes
    the run's checkpoint.

    Cost: ``train_time_s`` (training wall time, resumed attempts included), ``cpu_time_s`` (CPU seconds of the
    process while the attempt that finished it trained) and ``peak_rss_mib`` (the process's peak resident memory
    so far: in a sweep worker that ran earlier jobs, the largest of them).

    ``predictions``: the test and validation outputs ``(S, N, out)`` ``method.predict`` would give from
    ``eval_generator``'s state, already made (a stacked job's shared predictions, :mod:`bdl_bench.stacked`),
    with the generator left where those calls would leave it.

    Raises:
        FloatingPointError: when a final metric is not finite (no ``metrics.json`` is written).
    """
    trainer = cfg.trainer
    model = method.problem.model
    seed = int(trainer.seed)
    chash = config_hash_
    n_test = int(trainer.n_test_mc_samples)
    sets = {"test": dataset.x_test}
    if dataset.x_val.shape[0] > 0:
        sets["val"] = dataset.x_val
    if dataset.x_ood is not None:
        sets["ood"] = dataset.x_ood
    with _swap_generator(method, eval_generator):
        # A method with ``predict_sets`` (Laplace) evaluates each posterior sample on every set at once;
        # the others predict set by set: test, val, (the ELBO's samples), OOD. The OOD metrics reuse the
        # test predictions.
        predict_sets = getattr(method, "predict_sets", None)
        if predictions is not None:
            f = dict(predictions)
        elif callable(predict_sets):
            f = predict_sets(sets, n_test)
        else:
            f = {}
        for part in ("test", "val"):
            if part in sets and part not in f:
                f[part] = method.predict(sets[part], n_test)
        metrics: dict[str, float] = evaluate(method, likelihood, dataset, n_test, f_samples=f["test"])
        if "val" in f:
            metrics.update(
                {f"val_{k}": v for k, v in evaluate(method, likelihood, dataset, n_test, "val", f["val"]).items()}
            )
        elbo = elbo_per_example(method, likelihood, dataset, int(trainer.n_elbo_mc_samples))
        if "ood" in sets:
            f_ood = f["ood"] if "ood" in f else method.predict(dataset.x_ood, n_test)
            metrics.update(evaluate_ood(method, likelihood, dataset, n_test, run_dir, f["test"], f_ood))
    if OmegaConf.select(cfg, "trainer.save_predictive", default=False):
        save_predictive(run_dir, likelihood, dataset, f["test"])
    if elbo is not None:
        metrics["elbo"] = elbo
        authors = elbo_without_bias_logdet(elbo, model, prior, dataset.n_train)
        if authors is not None:
            metrics["elbo_no_bias_logdet"] = authors
    metrics["train_time_s"] = train_time
    if cpu_time is not None:
        metrics["cpu_time_s"] = cpu_time
    metrics["peak_rss_mib"] = peak_rss_mib(model)
    metrics.update(extra_metrics or {})
    metrics["n_params"] = int(prior.numel())
    reference_cfg = _cfg_get(cfg, "reference")
    if reference_cfg is not None and method.posterior() is not None:
        cache_dir = Path(str(cfg.results_root)) / ".cache" / "references" if _cfg_get(cfg, "results_root") else None
        metrics["sym_kl"] = _sym_kl_to_reference(
            method, reference_cfg, model, likelihood, prior, dataset, seed, cache_dir
        )
    posterior = method.posterior()
    if trainer.save_posterior and posterior is not None:
        save_gaussian(posterior, run_dir / "posterior.pt")
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise DivergenceError(f"method {cfg.method.name!r}: non-finite final metrics {bad}; no metrics.json written")
    point = method.point_estimate()
    if point is not None:
        save_params(run_dir / PARAMS_FILE, point, method=str(cfg.method.name), config_hash=chash)
    write_metrics(run_dir, metrics)
    (run_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
    return RunResult(run_dir=run_dir, metrics=metrics)


def _sym_kl_to_reference(
    method: Method,
    reference_cfg: Any,
    model: torch.nn.Module,
    likelihood: Likelihood,
    prior: torch.Tensor,
    dataset: Dataset,
    seed: int,
    cache_dir: Path | None,
) -> float:
    """Symmetric KL between this method's posterior and the reference's on the same split
    (:mod:`bdl_bench.reference`: fitted once per split, cached in ``cache_dir``)."""
    config = OmegaConf.to_container(reference_cfg, resolve=True)
    reference = reference_posterior(config, model, likelihood, prior, dataset, seed, cache_dir)  # type: ignore[arg-type]
    return float(method.posterior().sym_kl(reference))


@contextmanager
def _swap_generator(method: Method, generator: torch.Generator) -> Iterator[None]:
    """Evaluate with a dedicated generator so that evaluation never shifts the training stream."""
    saved = method.problem
    method.problem = dataclasses.replace(saved, generator=generator)
    try:
        yield
    finally:
        method.problem = saved
