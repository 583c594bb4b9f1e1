"""``bdl-bench`` entry point: routes subcommands; ``run`` is a Hydra application over ``conf/``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from bdl_bench.errors import Terminated, UserError
from bdl_bench.orchestration.hydra_app import (
    CONF_DIR,
    DEBUG_ENV,
    INTERRUPT_STATUS,
    check_group_overrides,
    debugging,
    error_line,
    run_hydra,
)
from bdl_bench.orchestration.sigterm import TERMINATED_STATUS

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


def run_command(args: list[str]) -> None:
    """``bdl-bench run``; a sweep (-m) ends with a summary of its members and fails if any failed."""
    from bdl_bench.orchestration import locking
    from bdl_bench.orchestration.sweep import check_output_folder, output_folder, summarise

    check_group_overrides([a for a in args if not a.startswith("-")])
    sweep_dir = output_folder(args, multirun=True)
    output = sweep_dir or output_folder(args, multirun=False)
    if output is not None:
        check_output_folder(output)
        if sweep_dir is None:  # a held run folder: refused before Hydra writes its files into it
            state, holder = locking.lock_state(output)
            if state == "held" and holder is not None:
                raise locking.FolderInUse(locking.in_use_message(output, holder), holder)
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
        from bdl_bench.orchestration.search import search_summary

        summary = search_summary(ns.folder)
        if summary.empty:
            raise SystemExit(f"bdl-bench table --search: no tuned run (search.csv) below {ns.folder}")
        summary.to_csv(ns.csv or ns.folder / "search_table.csv", index=False)
        print(summary.to_string(index=False))
        return
    metrics = ns.metrics.split(",") if ns.metrics else None
    from bdl_bench.orchestration.sweep import version_warnings

    for warning in version_warnings(ns.folder):
        print(f"warning: {warning}", file=sys.stderr)
    table = build_table(ns.folder, paper=ns.paper, metrics=metrics, relative_to=ns.relative_to, strict=ns.strict)
    for warning in table.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    csv_path = ns.csv or ns.folder / "table.csv"
    table.frame.to_csv(csv_path, index=False)
    print(table.markdown)
    print(f"\n(CSV: {csv_path})")


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
    from bdl_bench.orchestration.reproduce import main as reproduce_main

    reproduce_main(args)


def list_command(args: list[str]) -> None:
    from bdl_bench.orchestration.catalogue import LISTED_GROUPS, listing

    unknown = [group for group in args if group not in LISTED_GROUPS]
    if unknown:
        raise SystemExit(f"bdl-bench list: unknown group {unknown[0]!r}; available: {', '.join(LISTED_GROUPS)}")
    print(listing(CONF_DIR, tuple(args) or LISTED_GROUPS))


def main(argv: list[str] | None = None) -> None:
    """Run a ``bdl-bench`` command; a :class:`~bdl_bench.errors.UserError` becomes one line and status 1."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--debug"]:
        os.environ[DEBUG_ENV] = "1"
        argv = argv[1:]
    try:
        dispatch(argv)
    except BrokenPipeError:  # `bdl-bench list | head`: the reader has what it wanted; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would raise again
        raise SystemExit(1) from None
    except (UserError, OSError) as error:
        from bdl_bench.orchestration.write_errors import write_error

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
        from bdl_bench.orchestration.catalogue import version_text

        print(version_text())
        return
    command, rest = argv[0], argv[1:]
    commands: dict[str, Any] = {
        "run": run_command,
        "table": table_command,
        "plot": "bdl_bench.report.plots",  # a module whose main(args) is the command, imported on use
        "reproduce": reproduce_command,
        "data": "bdl_bench.data.data_cli",
        "status": "bdl_bench.orchestration.status",
        "list": list_command,
    }
    if command not in commands:
        raise SystemExit(f"bdl-bench: unknown command {command!r}; available: {', '.join(commands)}\n\n{USAGE}")
    target = commands[command]
    (importlib.import_module(target).main if isinstance(target, str) else target)(rest)


if __name__ == "__main__":
    main()
