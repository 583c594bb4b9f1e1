"""Published numbers (``paper_numbers/*.csv``, transcribed from the papers) and how runs map onto them.

A :class:`PaperTable` knows which CSV holds a table, which of our metric keys match which paper
rows/columns, and which paper column a run belongs to (from its flattened config).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import pandas as pd


def read_paper_csv(name: str) -> pd.DataFrame:
    """One of the transcribed CSVs shipped in ``bdl_bench/report/paper_numbers``."""
    with resources.files("bdl_bench.report").joinpath("paper_numbers", name).open() as f:
        return pd.read_csv(f)


def dataset_short_name(data_name: str) -> str:
    """``uci/boston`` → ``boston``."""
    return data_name.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class PaperValue:
    value: float
    se: float | None = None


@dataclass(frozen=True)
class Selection:
    """Hyperparameters the paper chose per column on a validation metric.

    Attributes:
        metric: the validation metric in ``metrics.json`` (``val_error``).
        keys: the config keys that were searched (``prior_precision``, ``method.lr``).
        mode: ``"min"`` or ``"max"``: which mean over splits/seeds wins.
    """

    metric: str
    keys: tuple[str, ...]
    mode: str = "min"


@dataclass(frozen=True)
class PaperTable:
    """A published table and how our runs line up with it.

    Attributes:
        name: the experiment's ``paper_table`` key.
        metrics: our metric key → (paper metric name, sign) where the paper value is ``sign × ours``.
        column: maps a run (flattened config) to the paper's method column name.
        lookup: (dataset, column, paper metric) → published value, or ``None`` where the paper has none.
        scale: (dataset, paper metric) → the factor in the paper's row header ("KL (×10⁴)"): the
            printed value is KL / scale, so ours is shown divided by it.
        selection: where the paper chose hyperparameters on a validation set: each column keeps the
            runs of its best setting only (``bdl_bench.report.tables.select_on_validation``).
    """

    name: str
    metrics: Mapping[str, tuple[str, float]]
    column: Callable[[Mapping[str, Any]], str]
    lookup: Callable[[str, str, str], PaperValue | None]
    scale: Callable[[str, str], float] = lambda dataset, metric: 1.0
    selection: Selection | None = None


def _slang_table2() -> PaperTable:
    frame = read_paper_csv("slang_table2_uci.csv").set_index(["dataset", "method"])

    def lookup(dataset: str, column: str, metric: str) -> PaperValue | None:
        if (dataset, column) not in frame.index:
            return None
        row = frame.loc[(dataset, column)]
        return PaperValue(float(row[f"{metric}_mean"]), float(row[f"{metric}_se"]))

    return PaperTable(
        name="slang_table2",
        metrics={"rmse": ("rmse", 1.0), "test_ll": ("test_ll", 1.0)},
        column=lambda run: str(run["method.name"]),
        lookup=lookup,
    )


def _table1_column(run: Mapping[str, Any]) -> str:
    name = run["method.name"]
    if name == "slang":
        return f"slang_L{int(run['method.rank'])}"
    family = "mf" if run.get("method.covariance") == "diag" else "full"
    if name == "vogn":
        return f"{family}_{'hess' if run['method.curvature'] == 'hessian' else 'ef'}"
    if name == "exact_vi":
        return f"{family}_exact"
    return str(name)


def _slang_table1() -> PaperTable:
    frame = read_paper_csv("slang_table1_logreg.csv").set_index(["dataset", "metric"])

    def lookup(dataset: str, column: str, metric: str) -> PaperValue | None:
        if (dataset, metric) not in frame.index or column not in frame.columns:
            return None
        return PaperValue(float(frame.loc[(dataset, metric), column]))

    def scale(dataset: str, metric: str) -> float:
        return float(frame.loc[(dataset, metric), "scale"]) if (dataset, metric) in frame.index else 1.0

    return PaperTable(
        name="slang_table1",
        metrics={
            "elbo": ("neg_elbo_per_example", -1.0),
            "nll": ("test_nll", 1.0),
            "sym_kl": ("sym_kl_vs_full_exact", 1.0),
        },
        column=_table1_column,
        lookup=lookup,
        scale=scale,
    )


def _slang_table3() -> PaperTable:
    frame = read_paper_csv("slang_table3_mnist.csv")
    published = {
        ("bbb" if r.method == "bbb" else f"slang_L{int(r.L)}"): float(r.test_error_percent) for r in frame.itertuples()
    }

    def lookup(dataset: str, column: str, metric: str) -> PaperValue | None:
        if dataset != "mnist" or metric != "test_error_percent" or column not in published:
            return None
        return PaperValue(published[column])

    return PaperTable(
        name="slang_table3",
        metrics={"error": ("test_error_percent", 1.0)},
        column=_table1_column,
        lookup=lookup,
        scale=lambda dataset, metric: 0.01,  # our error is a fraction; the paper prints percent
        # Sec. 4.3: "For each value of L, we choose the prior precision and learning rate based on
        # performance on the validation set."
        selection=Selection(metric="val_error", keys=("prior_precision", "method.lr")),
    )


PAPER_TABLES: dict[str, Callable[[], PaperTable]] = {
    "slang_table1": _slang_table1,
    "slang_table2": _slang_table2,
    "slang_table3": _slang_table3,
}


def get_paper_table(name: str) -> PaperTable:
    if name not in PAPER_TABLES:
        raise ValueError(f"unknown paper table {name!r}; available: {', '.join(sorted(PAPER_TABLES))}")
    return PAPER_TABLES[name]()
