"""The Hydra application behind ``bdl-bench run`` and ``reproduce``: the config folder, its groups, the job
(one run into Hydra's output folder) and how its errors reach the user as one line."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from bdl_bench.errors import Terminated, UserError
from bdl_bench.orchestration.catalogue import LISTED_GROUPS
from bdl_bench.orchestration.sigterm import TERMINATED_STATUS

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

DEBUG_ENV = "BDL_BENCH_DEBUG"
INTERRUPT_STATUS = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C


def debugging() -> bool:
    """Whether user errors should show their traceback (``--debug``, ``BDL_BENCH_DEBUG=1``, ``HYDRA_FULL_ERROR=1``)."""
    return any(os.environ.get(name, "") not in ("", "0") for name in (DEBUG_ENV, "HYDRA_FULL_ERROR"))


def error_line(error: BaseException) -> str:
    """The one line the user sees for a user error (a message over several lines is joined)."""
    return "bdl-bench: " + " ".join(str(error).split())


class ReportedError(CompactHydraException):
    """A sweep member's user error, as Hydra reports it at the end of the sweep: its one line, no traceback."""


def group_choices(group: str) -> list[str]:
    """Every option of a config group, as typed after ``group=`` (``uci/boston``)."""
    root = CONF_DIR / group
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


def load_config(overrides: Sequence[str], *, multirun: bool = True, config_name: str = "config") -> DictConfig:
    """The config Hydra composes from ``conf/`` and command-line ``overrides``, its ``hydra`` node included."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        mode = RunMode.MULTIRUN if multirun else RunMode.RUN
        return GlobalHydra.instance().config_loader().load_configuration(config_name, list(overrides), run_mode=mode)


def override_dirname(overrides: Sequence[str], naming: Any) -> str:
    """The folder name Hydra derives from ``overrides`` (``hydra.job.override_dirname``) under ``naming`` (the
    config's ``hydra.job.config.override_dirname``): the overrides, less its ``exclude_keys``, sorted and joined."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    exclude_keys, item_sep, kv_sep = list(naming.exclude_keys), str(naming.item_sep), str(naming.kv_sep)
    return get_overrides_dirname(parsed, exclude_keys=exclude_keys, item_sep=item_sep, kv_sep=kv_sep)


def check_group_overrides(overrides: list[str]) -> None:
    """Fail early, listing the choices, when ``group=value`` names no YAML (Hydra lists them only for
    flat groups, so ``data=uci/no_such_set`` would otherwise give a bare 'not found')."""
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if not sep or key not in LISTED_GROUPS or "(" in value or value in ("null", ""):
            continue
        choices = group_choices(key)
        for item in value.split(","):
            if item not in choices:
                raise SystemExit(f"bdl-bench: unknown {key} {item!r}; available: {', '.join(choices)}")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_app(cfg: DictConfig) -> float | None:
    """The Hydra job: one run (skipped when finished, resumed when checkpointed) into Hydra's output
    folder; returns its objective (validation log-likelihood when there is a validation part, else test
    log-likelihood)."""
    from bdl_bench.orchestration.allocator import keep_freed_memory
    from bdl_bench.orchestration.sweep import run_job

    keep_freed_memory()  # in every process that runs jobs (a joblib or submitit worker too)
    try:
        result = run_job(cfg, Path(HydraConfig.get().runtime.output_dir))
    except KeyboardInterrupt as stop:
        if os.environ.get("SUBMITIT_EXECUTOR") and not debugging():  # a worker: its line and status, no traceback
            print(error_line(stop) if str(stop) else "bdl-bench: interrupted", file=sys.stderr, flush=True)
            os._exit(TERMINATED_STATUS if isinstance(stop, Terminated) else INTERRUPT_STATUS)
        raise
    except UserError as error:  # recorded in the run folder (failure.json) by run_job
        if debugging():
            raise
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # the other members go on; the summary lists it
            raise ReportedError(error_line(error)) from None
        print(error_line(error), file=sys.stderr)
        raise SystemExit(1) from None
    keys = ("val_test_ll", "rmse", "test_ll", "nll", "accuracy", "elbo", "sym_kl")
    summary = ", ".join(f"{k} {result.metrics[k]:.4g}" for k in keys if result.metrics.get(k) is not None)
    how = "finished earlier, skipped" if result.skipped else f"{result.metrics['train_time_s']:.1f} s"
    print(f"{cfg.method.name} on {cfg.data.name}: {summary} ({how}) → {result.run_dir}")
    return result.metrics.get("val_test_ll", result.metrics.get("test_ll"))


@contextlib.contextmanager
def _hydra_raises_user_errors() -> Iterator[None]:
    """Within: Hydra raises a user error (ours, or its own about the command line) to the caller instead of
    printing it over several lines with a hint about HYDRA_FULL_ERROR; any other error it reports as before
    (a traceback). Hydra reads the module's ``run_and_report`` at each call, so replacing it is enough."""
    import hydra._internal.utils as hydra_utils
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    from bdl_bench.orchestration.write_errors import write_error

    user_errors = (UserError, ReportedError, ConfigCompositionException, MissingConfigException, OverrideParseException)
    report = hydra_utils.run_and_report

    def run_and_raise(func: Any) -> Any:
        try:
            return func()
        except user_errors:
            raise
        except Exception as error:  # noqa: BLE001 - a bug: Hydra's own report (its traceback)
            if write_error(error) is not None:  # Hydra's own files (.hydra/, the job's log) on a full disk
                raise write_error(error) from None
            bug = error

        def again() -> Any:
            raise bug

        return report(again)

    hydra_utils.run_and_report = run_and_raise
    try:
        yield
    finally:
        hydra_utils.run_and_report = report


def run_hydra(args: list[str]) -> SystemExit | None:
    """Run the Hydra app with command-line ``args``; Hydra's exit (on an error) is returned, not raised.
    A user error (a bad key or value on the command line, a failed sweep member's one line) comes back as
    the exit's one-line message; with ``--debug`` it is raised with its traceback."""
    from hydra.errors import HydraException

    sys.argv = ["bdl-bench run", *args]
    try:
        with _hydra_raises_user_errors():
            hydra_app()
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            return exit_
    except UserError as error:  # raised by a sweep member in a worker process (joblib, submitit)
        if debugging():
            raise
        return SystemExit(error_line(error))
    except ReportedError as error:  # a sweep member's user error, its line made already
        return SystemExit(str(error))
    except HydraException as error:  # Hydra's own about the command line, with its cause's (OmegaConf's) reason
        if debugging():
            raise
        return SystemExit(hydra_error_line(error))
    return None


def hydra_error_line(error: BaseException) -> str:
    """:func:`error_line` of Hydra's error about the command line, with its cause's (OmegaConf's) first line."""
    cause = str(error.__cause__ or "").strip()
    reason = cause.splitlines()[0] if cause else ""
    line = error_line(error)
    return f"{line} ({reason})" if reason and reason not in line else line
