"""``bdl-bench reproduce <experiment>``: run (or resume) a paper experiment's sweep (tuned where
``conf/tune/<experiment>.yaml`` exists) as Hydra sweeps, and compare with the paper in ``reproduce.md`` and
``reproduce.csv``; an experiment with a ``benchmark:`` block times training steps instead
(:mod:`bdl_bench.orchestration.benchmark`). ``docs/reproducing.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from bdl_bench.errors import ConfigError
from bdl_bench.orchestration.hydra_app import (
    CONF_DIR,
    debugging,
    group_choices,
    hydra_error_line,
    load_config,
    override_dirname,
    run_hydra,
)
from bdl_bench.orchestration.search import apply_searched
from bdl_bench.orchestration.sweep import summarise, version_warnings
from bdl_bench.report.figures import Drawn, draw_figures
from bdl_bench.report.paper import ROUNDING_RULE, WEAK_NOTE, any_weak, is_set, verdict_cell, weakly
from bdl_bench.report.tables import markdown as markdown_table
from bdl_bench.report.tables import mean_se
from bdl_bench.resolvers import run_name
from bdl_bench.results import (
    COST_METRICS,
    METRICS_FILE,
    atomic_write_text,
    code_version,
    config_hash,
    find_run_dirs,
    read_failure,
    stored_config_hash,
)

QUICK_SPLITS = 2
QUICK_EPOCHS = 3
QUICK_SEARCH = {"n_random": 2, "n_guided": 2, "round_size": 2}  # --quick: 4 trials per split, in 2 rounds
QUICK_TRIALS = QUICK_SEARCH["n_random"] + QUICK_SEARCH["n_guided"]


@dataclass(frozen=True)
class Plan:
    """What ``reproduce`` runs: the test jobs (overrides each), grouped into one Hydra sweep per dataset."""

    experiment: str
    config: DictConfig  # the experiment's composed config, Hydra node included
    fixed: list[str]  # overrides of every job (experiment=…, the user's single values, --quick settings)
    launcher: list[str]  # the user's hydra/… and hydra.… overrides (launcher choice and settings)
    keys: list[str]  # the swept keys, in order
    jobs: list[list[str]]  # per job: "key=value" for every swept key
    sweep_dir: Path
    tuned: bool = False  # every job searches its splits' values first (tune=<experiment>)
    stack_splits: bool = False  # the experiment sweeps data.split=all: the runs of a dataset are stacked

    def job_folder(self, job: Sequence[str]) -> str:
        return run_name(override_dirname([*self.fixed, *job], self.config.hydra.job.config.override_dirname))


def _expand(key: str, value: str) -> list[str]:
    """The values of one sweep entry (``range(20)``, ``a,b``, ``glob(slang_table1/*)``) as strings.

    ``glob()`` over a config group matches nested options too (``slang_table1/*``), which Hydra's own
    expansion does not list.
    """
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        (override,) = parser.parse_overrides([f"{key}={value}"])  # (this sets the loader that glob() needs)
        if isinstance(override.value(), Glob) and (CONF_DIR / key).is_dir():
            return override.value().filter(group_choices(key))
        if override.is_sweep_override():
            return [str(v) for v in override.sweep_string_iterator()]
        return [override.get_value_element_as_str()]


def _n_splits(data_name: str) -> int | None:
    path = CONF_DIR / "data" / f"{data_name}.yaml"
    protocol = (yaml.safe_load(path.read_text()) or {}).get("protocol", {}) if path.exists() else {}
    return protocol.get("n_splits")


def make_plan(experiment: str, overrides: Sequence[str], *, quick: bool, tune: bool) -> Plan:
    """Compose the experiment with ``overrides`` and expand its sweep into jobs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    available = group_choices("experiment")
    if experiment not in available:
        raise SystemExit(f"bdl-bench reproduce: unknown experiment {experiment!r}; available: {', '.join(available)}")
    launcher = [o for o in overrides if o.startswith(("hydra/", "hydra."))]
    task = [o for o in overrides if o not in launcher]
    quick_fixed = [f"experiment_name={experiment}_quick", f"trainer.n_epochs={QUICK_EPOCHS}"] if quick else []
    config = load_config([f"experiment={experiment}", *quick_fixed, *task, *launcher])
    params: dict[str, str] = {str(k): str(v) for k, v in (config.hydra.sweeper.get("params") or {}).items()}
    fixed = [f"experiment={experiment}", *quick_fixed]
    for parsed, text in zip(OverridesParser.create().parse_overrides(task), task):
        key = parsed.get_key_element()
        if key in params or parsed.is_sweep_override():
            params[key] = text.split("=", 1)[1]
        else:
            fixed.append(text)
    values = {key: _expand(key, value) for key, value in params.items()}
    if quick and "data.split" in values:
        values["data.split"] = values["data.split"][:QUICK_SPLITS]
    keys = list(values)
    jobs, dropped = [], set()
    for combo in itertools.product(*(values[k] for k in keys)):
        job = dict(zip(keys, combo))
        n_splits = _n_splits(job.get("data", str(config.data.name)))
        if job.get("data.split") == "all":  # every split of the dataset, one job each in the plan
            if n_splits is None:
                raise SystemExit(f"bdl-bench reproduce: data.split=all, but {job.get('data')} has no protocol.n_splits")
            for split in range(min(n_splits, QUICK_SPLITS) if quick else n_splits):
                jobs.append([f"{k}={split if k == 'data.split' else v}" for k, v in job.items()])
            continue
        if "data.split" in job and n_splits is not None and int(job["data.split"]) >= n_splits:
            dropped.add(job.get("data", str(config.data.name)))
            continue
        jobs.append([f"{k}={v}" for k, v in job.items()])
    for name in sorted(dropped):
        print(f"note: {name} has {_n_splits(name)} splits; its higher split numbers are left out")
    if not jobs:
        raise SystemExit(f"bdl-bench reproduce: the sweep of {experiment} {dict(params)} expands to no run")
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    tuned = tune and (CONF_DIR / "tune" / f"{experiment}.yaml").exists()
    if tuned:  # every job searches its own splits (bdl_bench.orchestration.search)
        fixed.append(f"tune={experiment}")
        fixed += [f"search.{k}={v}" for k, v in QUICK_SEARCH.items()] if quick else []
    stack = values.get("data.split") == ["all"]
    return Plan(experiment, config, fixed, launcher, keys, jobs, sweep_dir, tuned=tuned, stack_splits=stack)


def _launcher_overrides(plan: Plan, jobs: int) -> list[str]:
    if any(o.startswith("hydra/launcher") for o in plan.launcher):
        return plan.launcher
    try:
        import hydra_plugins.hydra_joblib_launcher  # noqa: F401
    except ImportError:
        print("note: jobs run one after another; `pip install -e '.[cluster]'` runs them in parallel (joblib)")
        return plan.launcher
    return ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}", *plan.launcher]


def run_tests(plan: Plan, launcher: list[str], *, force: bool) -> None:
    """The plan's jobs as Hydra sweeps (:func:`run_sweeps`). With the experiment's ``shared_map`` (``from``: the
    variant whose run trains the MAP; ``to``: the post-hoc variants that would train the same MAP), the ``to``
    jobs run last, each on its ``from`` run's MAP (``method.map_dir``), so the MAP is trained once."""
    shared = plan.config.get("shared_map")
    if not shared or "variant" not in plan.keys:
        run_sweeps(plan, launcher, force=force)
        return
    targets = {f"variant={v}" for v in shared["to"]}
    by_map: dict[tuple[str, ...], list[list[str]]] = {}  # the job training the MAP -> the jobs fitted on it
    for job in plan.jobs:
        if targets & set(job):
            map_job = tuple(f"variant={shared['from']}" if o.startswith("variant=") else o for o in job)
            by_map.setdefault(map_job, []).append(job)
    fitted = [job for jobs in by_map.values() for job in jobs]
    first = [job for job in plan.jobs if job not in fitted]
    first += [list(job) for job in by_map if list(job) not in first]
    run_sweeps(dataclasses.replace(plan, jobs=first), launcher, force=force)
    for map_job, jobs in by_map.items():
        map_dir = plan.sweep_dir / plan.job_folder(map_job)
        if not (map_dir / METRICS_FILE).exists():
            print(f"note: {map_dir} has not finished, so its {len(jobs)} post-hoc job(s) wait for it", flush=True)
            continue
        fixed = [*plan.fixed, f"method.map_dir='{map_dir}'"]
        run_sweeps(dataclasses.replace(plan, jobs=jobs, fixed=fixed), launcher, force=force)


def run_sweeps(plan: Plan, launcher: list[str], *, force: bool) -> None:
    """The plan's jobs as Hydra sweeps (skipping finished runs, resuming killed ones): one per group of
    datasets whose other sweep values are the same, so that the launcher's workers share all their jobs."""
    by_data: dict[str, list[list[str]]] = {}
    for job in plan.jobs:
        by_data.setdefault(next((o for o in job if o.startswith("data=")), ""), []).append(job)
    sweeps: dict[str, dict[str, list[str]]] = {}  # datasets with the same values of every other key share a sweep
    for group in by_data.values():
        values = {
            k: list(dict.fromkeys(o.split("=", 1)[1] for o in (j[i] for j in group))) for i, k in enumerate(plan.keys)
        }
        if plan.stack_splits:  # one stacked job per method (bdl_bench.orchestration.stacked)
            values["data.split"] = [f"[{','.join(values['data.split'])}]"]
        others = repr({k: v for k, v in values.items() if k != "data"})
        if others in sweeps and "data" in values:
            sweeps[others]["data"] += values["data"]
        else:
            sweeps[others] = values
    for values in sweeps.values():
        data = f"data={','.join(values['data'])}" if "data" in values else ""
        n_jobs = len(list(itertools.product(*values.values())))
        sweep = [f"{k}={','.join(v)}" for k, v in values.items()]
        print(f"[runs] {data or plan.experiment}: {n_jobs} jobs → {plan.sweep_dir}", flush=True)
        error = run_hydra(["-m", *plan.fixed, *sweep, *launcher, *(["force=true"] if force else [])])
        if error is not None:  # e.g. an override that one variant's config lacks: no run folder says why
            print(
                f"bdl-bench reproduce: the sweep {' '.join(sweep)} stopped: {error.code}", file=sys.stderr, flush=True
            )


def foreign_runs(plan: Plan, expected: set[Path]) -> list[tuple[Path, str]]:
    """Finished runs below the results folder that this sweep did not run and its config does not
    reproduce (a different config version), with the reason."""
    found = []
    for run_dir in find_run_dirs(plan.sweep_dir):
        if run_dir in expected or not (run_dir / METRICS_FILE).exists():
            continue
        stored = run_dir / ".hydra" / "overrides.yaml"
        if not stored.exists():
            found.append((run_dir, "no .hydra/overrides.yaml to check it against"))
            continue
        overrides = list(yaml.safe_load(stored.read_text()) or [])
        try:
            cfg = apply_searched(load_config(overrides, multirun=False), run_dir)
            with open_dict(cfg):
                del cfg["hydra"]  # what a job's config.yaml holds: the resolved config without its Hydra node
            current = config_hash(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
        except Exception as error:  # noqa: BLE001 - any failure to recompose means it cannot be vouched for
            found.append((run_dir, f"its overrides no longer compose ({type(error).__name__}: {error})"))
            continue
        if current != stored_config_hash(run_dir):
            found.append(
                (run_dir, f"config hash {stored_config_hash(run_dir)}, today's config of its overrides {current}")
            )
    return found


def _allowed_difference(tolerance: float | str, paper: pd.Series) -> pd.Series | float:
    """The largest |ours − paper| a tolerance allows: a number as it is, ``"2%"`` relative to |paper|."""
    text = str(tolerance).strip()
    try:
        if text.endswith("%"):
            return paper.abs() * float(text[:-1]) / 100.0
        return float(text)
    except ValueError:
        raise ConfigError(f"tolerance {tolerance!r}: give a number (absolute) or a percentage such as '2%'") from None


def agreement(frame: pd.DataFrame, tolerance: Mapping[str, float | str] | None) -> pd.DataFrame:
    """Add ``agrees_<metric>`` per paper metric: ``|ours − paper| ≤ tolerance[metric] + h`` (a number, or a
    percentage of |paper| such as ``"2%"``; h half a unit in the paper value's last printed digit, where
    known) where the experiment states one, else build_table's ``within_2se_<metric>`` (the rounding-aware
    two-SE band, :data:`~bdl_bench.report.paper.ROUNDING_RULE`); empty where the paper has no value."""
    frame = frame.copy()
    tolerance = dict(tolerance or {})
    for column in [c for c in frame.columns if c.startswith("paper_") and not c.endswith(("_se", "_rounding"))]:
        metric = column.removeprefix("paper_")
        ours, paper = frame[metric], frame[column]
        unknown = pd.Series([None] * len(frame), index=frame.index)
        if metric in tolerance:
            rounding = frame[f"paper_{metric}_rounding"].fillna(0.0) if f"paper_{metric}_rounding" in frame else 0.0
            band = _allowed_difference(tolerance[metric], paper) + rounding
            verdict = (ours - paper).abs() <= band
            per_row = pd.DataFrame({"band": band, "paper": paper, "h": rounding}, index=frame.index)
            weak = [weakly(r.band, r.paper, r.h) for r in per_row.itertuples()]
        else:
            verdict = frame.get(f"within_2se_{metric}", unknown)
            weak = frame.get(f"weak_{metric}", unknown)
        missing = [pd.isna(p) or pd.isna(o) for o, p in zip(ours, paper)]
        frame[f"agrees_{metric}"] = [None if m else bool(v) for m, v in zip(missing, verdict)]
        frame[f"weak_{metric}"] = [None if m else bool(v) and is_set(w) for m, v, w in zip(missing, verdict, weak)]
    return frame


def check_tolerance(tolerance: Mapping[str, Any] | None, paper: str | None) -> None:
    """Refuse an experiment ``tolerance`` keyed by a name the paper table does not print (such a key was
    silently ignored, and the two-SE rule applied instead of the stated criterion)."""
    if not tolerance:
        return
    from bdl_bench.report.paper import get_paper_table

    names = sorted(name for name, _ in get_paper_table(paper).metrics.values()) if paper else []
    unknown = sorted(set(tolerance) - set(names))
    if unknown:
        raise ConfigError(
            f"tolerance: {', '.join(unknown)} is not a metric of the paper table {paper!r}; "
            f"key it by one of {', '.join(names) or '(none: the experiment has no paper_table)'}"
        )


def markdown(frame: pd.DataFrame, tolerance: Mapping[str, float | str] | None, digits: int = 3) -> str:
    """The table with, per paper metric, ours, the paper's and whether they agree."""
    metrics = [c.removeprefix("agrees_") for c in frame.columns if c.startswith("agrees_")]
    if not metrics:
        metrics = [c for c in frame.columns if f"{c}_se" in frame.columns]
    headers = ["dataset", "method", "n"]
    for m in metrics:
        headers += [f"{m} (ours)", f"{m} (paper)", f"{m} agrees"] if f"agrees_{m}" in frame else [m]
    rows = []
    for _, row in frame.iterrows():
        cells = [str(row["dataset"]), str(row["method"]), str(row["n_runs"])]
        for m in metrics:
            cells.append(mean_se(row[m], row.get(f"{m}_se"), digits))
            if f"agrees_{m}" in frame:
                verdict, paper = row[f"agrees_{m}"], mean_se(row[f"paper_{m}"], row.get(f"paper_{m}_se"), digits)
                cells += [paper, verdict_cell(verdict, row.get(f"weak_{m}"))]
        rows.append(cells)
    table = markdown_table(headers, rows)
    if not any(c.startswith("agrees_") for c in frame.columns):
        return table + "\n\nThe paper prints no numbers for this artefact: no agreement column."
    rule = ROUNDING_RULE
    if tolerance:
        stated = ", ".join(
            f"{m}: |ours − paper| ≤ {t}" + (" of |paper|" if str(t).strip().endswith("%") else "") + " + h"
            for m, t in tolerance.items()
        )
        rule += f"; {stated} (the experiment's tolerance)"
    return f"{table}\n\n{rule}" + (f". {WEAK_NOTE}" if any_weak(frame) else "")


def agreement_line(frame: pd.DataFrame) -> str | None:
    """``"N of M cells agree with the paper."`` over the frame's ``agrees_<metric>`` cells, with how many of the
    N agree only weakly (:data:`~bdl_bench.report.paper.WEAK_NOTE`); None where it has no such cell."""
    total = agree = weak = 0
    for column in (c for c in frame.columns if c.startswith("agrees_")):
        flags = frame.get(column.replace("agrees_", "weak_", 1), pd.Series(False, index=frame.index))
        for verdict, flag in zip(frame[column], flags):
            if verdict is None or pd.isna(verdict):
                continue
            total += 1
            agree += bool(verdict)
            weak += bool(verdict) and is_set(flag)
    if not total:
        return None
    tail = f" ({weak} of them weakly: a 0 would have agreed too)" if weak else ""
    return f"{agree} of {total} cells agree with the paper{tail}."


def figure_table(drawn: Drawn) -> str:
    """A ``table: true`` figure's numbers for ``reproduce.md``, with its ``criterion`` (how agreement with the
    paper's figure is judged: the paper prints no numbers for it)."""
    criterion = " ".join(str(drawn.spec.get("criterion") or "").split())
    text = f"{drawn.name} (the figure's numbers):\n\n{drawn.table_markdown}"
    return text + (f"\n\nAgreement with the paper: {criterion}" if criterion else "")


def provenance(args: Sequence[str], wall_s: float) -> dict[str, str]:
    """Where a table came from, for the header of ``reproduce.md``/``.csv`` (the CSV's as ``# `` lines, read
    with ``pandas.read_csv(path, comment="#")``): the command, the code version, the date, the wall time of this
    invocation and the machine."""
    import torch

    now = datetime.datetime.now(datetime.timezone.utc)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    # the load average when the table was written: a loaded machine stretches the wall times, not the CPU times
    load = f"; load average {os.getloadavg()[1]:.1f} over the last 5 min" if hasattr(os, "getloadavg") else ""
    return {
        "command": shlex.join(["bdl-bench", "reproduce", *args]),
        "code": code_version(),
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "wall time": f"{wall_s:.0f} s (this invocation, its figures included; runs reused from an earlier one not)",
        "machine": f"{_default_jobs()} usable CPU cores, {gpu}{load}",
    }


def finished_line(jobs: Sequence[Sequence[str]], done: Sequence[bool]) -> str:
    """How many of the sweep's ``jobs`` (their overrides; ``done`` says which finished) the table holds and, when
    not all, which are missing: one entry per setting of the swept keys other than the split, with the count of its
    missing splits, so that a table made from part of a sweep says exactly which part."""
    n_done = sum(done)
    line = f"{n_done} of {len(jobs)} runs"
    if n_done == len(jobs):
        return line
    whole = _whole_values_missing(jobs, done)
    if whole:
        return f"{line}; not in this table: {whole}"
    missing: dict[str, int] = {}
    for job, finished in zip(jobs, done):
        if not finished:
            setting = ",".join(o for o in job if not o.startswith("data.split=")) or "the single setting"
            missing[setting] = missing.get(setting, 0) + 1
    entries = [f"{setting} ({count} run{'s' * (count > 1)})" for setting, count in missing.items()]
    return f"{line}; not in this table: " + "; ".join(entries)


def _whole_values_missing(jobs: Sequence[Sequence[str]], done: Sequence[bool]) -> str | None:
    """``"trainer.seed=2, 3, ... (72 runs)"`` where the missing jobs are exactly those with some values of one swept
    key (other than the split), e.g. the seeds a piece of a sweep has not run yet; else None."""
    missing = [job for job, finished in zip(jobs, done) if not finished]
    for position, override in enumerate(jobs[0]):
        key = override.split("=", 1)[0]
        if key == "data.split" or any(len(job) <= position or not job[position].startswith(f"{key}=") for job in jobs):
            continue
        values = list(dict.fromkeys(job[position].split("=", 1)[1] for job in missing))
        if len(values) < 2:
            continue
        with_values = [job for job in jobs if job[position].split("=", 1)[1] in values]
        if with_values == missing:
            return f"{key}={', '.join(values)} ({len(missing)} runs)"
    return None


def _finished_runs(line: str | None) -> int | None:
    """The count of a header's ``finished`` line (``"4 of 7 runs; ..."`` → 4), ``None`` without one."""
    head = (line or "").split(" of ", 1)[0].strip().strip("`")
    return int(head) if head.isdigit() else None


def write_report(folder: Path, title: str, header: Mapping[str, str], text: str, frame: pd.DataFrame) -> Path | None:
    """``reproduce.md`` (``title``, the ``header`` lines, ``text``) and ``reproduce.csv`` (``header`` as ``# ``
    lines, then ``frame``) in ``folder``. An existing ``reproduce.md`` that holds more finished runs than this one
    (written by the whole sweep, this one by a piece restricted to some of its settings) is first kept as
    ``reproduce.previous.md`` / ``.csv``, whose path is returned."""
    kept = None
    if (folder / "reproduce.md").exists():
        lines = (folder / "reproduce.md").read_text().splitlines()
        before = _finished_runs(next((x.removeprefix("finished: ") for x in lines if x.startswith("finished: ")), None))
        after = _finished_runs(header.get("finished"))
        if before is not None and after is not None and before > after:
            for suffix in (".md", ".csv"):
                if (folder / f"reproduce{suffix}").exists():
                    (folder / f"reproduce{suffix}").replace(folder / f"reproduce.previous{suffix}")
            kept = folder / "reproduce.previous.md"
    md_header = "\n".join(f"{key}: `{value}`  " for key, value in header.items())
    atomic_write_text(folder / "reproduce.md", f"{title}\n\n{md_header}\n\n{text}\n")
    csv_header = "".join(f"# {key}: {value}\n" for key, value in header.items())
    atomic_write_text(folder / "reproduce.csv", csv_header + frame.to_csv(index=False))
    return kept


def cost_table(folder: Path, paper: str | None, run_dirs: Sequence[Path]) -> str:
    """The cost of each row's runs (``run_dirs``, mean ± SE): training wall and CPU time and peak resident memory,
    as each run's ``metrics.json`` records them; the columns older runs lack are left out."""
    from bdl_bench.report.tables import build_table
    from bdl_bench.results import load_runs

    runs = load_runs(folder)
    runs = runs[runs["run_dir"].isin({str(d) for d in run_dirs})] if not runs.empty else runs
    metrics = [m for m in COST_METRICS if m in runs.columns and runs[m].notna().any()]
    if not metrics:
        return ""
    table = build_table(folder, paper=paper, metrics=metrics, run_dirs=run_dirs).markdown.split("\n\n", 1)[-1]
    return f"\n\nCost per run (training wall and CPU seconds, peak resident memory in MiB):\n\n{table}"


def _default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def benchmark_experiment(experiment: str) -> bool:
    """Whether ``conf/experiment/<experiment>.yaml`` has a ``benchmark:`` block (it times training steps)."""
    path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    return path.exists() and "benchmark" in (yaml.safe_load(path.read_text()) or {})


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="bdl-bench reproduce",
        description="Run (or resume) a paper experiment's sweep, tuning included where the paper tuned, "
        "then print the table with the paper's numbers beside ours.",
        epilog="example: bdl-bench reproduce slang_table2 method=bbb,dropout data=uci/boston --jobs 2",
    )
    parser.add_argument("experiment", help=f"one of: {', '.join(group_choices('experiment'))}")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides for every run (key=values replace the experiment's sweep)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke check: {QUICK_SPLITS} splits, {QUICK_EPOCHS} epochs, {QUICK_TRIALS} search trials per split, "
        "into <experiment>_quick",
    )
    parser.add_argument(
        "--no-tune", action="store_true", help="skip the hyperparameter search (use the configs' fixed values)"
    )
    parser.add_argument(
        "--force", action="store_true", help="re-run finished runs (a finished search is replayed from its journal)"
    )
    parser.add_argument(
        "--no-run",
        action="store_true",
        help="train nothing: write the table from the runs that have finished (its header names those left out)",
    )
    parser.add_argument("--jobs", type=int, default=_default_jobs(), help="parallel jobs (default: the usable cores)")
    ns = parser.parse_intermixed_args(args)
    if benchmark_experiment(ns.experiment):
        if ns.no_run:
            raise SystemExit(
                f"bdl-bench reproduce: {ns.experiment} is a benchmark, with no runs to table; drop --no-run"
            )
        from bdl_bench.orchestration.benchmark import run_benchmark

        quick = [f"experiment_name={ns.experiment}_quick"] if ns.quick else []
        config = load_config([f"experiment={ns.experiment}", *quick, *ns.overrides], multirun=False)
        run_benchmark(ns.experiment, config, args, quick=ns.quick)
        return
    started = time.perf_counter()
    from hydra.errors import HydraException

    try:
        plan = make_plan(ns.experiment, ns.overrides, quick=ns.quick, tune=not ns.no_tune)
    except HydraException as error:  # an override the experiment's config lacks, a bad value: one line
        if debugging():
            raise
        raise SystemExit(hydra_error_line(error)) from None
    launcher = _launcher_overrides(plan, ns.jobs)
    print(
        f"{plan.experiment}: {len(plan.jobs)} runs over {', '.join(plan.keys)}"
        + (f"; each job searches its splits' values first (tune={plan.experiment})" if plan.tuned else ""),
        flush=True,
    )
    if not ns.no_run:
        run_tests(plan, launcher, force=ns.force)

    expected = [plan.sweep_dir / plan.job_folder(job) for job in plan.jobs]
    summary = summarise(plan.sweep_dir, run_dirs=[d for d in expected if d.exists()])
    missing = [d for d in expected if not d.exists()]
    print(summary.render(plan.sweep_dir, ran=not ns.no_run))
    conflicts = [
        (d, (read_failure(d) or {}).get("message", ""))
        for d, _ in summary.failed
        if (read_failure(d) or {}).get("error_type") == "ConfigVersionError"
    ]
    conflicts += foreign_runs(plan, set(expected))
    if conflicts:
        lines = "\n".join(f"  {d}: {why}" for d, why in conflicts[:10])
        raise SystemExit(
            f"bdl-bench reproduce: {plan.sweep_dir} holds {len(conflicts)} run(s) of another config version, "
            f"so no table is made from it:\n{lines}\nRe-run with --force to replace them, move them away, "
            "or pass results_root=<new folder>."
        )
    warnings = version_warnings(plan.sweep_dir)  # also in the header: a table resumed across code versions says so
    for warning in warnings:
        print(f"warning: {warning}")
    from bdl_bench.report.tables import build_table

    done = [(d / METRICS_FILE).exists() for d in expected]
    if not any(done):
        raise SystemExit(f"bdl-bench reproduce: no run of this sweep finished below {plan.sweep_dir}; no table")
    tolerance = OmegaConf.to_container(plan.config.tolerance) if plan.config.get("tolerance") else None
    paper = str(plan.config.paper_table) if plan.config.get("paper_table") else None
    check_tolerance(tolerance, paper)
    relative_to = plan.config.get("relative_to")  # the paper's gaps to one column, paired by split
    table = build_table(plan.sweep_dir, paper=paper, run_dirs=expected, relative_to=relative_to)
    frame = agreement(table.frame, tolerance)  # type: ignore[arg-type]
    text = markdown(frame, tolerance, digits=3 if relative_to is None else 4)  # type: ignore[arg-type]
    if relative_to is not None:
        text = (
            f"Each column as its difference to {relative_to} on the same split (paired standard errors), beside the "
            f"same difference of the paper's printed values.\n\n{text}"
        )
    title = f"# {plan.experiment}" + (" (--quick: not the paper's protocol)" if ns.quick else "")
    if plan.config.get("protocol"):  # the experiment's own words on what it ran, where that is not the paper's
        text = f"Protocol: {plan.config.protocol}\n\n{text}"  # a folded YAML scalar (>-): one line
    text += cost_table(plan.sweep_dir, paper, expected)
    specs = OmegaConf.to_container(plan.config.figures) if plan.config.get("figures") else []
    figures, skipped = draw_figures(specs, plan.sweep_dir)  # type: ignore[arg-type]
    # after the figures: their numbers (e.g. k-tied's weight-sample studies) can take minutes
    header = provenance(args, time.perf_counter() - started) | ({"runs": "; ".join(warnings)} if warnings else {})
    header["finished"] = finished_line(plan.jobs, done)
    own = [d for d in figures if d.is_table]
    if own:  # the figures' numbers are the table; the runs' metrics follow as what they were computed from
        text = "\n\n".join(figure_table(d) for d in own) + f"\n\nThe runs the figure is computed from:\n\n{text}"
        frame = pd.concat([d.table.assign(figure=d.name) for d in own], ignore_index=True)  # type: ignore[union-attr]
    text += "".join(f"\n\n{figure_table(d)}" for d in figures if not d.is_table and d.table_markdown)
    text += "".join(f"\n\n![{d.name}]({d.png.name})" for d in figures if d.png is not None)
    text += "".join(f"\n\nFigure not drawn: {why}" for why in skipped)
    line = agreement_line(frame)
    if line:
        header["agreement"] = line
    kept = write_report(plan.sweep_dir, title, header, text, frame)
    print(f"\n{title}\n\n{text}\n")
    if kept is not None:
        print(f"note: the earlier reproduce.md held more finished runs than this table; kept as {kept}")
    if line:
        print(line)
    print(
        f"(Markdown: {plan.sweep_dir / 'reproduce.md'}; CSV: {plan.sweep_dir / 'reproduce.csv'}; "
        f"{time.perf_counter() - started:.0f} s)"
    )
    if summary.failed or (not ns.no_run and (summary.unfinished or summary.elsewhere or missing)):
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
