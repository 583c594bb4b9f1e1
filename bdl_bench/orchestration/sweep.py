"""Sweep members and sweep summaries: skip finished runs, resume, record failures, report at the end.

:func:`run_job` is what the Hydra app runs for every member of a sweep (and for a single run): a finished run of
the job's config is skipped, one of another config refused (:class:`ConfigVersionError`; ``force=true`` re-runs
either), an unfinished run resumed from its checkpoint, and a run that raises leaves ``failure.json`` and
re-raises, so Hydra marks the job failed while the other members go on. Every attempt updates ``run.json``, from
which :func:`summarise` lists what a sweep did. ``docs/sweeps.md``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml
from omegaconf import DictConfig, OmegaConf

from bdl_bench.errors import ConfigError, OutputPathError, UserError
from bdl_bench.methods.base import CannotStack
from bdl_bench.orchestration import locking
from bdl_bench.orchestration.hydra_app import load_config, override_dirname
from bdl_bench.orchestration.runner import run
from bdl_bench.orchestration.search import has_search, tuned_members, with_method_settings, write_split_trials
from bdl_bench.orchestration.stacked import member_config, run_stack, stacked_splits
from bdl_bench.orchestration.status import run_folders
from bdl_bench.orchestration.write_errors import WriteError, write_error
from bdl_bench.results import (
    METRICS_FILE,
    RUN_RECORD_FILE,
    atomic_write_text,
    clear_attempt,
    code_version,
    config_hash,
    read_failure,
    read_run_record,
    stored_config_hash,
    update_run_record,
    write_failure,
)

EXIT_MESSAGE = "bdl-bench: the run failed; exiting with status 1 so that the scheduler records a failed job"


class ConfigVersionError(UserError, RuntimeError):
    """A run folder holds a finished run whose config differs from the job's."""


@dataclass(frozen=True)
class JobResult:
    run_dir: Path
    metrics: dict[str, float]
    skipped: bool


def _task_overrides() -> list[str]:
    """The job's own command-line overrides (empty outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)


def _exit_with_failure_status() -> None:
    """Under submitit, make this process end with exit status 1 after the launcher has stored its result (which
    returns a failed job's record as a normal result, that Slurm would account as COMPLETED: hydra#1928)."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return

    def _exit() -> None:
        print(EXIT_MESSAGE, file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    atexit.register(_exit)


def run_job(cfg: DictConfig, run_dir: Path) -> JobResult:
    """Skip, resume or run the job ``cfg`` in ``run_dir``; record a failure and re-raise it. A job whose
    ``data.split`` is a list runs those splits stacked (:func:`run_stacked_job`)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = _task_overrides()
    if stacked_splits(cfg) is not None or has_search(cfg):  # a search stacks its trials, even of one split
        return run_stacked_job(cfg, run_dir, overrides)
    with locking.holding([run_dir]):  # one writer per run folder
        force = bool(OmegaConf.select(cfg, "force", default=False))
        config: dict[str, Any] = {}
        try:
            config = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
            chash = config_hash(config)
            if _finished(run_dir, chash, force):
                metrics = json.loads((run_dir / METRICS_FILE).read_text())
                return JobResult(run_dir=run_dir, metrics=metrics, skipped=True)
            _start_attempt(run_dir, chash, overrides, force)
            result = run(cfg, run_dir)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, submitit's requeue (its exit)
            _record_interrupted([run_dir])
            raise
        except Exception as error:
            _fail(error, {run_dir: (config, overrides)})
        try:
            update_run_record(run_dir, status="finished", ended=time.time(), error=None)
        except OSError as error:  # the run's files are whole; only its record says "running"
            raise write_error(error, run_dir) or error from None
        return JobResult(run_dir=run_dir, metrics=result.metrics, skipped=False)


def _record_interrupted(run_dirs: list[Path]) -> None:
    """``interrupted`` in the ``run.json`` of ``run_dirs`` (those that have one); a record that cannot be
    written (a full disk) is left as it was."""
    for run_dir in run_dirs:
        if (run_dir / RUN_RECORD_FILE).exists():
            with contextlib.suppress(OSError):
                update_run_record(run_dir, status="interrupted", ended=time.time(), last_seen=time.time())


def _record_failure(run_dir: Path, error: BaseException, config: dict[str, Any], overrides: list[str]) -> Exception:
    """The failure record (``failure.json``/``failure.txt``) and a ``failed`` status in ``run.json``; returns
    the error to raise: ``error``, or for a failed write its one-line
    :class:`~bdl_bench.orchestration.write_errors.WriteError`, which says so when the record failed too."""
    failure = write_error(error, run_dir) or error
    try:
        write_failure(run_dir, failure, config, overrides)
        update_run_record(run_dir, status="failed", ended=time.time(), last_seen=time.time(), error=repr(failure))
    except OSError as unwritten:
        if write_error(unwritten, run_dir) is None:
            raise
        note = f"its failure record in {run_dir} could not be written either"
        if isinstance(failure, WriteError):
            return WriteError(f"{failure}; {note}")
        print(f"bdl-bench: {note} ({write_error(unwritten, run_dir)})", file=sys.stderr)
    return failure  # type: ignore[return-value]


def _fail(error: Exception, records: dict[Path, tuple[Any, list[str]]]) -> NoReturn:
    """Record ``error`` in each run folder of ``records`` (folder → its config and overrides) and raise it, or the
    one-line error of a failed write; under submitit, the job also ends with exit status 1."""
    failures = [_record_failure(d, error, config, overrides) for d, (config, overrides) in records.items()]
    _exit_with_failure_status()
    if failures[0] is not error:
        raise failures[0] from None
    raise error


def _split_record(member: DictConfig, overrides: list[str], split: int) -> tuple[Any, list[str]]:
    """What a split's failure record holds: its config, and the overrides of its single run."""
    return OmegaConf.to_container(member), _with_split(overrides, split)


def _finished(run_dir: Path, chash: str, force: bool) -> bool:
    """Whether ``run_dir`` holds a finished run of this config (recorded as skipped); never with ``force``.
    A ``metrics.json`` cut short is no finished run; one of another config raises :class:`ConfigVersionError`."""
    if force or not (run_dir / METRICS_FILE).exists():
        return False
    try:
        json.loads((run_dir / METRICS_FILE).read_text())
    except ValueError:
        print(f"{run_dir / METRICS_FILE} is cut short; running that run again", file=sys.stderr, flush=True)
        return False
    stored = stored_config_hash(run_dir)
    if stored != chash:
        raise ConfigVersionError(
            f"{run_dir} holds a finished run of another config version (config hash {stored}, this job "
            f"{chash}): a default or the experiment changed since it ran. Re-run it with force=true, "
            "or write this sweep elsewhere (hydra.sweep.dir=… or results_root=…)"
        )
    update_run_record(run_dir, status="skipped", last_seen=time.time())
    clear_attempt(run_dir, finished=False)
    return True


def _start_attempt(run_dir: Path, chash: str, overrides: list[str], force: bool) -> None:
    """Clear a previous attempt's failure record and mark the run as running in ``run.json``."""
    clear_attempt(run_dir, finished=force)
    record = read_run_record(run_dir)
    version = code_version()
    # every code version whose attempts left state this one may resume (a checkpoint, a search's points, stored
    # predictions): a table's header names the runs that span more than one (version_warnings)
    earlier = [] if force else record.get("code_versions") or [v for v in [record.get("code_version")] if v]
    update_run_record(
        run_dir,
        status="running",
        started=time.time(),
        last_seen=time.time(),
        ended=None,
        attempts=int(record.get("attempts", 0)) + 1,
        host=os.uname().nodename,
        pid=os.getpid(),
        code_version=version,
        code_versions=earlier if earlier[-1:] == [version] else [*earlier, version],
        config_hash=chash,
        overrides=overrides,
    )


def member_dirs(run_dir: Path, overrides: list[str], splits: list[int]) -> dict[int, Path]:
    """The run folder of each split of a stacked job: the folder a single run of that split gets (the
    job's overrides with ``data.split=<k>``, named as Hydra names it), or ``run_dir/split=<k>`` outside
    a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    from bdl_bench.resolvers import run_name

    if not HydraConfig.initialized():
        return {k: run_dir / f"split={k}" for k in splits}
    naming = HydraConfig.get().job.config.override_dirname
    job_name = run_name(HydraConfig.get().job.override_dirname)
    if not str(run_dir).endswith(job_name):
        raise ConfigError(
            f"cannot name the split folders of stacked job {run_dir}: its folder is not named by its overrides"
        )
    root = str(run_dir)[: len(str(run_dir)) - len(job_name)]
    return {k: Path(root + run_name(override_dirname(_with_split(overrides, k), naming))) for k in splits}


def _with_split(overrides: list[str], split: int) -> list[str]:
    """The overrides of the single run of ``split``: the job's, with ``data.split=<split>``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    return [f"data.split={split}" if parser.parse_override(o).key_or_group == "data.split" else o for o in overrides]


def run_stacked_job(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> JobResult:
    """:func:`run_job` for a stacked job: splits whose folder holds a finished run of the same config are
    skipped, the others fitted together (one after another when the method cannot stack); each split's folder
    gets its own ``run.json`` and failure record. The result holds the mean of each metric over the splits."""
    force = bool(OmegaConf.select(cfg, "force", default=False))
    if has_search(cfg):
        cfg = with_method_settings(cfg)
    splits = stacked_splits(cfg) or [int(cfg.data.split)]
    dirs = member_dirs(run_dir, overrides, splits)
    with locking.holding([run_dir, *dirs.values()]):  # the job's folder (checkpoint, search) and every split's
        members = {k: member_config(cfg, k) for k in splits}
        if has_search(cfg):  # each split's test run with its own best values (bdl_bench.orchestration.search)
            try:
                members = tuned_members(cfg, run_dir, splits)
            except Exception as error:  # a bad search spec, a failed search: every split's folder says so
                _fail(error, {d: _split_record(members[k], overrides, k) for k, d in dirs.items()})
            write_split_trials(run_dir, dirs)
        hashes = {k: config_hash(OmegaConf.to_container(members[k], resolve=True)) for k in splits}  # type: ignore[arg-type]
        todo = {}
        conflicts: list[ConfigVersionError] = []
        for k, d in dirs.items():
            try:
                if not _finished(d, hashes[k], force):
                    todo[k] = d
            except ConfigVersionError as error:  # recorded in the split's folder, as a single run records it
                _record_failure(d, error, *_split_record(members[k], overrides, k))
                conflicts.append(error)
        if conflicts:
            raise conflicts[0]
        if todo:
            for k, d in todo.items():
                _start_attempt(d, hashes[k], _with_split(overrides, k), force)
                if overrides:  # what a single run's Hydra folder records (reproduce re-composes runs from it)
                    atomic_write_text(d / ".hydra" / "overrides.yaml", yaml.safe_dump(_with_split(overrides, k)))
            try:
                run_stack(cfg, todo, run_dir, members)
            except CannotStack as reason:
                print(f"{reason}: the {len(todo)} splits run one after another", file=sys.stderr, flush=True)
                _run_one_by_one(members, todo, overrides)
            except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, a requeue: every unfinished split says so
                _record_interrupted([d for d in todo.values() if not (d / METRICS_FILE).exists()])
                raise
            except Exception as error:
                _fail(error, {d: _split_record(members[k], overrides, k) for k, d in todo.items()})
            else:
                for d in todo.values():
                    update_run_record(d, status="finished", ended=time.time(), error=None)
        per_split = [json.loads((d / METRICS_FILE).read_text()) for d in dirs.values()]
        keys = set.intersection(*(set(m) for m in per_split))
        means = {key: sum(float(m[key]) for m in per_split) / len(per_split) for key in keys}
        return JobResult(run_dir=run_dir, metrics=means, skipped=not todo)


def _run_one_by_one(members: dict[int, DictConfig], todo: dict[int, Path], overrides: list[str]) -> None:
    """The splits of a job whose method cannot stack, each as its single run in its own folder (as a sweep
    of single jobs would run them: a failed split is recorded and the others still run; the first failure
    is raised at the end)."""
    first_error: Exception | None = None
    for k, d in todo.items():
        try:
            run(members[k], d)
        except (KeyboardInterrupt, SystemExit):
            _record_interrupted([d for d in todo.values() if not (d / METRICS_FILE).exists()])
            raise
        except Exception as error:
            failure = _record_failure(d, error, *_split_record(members[k], overrides, k))
            first_error = first_error or failure
            continue
        update_run_record(d, status="finished", ended=time.time(), error=None)
    if first_error is not None:
        _exit_with_failure_status()
        raise first_error


@dataclass(frozen=True)
class SweepSummary:
    """What the members of one sweep did, from their ``run.json`` records."""

    finished: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    failed: list[tuple[Path, str]] = field(default_factory=list)  # (run folder, "ErrorType: message")
    unfinished: list[Path] = field(default_factory=list)  # still running, or killed
    elsewhere: list[tuple[Path, str]] = field(default_factory=list)  # (run folder, its holder): another process's

    def render(self, root: Path | None = None, *, ran: bool = True) -> str:
        """One line of counts, then a line per run needing attention. ``ran=False``: nothing was run now
        (``reproduce --no-run``), so finished runs are counted as finished, not as run."""

        def name(path: Path) -> str:
            return str(path.relative_to(root)) if root is not None and path.is_relative_to(root) else str(path)

        n_runs = sum(map(len, (self.finished, self.skipped, self.failed, self.unfinished, self.elsewhere)))
        done = (
            f"{len(self.finished)} ran, {len(self.skipped)} skipped (finished earlier)"
            if ran
            else f"{len(self.finished) + len(self.skipped)} finished (none run now)"
        )
        lines = [
            f"sweep summary: {n_runs} runs: {done}, {len(self.failed)} failed, {len(self.unfinished)} unfinished"
            + (f", {len(self.elsewhere)} running elsewhere" if self.elsewhere else "")
            + (f" (below {root})" if root is not None else "")
        ]
        for path, holder in self.elsewhere:
            lines.append(f"  RUNNING ELSEWHERE {name(path)}: {holder} (nothing run; re-run the sweep once it ends)")
        for path, error in self.failed:
            lines.append(f"  FAILED {name(path)}: {error}  [see {name(path / 'failure.txt')}]")
        for path in self.unfinished:
            lines.append(f"  UNFINISHED {name(path)} (still running or killed; re-run the sweep to resume it)")
        return "\n".join(lines)


def _error_line(run_dir: Path) -> str:
    failure = read_failure(run_dir) or {}
    message = str(failure.get("message", "")).splitlines()[0] if failure.get("message") else ""
    return f"{failure.get('error_type', 'error')}: {message}"[:300]


def summarise(root: Path, *, since: float | None = None, run_dirs: list[Path] | None = None) -> SweepSummary:
    """Classify the run folders below ``root`` seen by a sweep that started at ``since`` (or exactly
    ``run_dirs``) by the status of their latest attempt; a folder that another live process holds
    (:mod:`bdl_bench.orchestration.locking`) is *running elsewhere*, whenever that process started."""
    if run_dirs is None:
        run_dirs = [
            d
            for d in run_folders(root, (RUN_RECORD_FILE, locking.LOCK_FILE))
            if read_run_record(d).get("last_seen", 0) >= (since or 0) - 1 or locking.lock_state(d)[0] == "held"
        ]
    summary = SweepSummary()
    for run_dir in run_dirs:
        status = read_run_record(run_dir).get("status")
        state, holder = locking.lock_state(run_dir)
        if state == "held" and holder is not None:
            summary.elsewhere.append((run_dir, holder.describe()))
        elif status == "failed":
            summary.failed.append((run_dir, _error_line(run_dir)))
        elif status == "skipped":
            summary.skipped.append(run_dir)
        elif status == "finished" and (run_dir / METRICS_FILE).exists():
            summary.finished.append(run_dir)
        else:
            summary.unfinished.append(run_dir)
    return summary


def output_folder(args: list[str], *, multirun: bool) -> Path | None:
    """The sweep folder (``multirun``: when ``args`` start a sweep, ``-m``) or run folder of ``bdl-bench run``
    with command-line ``args``; ``None`` otherwise (``--cfg``, ``--help``, … or a config that does not compose)."""
    from hydra._internal.utils import get_args_parser

    ns = get_args_parser().parse_args(args)
    if bool(ns.multirun) != multirun or ns.cfg or ns.help or ns.hydra_help or ns.info or ns.shell_completion:
        return None
    try:
        cfg = load_config(ns.overrides, multirun=multirun, config_name=ns.config_name or "config")
        return Path(str(cfg.hydra.sweep.dir if multirun else cfg.hydra.run.dir)).absolute()
    except Exception:  # noqa: BLE001 - a config that does not compose: Hydra itself reports why, next
        return None


def check_output_folder(folder: Path) -> None:
    """Make the output folder, or refuse it with one line (:class:`~bdl_bench.errors.OutputPathError`) when it
    cannot be made: one of its parents (or itself) is a file, the nearest existing parent is not writable, or the
    system refuses it."""
    for path in (folder, *folder.parents):
        if not path.exists():
            continue
        if not path.is_dir():
            raise OutputPathError(
                f"cannot make the output folder {folder}: {path} is a file, not a folder; "
                "choose another results_root=... (or move the file)"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise OutputPathError(
                f"cannot make the output folder {folder}: {path} is not writable; choose another results_root=..."
            )
        break
    try:  # what Hydra does next; here its failure is one line instead of a traceback
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputPathError(
            f"cannot make the output folder {folder}: {error.strerror or error}; choose another results_root=..."
        ) from error


def version_warnings(root: Path) -> list[str]:
    """Reasons not to trust a table of the runs below ``root`` blindly: finished runs made by different
    code versions, runs whose attempts (a killed run resumed, a search continued) span code versions, and
    finished runs whose latest attempt failed (e.g. a newer config version refused)."""
    from bdl_bench.results import find_run_dirs

    versions: dict[str, int] = {}
    stale, spanning = [], []
    for run_dir in find_run_dirs(Path(root)):
        if not (run_dir / METRICS_FILE).exists():
            continue
        record = read_run_record(run_dir)
        version = str(record.get("code_version", "unknown (no run.json)"))
        versions[version] = versions.get(version, 0) + 1
        if record.get("status") == "failed":
            stale.append(run_dir)
        if len(record.get("code_versions") or []) > 1:
            chain = " → ".join(v.rpartition("+g")[2][:7] for v in record["code_versions"])
            spanning.append(f"{run_dir.relative_to(root)}: {chain}")
    warnings = []
    if len(versions) > 1:
        counts = ", ".join(f"{v}: {n} runs" for v, n in sorted(versions.items()))
        warnings.append(f"the runs below {root} come from {len(versions)} code versions ({counts})")
    if spanning:
        warnings.append(
            f"{len(spanning)} run(s) resumed or retried under more than one code version, in order "
            f"({'; '.join(spanning)})"
        )
    if stale:
        warnings.append(
            f"{len(stale)} finished run(s) below {root} have a later failed attempt, e.g. {stale[0]} "
            f"({_error_line(stale[0])}); their metrics may be from an older config version"
        )
    return warnings
