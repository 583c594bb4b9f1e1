"""One run: config → data, model, likelihood, method → fit → evaluate → results folder.

``run(cfg, run_dir)`` is the one place that seeds torch's global RNG (for ``nn.init``); every other source of
randomness is a ``torch.Generator`` made here and passed down. Every ``trainer.checkpoint_every`` epochs the run
saves ``checkpoint.pt``; a run started in a folder holding one continues from it and ends with the metrics of an
unbroken run (bit for bit on the CPU with one thread). :func:`fit_job` is the one training loop: a single run is
a job of one member, a stacked job (:mod:`bdl_bench.orchestration.stacked`) one of R members.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from bdl_bench.checkpoint import save_checkpoint, save_params
from bdl_bench.config_checks import check_config, sample_prefixes, val_samples
from bdl_bench.data import build_dataset
from bdl_bench.data.base import Dataset
from bdl_bench.errors import ConfigError, DivergenceError, Terminated
from bdl_bench.gaussians.io import save_gaussian
from bdl_bench.likelihoods import Likelihood, build_likelihood
from bdl_bench.methods import Method, Problem, build_method
from bdl_bench.models import build_model, check_mode_free
from bdl_bench.models.params import prior_precision_vector
from bdl_bench.orchestration.devices import device_record, resolve_device, resolve_dtype, use_deterministic
from bdl_bench.orchestration.evaluation import (
    SharedPredictions,
    elbo_per_example,
    elbo_without_bias_logdet,
    epoch_row,
    evaluate,
    evaluate_ood,
    prefix_metrics,
    save_predictive,
    swap_generator,
)
from bdl_bench.orchestration.prediction_store import Draw, PredictionStore, chunk_size
from bdl_bench.orchestration.resume import checkpoint_histories, job_checkpoint, make_checkpoint, restore_checkpoint
from bdl_bench.orchestration.sigterm import EpochProgress, stop_if_terminated, stop_on_interrupt
from bdl_bench.orchestration.threads import set_threads
from bdl_bench.reference import reference_posterior
from bdl_bench.results import (
    CHECKPOINT_FILE,
    HISTORY_FILE,
    PARAMS_FILE,
    HistoryWriter,
    config_hash,
    update_run_record,
    write_config,
    write_metrics,
)


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    metrics: dict[str, float]


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
    lengthscale = OmegaConf.select(cfg, "gal_lengthscale")
    if lengthscale is not None:
        precision = float(lengthscale) ** 2 * (1 - float(cfg.method.dropout_rate)) * float(dataset.y_std) ** 2 / 2
    return prior_precision_vector(model, precision, OmegaConf.select(cfg, "bias_prior_precision"))


def load_dataset(data_cfg: Mapping[str, Any], device: torch.device, dtype: torch.dtype) -> Dataset:
    """The dataset of a ``data`` config, loaded once per process (a sweep worker runs many splits of a few
    datasets); every call returns fresh copies of the tensors, on ``device`` and floating ones in ``dtype`` (labels
    keep theirs), so no run can alter another's data."""
    cached = _cached_dataset(json.dumps(dict(data_cfg), sort_keys=True, default=str))
    fields = {}
    for field in dataclasses.fields(cached):
        value = getattr(cached, field.name)
        if isinstance(value, torch.Tensor):
            value = value.to(device, dtype=dtype if value.is_floating_point() else value.dtype, copy=True)
        fields[field.name] = value
    return Dataset(**fields)


def run(cfg: DictConfig, run_dir: Path) -> RunResult:
    """Fit and evaluate the method described by ``cfg``; write the results into ``run_dir``, resuming from a
    checkpoint there."""
    check_config(cfg)
    run_dir = Path(run_dir)
    return fit_job(cfg, {0: cfg}, {0: run_dir}, run_dir, single=True)[0]


def fit_job(
    cfg: DictConfig,
    members: Mapping[Hashable, DictConfig],
    member_dirs: Mapping[Hashable, Path],
    job_dir: Path,
    *,
    single: bool = False,
) -> dict[Hashable, RunResult]:
    """The one training loop: fit ``cfg``'s method on R members at once and write each member's run folder.

    A member differs from ``cfg`` only where copies of a method may (the split, the precisions, the method's
    ``per_copy_options``). One member is fitted through the method's single-run API (``setup``, ``fit``), so a
    stack of one equals that member's single run bit for bit; several through the stacked one
    (``setup_stack``, ``fit_stack``, ``copy_at(r)``; :class:`~bdl_bench.methods.base.CannotStack` for a
    method that cannot). The job checkpoints into ``job_dir``; with ``single`` (one member whose folder is
    ``job_dir``) the checkpoint is a single run's and one of another config is refused, otherwise one of another
    set of members is discarded with a warning and each member's metrics say ``stack_size``. ``train_time_s``
    and ``cpu_time_s`` are the job's divided by R.
    """
    job_dir = Path(job_dir)
    checkpoint_every = int(OmegaConf.select(cfg, "trainer.checkpoint_every", default=0) or 0)
    progress = EpochProgress(0, int(cfg.trainer.n_epochs), checkpoint_every, job_dir / CHECKPOINT_FILE)
    with stop_on_interrupt(progress):
        keys, dirs = list(members), {k: Path(member_dirs[k]) for k in members}
        one = len(keys) == 1
        trainer = cfg.trainer
        if trainer.threads is not None:
            set_threads(int(trainer.threads))
        device = resolve_device(str(trainer.device))
        use_deterministic(bool(OmegaConf.select(cfg, "trainer.deterministic", default=False)))
        dtype, seed = resolve_dtype(str(trainer.dtype)), int(trainer.seed)
        configs = {k: OmegaConf.to_container(m, resolve=True) for k, m in members.items()}
        hashes = {k: config_hash(c) for k, c in configs.items()}  # type: ignore[arg-type]
        job_hash = hashes[keys[0]] if single else config_hash({"members": [hashes[k] for k in keys]})
        job_dir.mkdir(parents=True, exist_ok=True)
        checkpoint_path = job_dir / CHECKPOINT_FILE
        checkpoint = job_checkpoint(checkpoint_path, job_hash, single, keys)
        record = device_record(device)
        for k in keys:
            dirs[k].mkdir(parents=True, exist_ok=True)
            write_config(dirs[k], configs[k])  # type: ignore[arg-type]
            update_run_record(dirs[k], **record)

        datasets = {k: load_dataset(configs[k]["data"], device, dtype) for k in keys}  # type: ignore[index]
        if not one:
            _check_stackable(datasets, cfg)
        first = datasets[keys[0]]
        torch.manual_seed(seed)  # the one global seed: nn.init of the model (every member's initial network)
        model = build_model(
            OmegaConf.to_container(cfg.model, resolve=True),  # type: ignore[arg-type]
            in_features=first.n_features,
            out_features=first.n_outputs,
        ).to(device, dtype)
        check_mode_free(model, str(cfg.method.name))
        likelihoods = {k: build_likelihood(datasets[k], OmegaConf.select(members[k], "noise_precision")) for k in keys}
        priors = {k: run_prior(model, members[k], datasets[k]) for k in keys}
        options = [configs[k]["method"] for k in keys]  # type: ignore[index]
        method = build_method(options[0])  # type: ignore[arg-type]
        if any(o != options[0] for o in options):
            method.configure_stack(options)  # type: ignore[arg-type]
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
            method.setup_stack(problems)  # a method that cannot stack says how to run the members instead
        method.step_progress = bool(trainer.progress)
        method.stop_requested = lambda: progress.stop_requested  # checked between resumable pieces of a fit

        def copy_of(r: int) -> Method:
            return method if one else method.copy_at(r)

        generators = {"method": method_generator, "data": data_generator}
        if single:
            generators["eval"] = eval_generators[keys[0]]
        else:
            generators.update({f"eval_{k}": g for k, g in eval_generators.items()})
        start_epoch, elapsed_before, histories = 0, 0.0, [[] for _ in keys]
        if checkpoint is not None:
            restore_checkpoint(checkpoint, method, generators, device)
            start_epoch, elapsed_before = checkpoint.epoch, checkpoint.elapsed_s
            histories = checkpoint_histories(checkpoint, [dirs[k] / HISTORY_FILE for k in keys], single)
            progress.done = start_epoch
            print(f"{job_dir}: resuming from epoch {start_epoch} (its {CHECKPOINT_FILE})", file=sys.stderr, flush=True)
        writers = [HistoryWriter(dirs[k] / HISTORY_FILE, rows) for k, rows in zip(keys, histories)]
        n_epochs, eval_every = int(trainer.n_epochs), int(trainer.eval_every)
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
                method.fit_stack(
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
        progress.evaluating = True
        shared = SharedPredictions(
            method,
            list(datasets.values()),
            list(eval_generators.values()),
            with_val=val_samples(cfg) == int(cfg.trainer.n_test_mc_samples),
        )
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
                predictions=shared.of_copy(r, int(OmegaConf.select(members[k], "trainer.n_test_mc_samples"))),
            )
        checkpoint_path.unlink(missing_ok=True)
        return results


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
    """A fitted run's final metrics (test, validation, ELBO, OOD, ``sym_kl``, cost), ``posterior.pt``,
    ``params.pt`` and ``metrics.json`` (written last: its presence marks the run finished; not at all when a
    metric is not finite); removes the run's checkpoint. ``cpu_time_s`` is of the attempt that finished the run,
    ``peak_rss_mib`` the process's so far (in a sweep worker, the largest of its jobs). ``predictions``: the test
    and validation outputs ``(S, N, out)`` ``method.predict`` would give from ``eval_generator``, already made
    (:class:`~bdl_bench.orchestration.evaluation.SharedPredictions`), the generator left where those calls would
    leave it.
    """
    trainer = cfg.trainer
    model = method.problem.model
    n_test, n_val = int(trainer.n_test_mc_samples), val_samples(cfg)
    sets = {"test": dataset.x_test}
    if dataset.x_val.shape[0] > 0 and n_val > 0:
        sets["val"] = dataset.x_val
    if dataset.x_ood is not None:
        sets["ood"] = dataset.x_ood
    store = PredictionStore(run_dir, method, eval_generator, progress=bool(trainer.progress))
    n_params = int(prior.numel())

    def stage(name: str, parts: Mapping[str, torch.Tensor], draw: Draw, n: int) -> dict[str, torch.Tensor]:
        """``draw(n)``, resumable in chunks where the method's samples are independent draws."""
        rows = sum(x.shape[0] for x in parts.values())
        chunk = chunk_size(n_params, rows) if method.iid_predictive else n
        return store.predict(name, draw, n, chunk)

    with swap_generator(method, eval_generator):
        # A method with ``predict_sets`` (Laplace) evaluates each posterior sample on every set at once;
        # the others predict set by set: test, val, (the ELBO's samples), OOD. The OOD metrics reuse the
        # test predictions.
        predict_sets = getattr(method, "predict_sets", None)
        if predictions is not None:
            f = dict(predictions)
        elif callable(predict_sets):  # validation too where it takes as many samples
            joint = {p: x for p, x in sets.items() if p != "val" or n_val == n_test}
            f = stage("sets", joint, lambda n: predict_sets(joint, n), n_test)
        else:
            f = {}

        def one_set(part: str) -> Draw:
            return lambda n: {part: method.predict(sets[part], n)}

        for part, n in (("test", n_test), ("val", n_val)):
            if part in sets and part not in f:
                f[part] = stage(part, {part: sets[part]}, one_set(part), n)[part]
        metrics: dict[str, float] = evaluate(method, likelihood, dataset, n_test, f_samples=f["test"])
        if "val" in f:
            metrics.update(
                {f"val_{k}": v for k, v in evaluate(method, likelihood, dataset, n_val, "val", f["val"]).items()}
            )
        elbo = elbo_per_example(method, likelihood, dataset, int(trainer.n_elbo_mc_samples))
        f_ood = None
        if "ood" in sets:
            f_ood = f["ood"] if "ood" in f else stage("ood", {"ood": sets["ood"]}, one_set("ood"), n_test)["ood"]
            metrics.update(evaluate_ood(likelihood, dataset, run_dir, f["test"], f_ood))
    for k in sample_prefixes(cfg):
        metrics.update(prefix_metrics(method, likelihood, dataset, f["test"], f_ood, k))
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
    posterior = method.posterior()
    reference_cfg = OmegaConf.select(cfg, "reference")
    if reference_cfg is not None and posterior is not None:  # fitted once per split, cached (bdl_bench.reference)
        cache_dir = (
            Path(str(cfg.results_root)) / ".cache" / "references" if OmegaConf.select(cfg, "results_root") else None
        )
        config = OmegaConf.to_container(reference_cfg, resolve=True)
        reference = reference_posterior(config, model, likelihood, prior, dataset, int(trainer.seed), cache_dir)  # type: ignore[arg-type]
        metrics["sym_kl"] = float(posterior.sym_kl(reference))
    if trainer.save_posterior and posterior is not None:
        save_gaussian(posterior, run_dir / "posterior.pt")
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise DivergenceError(f"method {cfg.method.name!r}: non-finite final metrics {bad}; no metrics.json written")
    point = method.point_estimate()
    if point is not None:
        save_params(run_dir / PARAMS_FILE, point, method=str(cfg.method.name), config_hash=config_hash_)
    write_metrics(run_dir, metrics)
    (run_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
    store.clear()
    return RunResult(run_dir=run_dir, metrics=metrics)
