"""``bdl-bench`` entry point: routes subcommands; ``run`` is a Hydra application over ``conf/``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from bdl_bench.errors import Terminated, UserError
from bdl_bench.sigterm import TERMINATED_STATUS

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("data", "model", "method", "trainer", "experiment", "variant", "tune")

USAGE = """usage: bdl-bench <command> [args]

commands:
  run [key=value ...]     fit and evaluate one config (Hydra app: -m/--multirun, --cfg job, --help)
  table <folder> [...]    Markdown/CSV table of every finished run below <folder>
  plot <folder> [...]     figures from run folders (convergence, covariance, ood)
  data list|fetch|verify  the download registry: list files, fetch them into the cache, verify checksums
  reproduce <experiment>  run (or resume) a paper experiment's sweep, tuning included, and compare with the paper
  list [group ...]        what can be chosen: methods, datasets, models, experiments, … with one line each
  status <folder>         finished, failed, running and stale runs below a sweep or results folder
  --version               the package version, its git checkout and the main packages' versions

examples:
  bdl-bench run                                  # SLANG on UCI boston, split 0
  bdl-bench run method=bbb data=uci/concrete data.split=3
  bdl-bench run -m experiment=slang_table2 method=bbb,dropout data.split='range(20)'
  bdl-bench run -m hydra/launcher=joblib hydra.launcher.n_jobs=2 method=bbb data.split='range(20)'
  bdl-bench table results/slang_table2
  bdl-bench reproduce slang_table2 --quick

errors: a mistake in the input (a config value, a data file, a diverging run, an output path) is one line,
  "bdl-bench: <message>", and exit status 1; `bdl-bench --debug <command>` (or BDL_BENCH_DEBUG=1, or
  HYDRA_FULL_ERROR=1) shows its traceback. Ctrl-C stops a run with exit status 130, SIGTERM (a scheduler's
  time limit) at the end of the epoch under way with a checkpoint there and status 143; run the same command
  to resume it from its last checkpoint. A run folder another process holds is refused (see docs/faults.md).
"""

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


def check_group_overrides(overrides: list[str]) -> None:
    """Fail early, listing the choices, when ``group=value`` names no YAML (Hydra lists them only for
    flat groups, so ``data=uci/no_such_set`` would otherwise give a bare 'not found')."""
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if not sep or key not in GROUPS or "(" in value or value in ("null", ""):
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
    from bdl_bench.allocator import keep_freed_memory
    from bdl_bench.sweep import run_job

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


def hydra_error_line(error: BaseException) -> str:
    """One line for an error Hydra reports about the command line (a key that does not exist, an override
    it cannot parse, a config it cannot find), with the first line of its cause (OmegaConf's reason)."""
    cause = error.__cause__
    reason = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    line = error_line(error)
    return f"{line} ({reason})" if reason and reason not in line else line


@contextlib.contextmanager
def _hydra_raises_user_errors() -> Iterator[None]:
    """Within: Hydra raises a user error (ours, or its own about the command line) to the caller instead of
    printing it over several lines with a hint about HYDRA_FULL_ERROR; any other error it reports as before
    (a traceback). Hydra reads the module's ``run_and_report`` at each call, so replacing it is enough."""
    import hydra._internal.utils as hydra_utils
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    from bdl_bench.write_errors import write_error

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
    except HydraException as error:  # Hydra's own about the command line
        if debugging():
            raise
        return SystemExit(hydra_error_line(error))
    return None


def run_command(args: list[str]) -> None:
    """``bdl-bench run``; a sweep (-m) ends with a summary of its members and fails if any failed."""
    from bdl_bench.sweep import check_output_folder, multirun_folder, run_folder, summarise

    check_group_overrides([a for a in args if not a.startswith("-")])
    sweep_dir = multirun_folder(CONF_DIR, args)
    output = sweep_dir or run_folder(CONF_DIR, args)
    if output is not None:
        check_output_folder(output)
        if sweep_dir is None:  # a held run folder: refused before Hydra writes its files into it
            refuse_if_held(output)
    started = time.time()
    error = run_hydra(args)
    if sweep_dir is None:
        if error is not None:
            raise error
        return
    if error is not None and isinstance(error.code, str):  # the first failed member's line, then the summary
        print(error.code, file=sys.stderr)
        error = SystemExit(1)
    summary = summarise(sweep_dir, since=started)
    print(summary.render(sweep_dir))
    if summary.failed or summary.unfinished or summary.elsewhere:
        raise SystemExit(1)
    if error is not None:
        raise error


def refuse_if_held(folder: Path) -> None:
    """Raise :class:`~bdl_bench.locking.FolderInUse` when a live process holds ``folder``."""
    from bdl_bench import locking

    state, holder = locking.lock_state(folder)
    if state == "held" and holder is not None:
        raise locking.FolderInUse(locking.in_use_message(folder, holder), holder)


def status_command(args: list[str]) -> None:
    from bdl_bench.status import main as status_main

    status_main(args)


def table_command(args: list[str]) -> None:
    from bdl_bench.report.tables import build_table

    parser = argparse.ArgumentParser(prog="bdl-bench table", description="Summarise finished runs below a folder.")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--csv", type=Path, default=None, help="CSV output path (default <folder>/table.csv)")
    parser.add_argument("--paper", default=None, help="paper table to compare with (default: from the runs' config)")
    parser.add_argument("--metrics", default=None, help="comma-separated metric keys (default: all found)")
    parser.add_argument(
        "--relative-to",
        default=None,
        metavar="METHOD",
        help="show each metric as the difference to METHOD's run on the same split (and the paper's likewise)",
    )
    parser.add_argument(
        "--search", action="store_true", help="list the values each tuned run's search chose (its search.csv)"
    )
    parser.add_argument(
        "--strict", action="store_true", help="stop at an unreadable metrics.json instead of skipping it with a warning"
    )
    ns = parser.parse_args(args)
    if not ns.folder.is_dir():
        raise SystemExit(f"bdl-bench table: {ns.folder} is not a folder")
    if ns.search:
        from bdl_bench.search import search_summary

        summary = search_summary(ns.folder)
        if summary.empty:
            raise SystemExit(f"bdl-bench table --search: no tuned run (search.csv) below {ns.folder}")
        summary.to_csv(ns.csv or ns.folder / "search_table.csv", index=False)
        print(summary.to_string(index=False))
        return
    metrics = ns.metrics.split(",") if ns.metrics else None
    from bdl_bench.sweep import version_warnings

    for warning in version_warnings(ns.folder):
        print(f"warning: {warning}", file=sys.stderr)
    table = build_table(ns.folder, paper=ns.paper, metrics=metrics, relative_to=ns.relative_to, strict=ns.strict)
    for warning in table.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    csv_path = ns.csv or ns.folder / "table.csv"
    table.frame.to_csv(csv_path, index=False)
    print(table.markdown)
    print(f"\n(CSV: {csv_path})")


def plot_command(args: list[str]) -> None:
    from bdl_bench.report.plots import main as plot_main

    plot_main(args)


STATUS_PAGE = CONF_DIR.parent / "results" / "README.md"


def reproduce_command(args: list[str]) -> None:
    """``reproduce <experiment>``; ``reproduce --list``: every paper artefact with its status and command;
    ``reproduce --status-page``: rewrite ``results/README.md`` from the artefact catalogue."""
    if args in (["--list"], ["--status-page"]):
        from bdl_bench.report.artefacts import listing, load_catalogue, render_page

        artefacts = load_catalogue()
        if args == ["--list"]:
            print(listing(artefacts))
        else:
            STATUS_PAGE.write_text(render_page(artefacts, STATUS_PAGE.parent) + "\n")
            print(f"wrote {STATUS_PAGE}")
        return
    from bdl_bench.reproduce import main as reproduce_main

    reproduce_main(args)


def list_command(args: list[str]) -> None:
    from bdl_bench.catalogue import LISTED_GROUPS, listing

    unknown = [group for group in args if group not in LISTED_GROUPS]
    if unknown:
        raise SystemExit(f"bdl-bench list: unknown group {unknown[0]!r}; available: {', '.join(LISTED_GROUPS)}")
    print(listing(CONF_DIR, tuple(args) or LISTED_GROUPS))


def data_command(args: list[str]) -> None:
    from bdl_bench.data.data_cli import main as data_main

    data_main(args)


def main(argv: list[str] | None = None) -> None:
    """Run a ``bdl-bench`` command; a :class:`~bdl_bench.errors.UserError` becomes one line and status 1."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--debug"]:
        os.environ[DEBUG_ENV] = "1"
        argv = argv[1:]
    try:
        dispatch(argv)
    except (UserError, OSError) as error:
        from bdl_bench.write_errors import write_error

        user_error = error if isinstance(error, UserError) else write_error(error)  # a full disk, a read-only folder
        if debugging() or user_error is None:
            raise
        print(error_line(user_error), file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt as interrupt:  # Interrupted says where the run stood; a bare one, that it stopped
        if debugging():
            raise
        print(error_line(interrupt) if str(interrupt) else "bdl-bench: interrupted", file=sys.stderr)
        raise SystemExit(TERMINATED_STATUS if isinstance(interrupt, Terminated) else INTERRUPT_STATUS) from None


def dispatch(argv: list[str]) -> None:
    """Route ``argv`` to its subcommand."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if argv[0] == "--version":
        from bdl_bench.catalogue import version_text

        print(version_text())
        return
    command, rest = argv[0], argv[1:]
    commands = {
        "run": run_command,
        "table": table_command,
        "plot": plot_command,
        "reproduce": reproduce_command,
        "data": data_command,
        "status": status_command,
        "list": list_command,
    }
    if command not in commands:
        raise SystemExit(f"bdl-bench: unknown command {command!r}; available: {', '.join(commands)}\n\n{USAGE}")
    commands[command](rest)


if __name__ == "__main__":
    main()
