"""``bdl-bench table``: mean ± standard error over splits/seeds, grouped by dataset × method.

Standard errors use the real number of runs in each cell (sample std, ddof = 1, over √n). Beside a paper
table's value, ``within_2se_<metric>`` says whether ``|ours − paper| ≤ 2 √(se_ours² + (se_paper + h_se)²) + h``,
h and h_se being half a unit in the last printed digit of the paper's value and SE where the printed text is
known (:data:`~bdl_bench.report.paper.ROUNDING_RULE`), else 0. Where the paper chose hyperparameters on a
validation set, each column keeps the runs of its best setting (:func:`select_on_validation`). ``relative_to``
shows paired differences to one method's run on the same split and seed (``docs/reproducing.md``)."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from bdl_bench.errors import ConfigError, ResultsError
from bdl_bench.report.paper import PaperTable, PaperValue, Selection, dataset_short_name, get_paper_table
from bdl_bench.results import CONFIG_FILE, HASH_EXCLUDED_KEYS, find_run_dirs, load_runs, read_config

DEFAULT_METRICS = ("rmse", "test_ll", "test_ll_joint", "nll", "accuracy", "error", "ece", "brier", "elbo", "sym_kl")


@dataclass(frozen=True)
class Table:
    frame: pd.DataFrame  # one row per dataset × method
    markdown: str
    warnings: tuple[str, ...] = ()  # e.g. the runs of one row come from different devices


NOT_SETTINGS = (
    *HASH_EXCLUDED_KEYS,
    "data.split",
    "data.seed",
    "trainer.seed",
    "data.root",
    "data.mirror",
    "method.map_dir",
    "paper_table",
    "data.name",
    "method.name",
)
"""Config keys that never tell two settings apart: splits and seeds (what a row averages over), paths
and bookkeeping (what the config hash leaves out)."""


def run_configs(folder: Path, *files: str) -> list[tuple[Path, dict]]:
    """(run folder, its ``config.yaml``) of every run below ``folder`` that holds each of ``files``, in folder
    order: what the figures and computed tables read their runs with."""
    return [
        (d, read_config(d / CONFIG_FILE)) for d in find_run_dirs(folder) if all((d / name).exists() for name in files)
    ]


def setting_keys(runs: pd.DataFrame, ignore: Sequence[str] = ()) -> list[str]:
    """The config columns of ``runs`` that name a setting: all but :data:`NOT_SETTINGS`, ``ignore`` and
    the keys tuned per split (``search.params.*`` of a stacked search, the keys of its ``search.grids.<method>``),
    whose values differ from split to split by design."""
    columns = runs.attrs.get("config_columns") or [c for c in runs.columns if c.startswith(("method.", "data."))]
    tuned = {c.removeprefix("search.params.") for c in columns if c.startswith("search.params.")}
    # search.grids.<method>.<key>: a grid chosen per split (Gal & Ghahramani's dropout rate and tau)
    tuned |= {c.split(".", 3)[3] for c in columns if c.startswith("search.grids.") and c.count(".") >= 3}
    skip = (*NOT_SETTINGS, *ignore, *tuned)
    return [c for c in columns if c in runs.columns and not any(c == k or c.startswith(f"{k}.") for k in skip)]


def setting_labels(runs: pd.DataFrame, base: pd.Series, ignore: Sequence[str] = ()) -> pd.Series:
    """``base`` (a method or paper column per run) plus every setting key whose value differs among the
    runs of one dataset with that base (``laplace structure=kfac``), so that no row averages over
    different settings; a key some runs lack (an option added since) does not count as differing."""
    keys = setting_keys(runs, ignore)
    labels = base.astype(str).copy()
    dataset = runs["data.name"].astype(str) if "data.name" in runs.columns else pd.Series("", index=runs.index)
    for (_, name), group in runs.groupby([dataset, labels], sort=False):
        values = {c: _with_nulls(group, c) for c in keys}
        varying = [c for c in keys if _differs(values[c], nested=c.startswith("method.") and c.count(".") >= 2)]
        for idx in group.index:
            parts = [f"{c.removeprefix('method.')}={_plain(values[c][idx])}" for c in varying]
            labels[idx] = " ".join([str(name), *parts])
    return labels


def _with_nulls(group: pd.DataFrame, key: str) -> pd.Series:
    """``group[key]`` with the runs whose config sets ``key`` to null reading ``"null"`` (a setting of its own,
    e.g. DEF at full rank, ``method.rank: null``, beside ``method.rank: 1``) instead of missing."""
    values = group[key]
    if "config_nulls" not in group.columns:
        return values
    is_null = group["config_nulls"].map(lambda nulls: isinstance(nulls, tuple) and key in nulls)
    return values.astype(object).mask(is_null, "null") if is_null.any() else values


def _differs(values: pd.Series, *, nested: bool) -> bool:
    """Whether a setting's values differ among runs. A top-level option that some runs lack was added since
    they ran: it does not count. Inside a mapping-valued option (``method.search.marglik.noise``) a run that
    lacks the key gave that mapping other keys: missing is a value of its own there."""
    if nested:
        return values.map(lambda v: "\0missing" if pd.isna(v) else str(v)).nunique() > 1
    return values.dropna().astype(str).nunique() > 1


def _plain(value: object) -> object:
    """``16.0`` → ``16`` (pandas turns an integer option into floats when other methods lack it); a key a
    run's mapping-valued option lacks reads ``default``."""
    if isinstance(value, float) and math.isnan(value):
        return "default"
    return int(value) if isinstance(value, float) and value.is_integer() else value


def mean_se(mean: Any, se: Any, digits: int = 3) -> str:
    """``1.234 ± 0.010``; the mean alone without a standard error, ``–`` without a mean (None, NaN or pandas' NA)."""
    if mean is None or pd.isna(mean):
        return "–"
    if se is None or pd.isna(se):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table of ``headers`` and the cells of ``rows``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def select_on_validation(runs: pd.DataFrame, selection: Selection) -> tuple[pd.DataFrame, dict[tuple, str]]:
    """Per (dataset, method), keep the runs of the hyperparameter setting with the best mean validation metric.

    A setting is one combination of the values of ``selection.keys`` (keys absent from all runs of a column
    are ignored there: SLANG's ``method.decay`` is not BBB's); its score is the mean of ``selection.metric``
    over its runs (splits, seeds). Test metrics never enter the choice. Returns the kept runs and, per (dataset, method), the chosen setting
    (``"prior_precision=1, method.lr=0.1 (val_error 0.019; 3 settings)"``)."""
    if selection.mode not in ("min", "max"):
        raise ConfigError(f"selection mode must be 'min' or 'max', got {selection.mode!r}")
    kept, chosen = [], {}
    for (dataset, method), group in runs.groupby(["dataset", "method"], sort=True):
        keys = [k for k in selection.keys if k in group.columns and group[k].notna().any()]  # this column's keys
        settings = group[keys].map(str).agg(", ".join, axis=1) if keys else pd.Series("", index=group.index)
        first = group.loc[settings.index[0], keys] if keys else []
        if settings.nunique() == 1:  # nothing to choose between
            kept.append(group)
            chosen[(dataset, method)] = _describe_setting(keys, first) + " (the only setting run)"
            continue
        scores = pd.to_numeric(group[selection.metric], errors="coerce") if selection.metric in group else None
        means = scores.groupby(settings).mean().dropna() if scores is not None else pd.Series(dtype=float)
        if means.empty:
            raise ResultsError(
                f"the paper chose hyperparameters on {selection.metric!r}, but no run of {method} on {dataset} "
                f"reports it; re-run with a validation split (e.g. data.n_val) or keep one setting per column"
            )
        best = means.idxmin() if selection.mode == "min" else means.idxmax()
        winners = group[settings == best]
        kept.append(winners)
        setting = _describe_setting(keys, winners[keys].iloc[0])
        chosen[(dataset, method)] = f"{setting} ({selection.metric} {means[best]:.4g}; {len(means)} settings)"
    return pd.concat(kept), chosen


def _describe_setting(keys: Sequence[str], values: Sequence[object]) -> str:
    return ", ".join(f"{k}={_plain(v)}" for k, v in zip(keys, values)) or "default"


_PAIR_KEYS = ("data.split", "data.seed", "trainer.seed")  # what makes two runs of one dataset a pair


def paired_differences(runs: pd.DataFrame, metrics: Sequence[str], reference: str) -> pd.DataFrame:
    """``runs`` with each metric replaced by its difference to the ``reference`` method's run of the same
    dataset, split and seeds; runs without such a partner are left out."""
    if not (runs["method"] == reference).any():
        found = ", ".join(sorted(runs["method"].astype(str).unique()))
        raise ResultsError(f"no runs of method {reference!r} to take differences to; the methods here are: {found}")
    keys = ["dataset", *[k for k in _PAIR_KEYS if k in runs.columns]]
    base = runs[runs["method"] == reference]
    if base.duplicated(keys).any():
        raise ResultsError(
            f"method {reference!r} has several runs with the same {keys}: pass a folder with one setting"
        )
    values = runs[list(metrics)].apply(pd.to_numeric, errors="coerce")
    partner = runs[keys].merge(base[keys + list(metrics)], on=keys, how="left")[list(metrics)]
    partner = partner.apply(pd.to_numeric, errors="coerce").set_index(runs.index)
    paired = partner.notna().any(axis=1)
    return runs.assign(**{m: values[m] - partner[m] for m in metrics})[paired]


def build_table(
    folder: Path,
    *,
    paper: str | None = None,
    metrics: Sequence[str] | None = None,
    relative_to: str | None = None,
    strict: bool = False,
    run_dirs: Collection[Path] | None = None,
) -> Table:
    """Summarise every finished run below ``folder`` against the ``paper`` table (default: the runs'
    ``paper_table`` key). ``metrics``: default those of the paper table that the runs have, else every known key
    present; ``relative_to``: a method label to show differences to (module docstring); ``strict``: refuse an
    unreadable ``metrics.json``/``config.yaml`` instead of skipping it with a warning; ``run_dirs``: only these
    runs (a reproduction's own, not the other pieces that share its folder)."""
    runs = load_runs(folder, strict=strict)
    if run_dirs is not None and not runs.empty:
        runs = runs[runs["run_dir"].isin({str(Path(d)) for d in run_dirs})]
    if runs.empty:
        raise ResultsError(f"no finished runs (folders with metrics.json) below {folder}")
    if paper is None and "paper_table" in runs.columns:
        names = runs["paper_table"].dropna().unique()
        paper = str(names[0]) if len(names) == 1 else None
    spec: PaperTable | None = get_paper_table(paper) if paper else None
    if metrics is None:  # the paper table's metrics that the runs have (older runs may lack newer ones)
        metrics = [m for m in spec.metrics if m in runs.columns] if spec else []
        metrics = metrics or [m for m in DEFAULT_METRICS if m in runs.columns]
    missing = [m for m in metrics if m not in runs.columns]
    if missing:
        raise ResultsError(f"metric(s) {missing} not found in the runs below {folder}")

    columns = pd.Series(
        [spec.column(r) for r in runs.to_dict("records")] if spec else runs["method.name"], index=runs.index
    )
    selected = spec.selection.keys if spec and spec.selection else ()
    runs = runs.assign(
        dataset=runs["data.name"].map(dataset_short_name),
        method=setting_labels(runs, columns, ignore=selected),
        paper_column=columns,
    )
    chosen: dict[tuple, str] = {}
    if spec and spec.selection:
        runs, chosen = select_on_validation(runs, spec.selection)
    if relative_to is not None:
        runs = paired_differences(runs, metrics, relative_to)
    rows, warnings = [], []
    for (dataset, method), group in sorted(
        runs.groupby(["dataset", "method"]), key=lambda item: tuple(map(natural_key, item[0]))
    ):
        row: dict[str, object] = {"dataset": dataset, "method": method, "n_runs": len(group)}
        devices = sorted(group["device"].dropna().unique()) if "device" in group else []
        if len(devices) > 1:
            warnings.append(f"{dataset} / {method}: its runs come from different devices ({', '.join(devices)})")
        if chosen:
            row["chosen_on_validation"] = chosen.get((dataset, method), "")
        for metric in metrics:
            values = pd.to_numeric(group[metric], errors="coerce").dropna()
            n = len(values)
            mean = float(values.mean()) if n else math.nan
            se = float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
            if spec and metric in spec.metrics:
                paper_metric, sign = spec.metrics[metric]
                scale = spec.scale(str(dataset), paper_metric)
                mean, se = sign * mean / scale, se / scale
                ref = spec.lookup(str(dataset), str(group["paper_column"].iloc[0]), paper_metric)
                if relative_to is not None and ref is not None:
                    base = spec.lookup(str(dataset), relative_to, paper_metric)
                    ref = (
                        PaperValue(ref.value - base.value, rounding=ref.rounding + base.rounding)
                        if base is not None
                        else None
                    )
                row[paper_metric] = mean
                row[f"{paper_metric}_se"] = se
                row[f"paper_{paper_metric}"] = ref.value if ref else math.nan
                row[f"paper_{paper_metric}_se"] = ref.se if ref and ref.se is not None else math.nan
                if ref is not None and not math.isnan(mean):
                    row[f"paper_{paper_metric}_rounding"] = ref.rounding
                    row[f"within_2se_{paper_metric}"] = abs(mean - ref.value) <= ref.band(se)
                    row[f"weak_{paper_metric}"] = ref.weak(se)
            else:
                row[metric] = mean
                row[f"{metric}_se"] = se
        rows.append(row)
    frame = pd.DataFrame(rows)
    markdown = _markdown(frame, spec, metrics, digits=3 if relative_to is None else 4)  # differences are small
    if relative_to is not None:
        markdown = f"Differences to {relative_to} on the same split (paired standard errors)\n\n{markdown}"
    return Table(frame=frame, markdown=markdown, warnings=tuple(warnings))


def natural_key(label: object) -> tuple:
    """Sort key that orders numbers inside a label by value: ``slang_L2`` before ``slang_L16``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(label)))


def _markdown(frame: pd.DataFrame, spec: PaperTable | None, metrics: Sequence[str], digits: int = 3) -> str:
    compared = {m: spec.metrics[m][0] for m in metrics if spec and m in spec.metrics}  # metric -> paper's name
    chosen = "chosen_on_validation" in frame.columns
    headers = ["dataset", "method", "n"]
    for metric in metrics:
        headers += [f"{compared[metric]} (ours)", f"{compared[metric]} (paper)"] if metric in compared else [metric]
    body = []
    for _, row in frame.iterrows():
        cells = [str(row["dataset"]), str(row["method"]), str(row["n_runs"])]
        for metric in metrics:
            key = compared.get(metric, metric)
            cells.append(mean_se(row[key], row[f"{key}_se"], digits))
            if metric in compared:
                cells.append(mean_se(row[f"paper_{key}"], row[f"paper_{key}_se"], digits))
        if chosen:
            cells.append(str(row["chosen_on_validation"]))
        body.append(cells)
    if chosen:
        headers.append("chosen on validation")
    title = f"Paper table: {spec.name}\n\n" if spec else ""
    remarks = "".join(f"\n\nOn the paper's numbers: {r}." for r in spec.remarks) if spec else ""
    return title + markdown(headers, body) + remarks
