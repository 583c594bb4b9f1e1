"""Stacked splits: one job fits a method on several splits of a dataset at once.

``bdl-bench run method=slang data=uci/boston 'data.split=[0,1,2]'`` (a list instead of one split;
``data.split=all`` for every split of the dataset's protocol) trains the R = 3 copies of the method side by side, with every tensor carrying a leading copy
dimension (``Method.setup_replicas``). The networks of SLANG's UCI study are so small (D ≈ 750) that a
single run's time is Python overhead per step; a stacked step costs about as much as one single step,
so R splits cost about as much as one (``experiment=slang_table2`` stacks the 20 splits of a dataset).

Each split still gets the run folder a single run of it would get (the job's folder name with
``data.split=<k>``), holding what a single run writes (``config.yaml`` with ``data.split: k``,
``history.csv``, ``metrics.json``, …) and the same config hash: tables, skipping finished runs and
``bdl-bench reproduce`` treat stacked and single runs alike, and finished splits are left out of a
re-run. Copy k draws the noise a single run with the same seed draws (one draw shared by the copies),
so its metrics equal those of ``data.split=k`` run alone up to floating-point rounding; each copy is
evaluated as an ordinary method (``Method.replica``) with its own evaluation generator. All of them start
from one seed, so a method that can (MC dropout's ``predict_replicas``) makes the final test and validation
predictions of all copies at once, drawing each random number once for all (:class:`SharedPredictions`):
the same outputs, bit for bit, for the products alone (a tuned MC-dropout search predicts 1000 samples of
every trial: drawn one copy at a time, their masks took as long as the training).
``train_time_s`` of a split is the stack's training time divided by R; ``stack_size`` says R.

The stack checkpoints into the job's own folder (``checkpoint.pt``: the stacked state, the generators
and every split's history) every ``trainer.checkpoint_every`` epochs; re-running the job resumes it
(a checkpoint of another set of splits, left by a stack killed while writing its results, is
discarded with a warning: the splits it still lacks start afresh).

Requirements (else a ``ValueError`` says what differs): the splits have the same numbers of training
examples and inputs (Gal's UCI splits do), no training augmentation, and a method with
``supports_replicas`` (``bbb`` with local reparameterisation, ``dropout``, ``slang`` and ``vogn`` on networks of
``nn.Linear`` layers). For other methods ``setup_replicas`` raises
:class:`~bdl_bench.methods.base.CannotStack` and the job runs the splits one after another instead
(:func:`bdl_bench.sweep.run_job`), each exactly as its single run.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm.auto import tqdm

from bdl_bench.checkpoint import load_checkpoint, save_checkpoint
from bdl_bench.config_checks import check_config
from bdl_bench.errors import ConfigError, Terminated
from bdl_bench.likelihoods import build_likelihood
from bdl_bench.methods import Problem, build_method
from bdl_bench.models import build_model
from bdl_bench.results import (
    CHECKPOINT_FILE,
    HISTORY_FILE,
    HistoryWriter,
    config_hash,
    read_history,
    update_run_record,
    write_config,
)
from bdl_bench.runner import (
    EpochHook,
    EpochProgress,
    RunResult,
    _cfg_get,
    _swap_generator,
    _to_device,
    announce_resume,
    device_record,
    epoch_row,
    finish_run,
    load_dataset,
    make_checkpoint,
    resolve_device,
    resolve_dtype,
    restore_checkpoint,
    run_prior,
    stop_if_terminated,
    stop_on_interrupt,
    use_deterministic,
)
from bdl_bench.threads import set_threads


def stacked_splits(cfg: DictConfig) -> list[int] | None:
    """The splits of a stacked job, else ``None``: ``data.split`` given as a list, or as ``all`` (every
    split of the dataset's ``protocol.n_splits``).

    Raises:
        ValueError: on an empty list, repeated splits, or ``all`` for a dataset without ``n_splits``.
    """
    split = OmegaConf.select(cfg, "data.split")
    if split == "all":
        n_splits = OmegaConf.select(cfg, "data.protocol.n_splits")
        if n_splits is None:
            raise ConfigError(f"data.split=all: {cfg.data.name} has no protocol.n_splits; give a list of splits")
        return list(range(int(n_splits)))
    if not OmegaConf.is_list(split) and not isinstance(split, list | tuple):
        return None
    splits = [int(k) for k in split]
    if not splits or len(set(splits)) != len(splits):
        raise ConfigError(f"data.split={list(split)}: a stacked job needs a non-empty list of distinct splits")
    return splits


def member_config(cfg: DictConfig, split: int) -> DictConfig:
    """``cfg`` with ``data.split`` set to ``split``: the config of the single run of that split."""
    member = copy.deepcopy(cfg)
    with open_dict(member):
        member.data.split = split
    return member


def run_stack(
    cfg: DictConfig,
    member_dirs: Mapping[Hashable, Path],
    stack_dir: Path,
    *,
    member_configs: Mapping[Hashable, DictConfig] | None = None,
    epoch_hook: EpochHook | None = None,
) -> dict[Hashable, RunResult]:
    """Fit ``cfg``'s method on the splits ``member_dirs`` names, stacked; write each split's run folder.

    Args:
        cfg: the job's config (its ``data.split`` is ignored: the splits are ``member_dirs``' keys).
        member_dirs: split → its run folder (any key → run folder with ``member_configs``).
        stack_dir: the job's folder (the stack's checkpoint).
        member_configs: the config of each member, where members are not just splits of ``cfg``: the
            trials of a stacked search (:mod:`bdl_bench.search`), or tuned test runs, whose noise
            precision, prior precision and the method's ``replica_options`` may differ (all else must be
            ``cfg``'s).
        epoch_hook: called with the epoch number after each epoch's rows and checkpoint are written.

    Raises:
        ValueError: when the splits differ in size or width or the data are augmented, or the members in
            a shared setting (model, trainer, seeds).
        NotImplementedError: when the method cannot stack.
    """
    progress = EpochProgress(
        0,
        int(cfg.trainer.n_epochs),
        int(_cfg_get(cfg, "trainer.checkpoint_every", 0) or 0),
        Path(stack_dir) / CHECKPOINT_FILE,
    )
    with stop_on_interrupt(progress):
        return _run_stack(cfg, member_dirs, Path(stack_dir), member_configs, epoch_hook, progress)


def _run_stack(
    cfg: DictConfig,
    member_dirs: Mapping[Hashable, Path],
    stack_dir: Path,
    member_configs: Mapping[Hashable, DictConfig] | None,
    epoch_hook: EpochHook | None,
    progress: EpochProgress,
) -> dict[Hashable, RunResult]:
    """:func:`run_stack`; ``progress`` follows the epochs (for Ctrl-C's line)."""
    splits = list(member_dirs)
    trainer = cfg.trainer
    if trainer.threads is not None:
        set_threads(int(trainer.threads))
    device, dtype, seed = resolve_device(str(trainer.device)), resolve_dtype(str(trainer.dtype)), int(trainer.seed)
    use_deterministic(bool(_cfg_get(cfg, "trainer.deterministic", False)))
    members = dict(member_configs) if member_configs is not None else {k: member_config(cfg, k) for k in splits}
    for member in (cfg, *members.values()):
        check_config(member)
    configs = {k: OmegaConf.to_container(m, resolve=True) for k, m in members.items()}
    _check_shared(cfg, configs)
    hashes = {k: config_hash(c) for k, c in configs.items()}  # type: ignore[arg-type]
    stack_hash = config_hash({"members": [hashes[k] for k in splits]})
    stack_dir = Path(stack_dir)
    stack_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_path = stack_dir / CHECKPOINT_FILE
    checkpoint = load_checkpoint(checkpoint_path)
    if checkpoint is not None and checkpoint.config_hash != stack_hash:
        # another set of unfinished splits (e.g. a stack killed while writing its splits' results): start afresh
        warnings.warn(
            f"{checkpoint_path} belongs to another stack of splits (hash {checkpoint.config_hash}, this job "
            f"{stack_hash}); starting the splits {splits} from scratch",
            stacklevel=2,
        )
        checkpoint = None
    datasets = {k: _to_device(load_dataset(configs[k]["data"]), device, dtype) for k in splits}  # type: ignore[index]
    _check_stackable(datasets, cfg)
    first = datasets[splits[0]]
    for k in splits:
        Path(member_dirs[k]).mkdir(parents=True, exist_ok=True)
        write_config(Path(member_dirs[k]), configs[k])  # type: ignore[arg-type]
        update_run_record(Path(member_dirs[k]), **device_record(device))

    torch.manual_seed(seed)  # nn.init: the initial network of every single run of these splits
    model = build_model(
        OmegaConf.to_container(cfg.model, resolve=True),  # type: ignore[arg-type]
        in_features=first.n_features,
        out_features=first.n_outputs,
    ).to(device, dtype)
    likelihoods = {k: build_likelihood(datasets[k], _cfg_get(members[k], "noise_precision")) for k in splits}
    priors = {k: run_prior(model, m, datasets[k]) for k, m in members.items()}
    method = build_method(configs[splits[0]]["method"])  # type: ignore[index]
    if member_configs is not None:
        method.configure_replicas([configs[k]["method"] for k in splits])  # type: ignore[index]
    method_generator = torch.Generator(device=device).manual_seed(seed + 1)
    data_generator = torch.Generator().manual_seed(seed + 2)
    eval_generators = {k: torch.Generator(device=device).manual_seed(seed + 3) for k in splits}
    problems = [
        Problem(
            model=model,
            likelihood=likelihoods[k],
            n_data=first.n_train,
            prior_precision=priors[k],
            generator=method_generator,
        )
        for k in splits
    ]
    method.setup_replicas(problems)  # a method that cannot stack says how to run the splits instead
    method.step_progress = bool(trainer.progress)

    generators = {"method": method_generator, "data": data_generator}
    generators.update({f"eval_{k}": g for k, g in eval_generators.items()})
    start_epoch, elapsed_before, histories = 0, 0.0, [[] for _ in splits]
    if checkpoint is not None:
        restore_checkpoint(checkpoint, method, generators, device)
        start_epoch, elapsed_before = checkpoint.epoch, checkpoint.elapsed_s
        if checkpoint.history_rows is None:  # a checkpoint that stored the rows themselves
            histories = checkpoint.history
        else:
            histories = [
                read_history(Path(member_dirs[k]) / HISTORY_FILE, int(n))
                for k, n in zip(splits, checkpoint.history_rows)  # type: ignore[arg-type]
            ]
        progress.done = start_epoch
        announce_resume(stack_dir, start_epoch)
    writers = {k: HistoryWriter(Path(member_dirs[k]) / "history.csv", rows) for k, rows in zip(splits, histories)}
    n_epochs, eval_every = int(trainer.n_epochs), int(trainer.eval_every)
    checkpoint_every = int(_cfg_get(cfg, "trainer.checkpoint_every", 0) or 0)
    bar = tqdm(
        total=n_epochs,
        initial=start_epoch,
        desc=f"{cfg.method.name} on {cfg.data.name}, {len(splits)} splits stacked",
        unit="epoch",
        disable=not trainer.progress,
        leave=False,
    )
    start = time.perf_counter() - elapsed_before
    cpu_start = time.process_time()

    def on_epoch_end(epoch: int, stats: Sequence[Mapping[str, float]]) -> None:
        evaluate_now = eval_every > 0 and (epoch % eval_every == 0 or epoch == n_epochs)
        for r, k in enumerate(splits):
            row = epoch_row(
                method.replica(r),
                likelihoods[k],
                datasets[k],
                epoch,
                stats[r],
                elapsed=time.perf_counter() - start,
                evaluate_now=evaluate_now,
                n_eval_samples=int(trainer.n_eval_mc_samples),
                eval_generator=eval_generators[k],
            )
            writers[k].append(row)
        saved = checkpoint_every > 0 and epoch % checkpoint_every == 0 and epoch < n_epochs
        if saved:
            save(epoch)
        bar.update(1)
        progress.done = epoch
        if epoch_hook is not None:
            epoch_hook(epoch)
        stop_if_terminated(progress, epoch, save, saved)

    def save(epoch: int) -> None:
        histories_now = [len(writers[k].rows) for k in splits]
        state = make_checkpoint(
            epoch, stack_hash, method, generators, device, histories_now, time.perf_counter() - start
        )
        save_checkpoint(checkpoint_path, state)

    progress.in_epochs = True
    try:
        method.fit_replicas(
            torch.stack([datasets[k].x_train for k in splits]),
            torch.stack([datasets[k].y_train for k in splits]),
            n_epochs=n_epochs,
            batch_size=int(trainer.batch_size),
            data_generator=data_generator,
            on_epoch_end=on_epoch_end,
            start_epoch=start_epoch,
        )
    finally:
        progress.in_epochs = False
        bar.close()
    if progress.stop_requested:  # a SIGTERM during work of the fit after its last epoch: stop now
        raise Terminated()
    progress.done = max(progress.done, n_epochs)
    train_time = (time.perf_counter() - start) / len(splits)
    cpu_time = (time.process_time() - cpu_start) / len(splits)
    results = {}
    shared = SharedPredictions(method, [datasets[k] for k in splits], [eval_generators[k] for k in splits])
    for r, k in enumerate(splits):
        results[k] = finish_run(
            members[k],
            Path(member_dirs[k]),
            method.replica(r),
            likelihood=likelihoods[k],
            dataset=datasets[k],
            prior=priors[k],
            config_hash_=hashes[k],
            train_time=train_time,
            cpu_time=cpu_time,
            eval_generator=eval_generators[k],
            extra_metrics={"stack_size": float(len(splits))},
            predictions=shared.of_copy(r, int(_cfg_get(members[k], "trainer.n_test_mc_samples"))),
        )
    checkpoint_path.unlink(missing_ok=True)
    return results


class SharedPredictions:
    """The final test and validation predictions of a stack's copies, made together where the method can
    (``predict_replicas``: MC dropout draws each mask once for all copies) and every copy would make them
    alike: all evaluation generators in one state and every split's parts of one shape. Copies are
    predicted in groups of at most ``PREDICTION_ELEMENTS`` outputs per part; each group replays the shared
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
            callable(getattr(method, "predict_replicas", None))
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


_SHARED = ("model", "trainer", "likelihood")  # what every member of a stack shares (one network, one loop)


def _check_shared(cfg: DictConfig, configs: Mapping[Hashable, Any]) -> None:
    """Refuse members that differ from ``cfg`` in what the stack shares, naming the key."""
    job = OmegaConf.to_container(cfg, resolve=True)
    for key in _SHARED:
        for member, config in configs.items():
            if config.get(key) != job.get(key):  # type: ignore[union-attr]
                raise ValueError(f"stacked member {member}: its {key} differs from the job's; a stack shares {key}")


def _check_stackable(datasets: Mapping[int, Any], cfg: DictConfig) -> None:
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
