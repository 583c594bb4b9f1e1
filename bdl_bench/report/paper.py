"""Published numbers (``paper_numbers/*.csv``, transcribed from the papers) and how runs map onto them.

A :class:`PaperTable` knows which CSV holds a table, which of our metric keys match which paper
rows/columns, and which paper column a run belongs to (from its flattened config)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import pandas as pd

from bdl_bench.errors import ResultsError
from bdl_bench.results import read_csv_exact


def read_paper_csv(name: str, *, printed: bool = False) -> pd.DataFrame:
    """One of the transcribed CSVs shipped in ``bdl_bench/report/paper_numbers``: each number the printed value's
    nearest float (before pandas 3.1, not always), or with ``printed`` every cell as the printed text (``"0.00"``
    keeps its two decimals)."""
    with resources.files("bdl_bench.report").joinpath("paper_numbers", name).open() as f:
        return pd.read_csv(f, dtype=str, keep_default_na=False) if printed else read_csv_exact(f)


def half_unit(printed: str) -> float:
    """Half a unit in the last printed digit: ``"0.08"`` → 0.005, ``"4.6"`` → 0.05, ``"12"`` → 0.5."""
    mantissa, _, exponent = printed.strip().lower().partition("e")
    decimals = len(mantissa.split(".", 1)[1]) if "." in mantissa else 0
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


ROUNDING_RULE = (
    "agrees: |ours − paper| ≤ 2·√(se_ours² + (se_paper + h_se)²) + h, where h and h_se are half a unit in the "
    "last printed digit of the paper's value and of its standard error (0.005 for two decimals: a printed "
    "0.08 stands for [0.075, 0.085], a printed SE 0.00 for at most 0.005)"
)
WEAK_NOTE = (
    "yes (weak): the band is at least as wide as the paper's value (which is not 0 within its rounding), so a 0 "
    "would have agreed too; the cell says little beyond 'same order at most'"
)


def is_set(flag: Any) -> bool:
    """Whether a table's flag cell is true: False for a false, None or NaN one."""
    return flag is not None and not pd.isna(flag) and bool(flag)


def any_weak(frame: pd.DataFrame) -> bool:
    """Whether some ``weak_<metric>`` cell of ``frame`` is set (:data:`WEAK_NOTE`)."""
    return any(is_set(v) for c in frame.columns if c.startswith("weak_") for v in frame[c])


def verdict_cell(agrees: bool | None, weak: bool | None = False) -> str:
    """A table's agreement cell: ``–`` (no paper value), ``NO``, ``yes`` or ``yes (weak)`` (:data:`WEAK_NOTE`)."""
    if agrees is None or pd.isna(agrees):
        return "–"
    return ("yes (weak)" if is_set(weak) else "yes") if agrees else "NO"


def weakly(band: float, paper: float, rounding: float) -> bool:
    """Whether an agreement within ``band`` of ``paper`` is weak (:data:`WEAK_NOTE`): the paper's value differs
    from 0 by more than its ``rounding``, yet 0 lies within the band."""
    return abs(paper) > rounding and band >= abs(paper)


def dataset_short_name(data_name: str) -> str:
    """``uci/boston`` → ``boston``."""
    return data_name.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class PaperValue:
    """A published number; ``rounding``/``se_rounding``: half a unit in the last printed digit of the value
    and of its standard error (0 where the printed text is not known)."""

    value: float
    se: float | None = None
    rounding: float = 0.0
    se_rounding: float = 0.0

    @classmethod
    def printed(cls, value: str, se: str) -> PaperValue:
        """The value and standard error as printed (``"0.08"``), with their rounding."""
        return cls(float(value), float(se), half_unit(value), half_unit(se))

    def band(self, se_ours: float) -> float:
        """The largest ``|ours − value|`` that agrees (:data:`ROUNDING_RULE`); NaN standard errors count as 0."""
        se_paper = self.se + self.se_rounding if self.se is not None else 0.0
        spread = sum(x**2 for x in (se_ours, se_paper) if not math.isnan(x))
        return 2 * math.sqrt(spread) + self.rounding

    def weak(self, se_ours: float) -> bool:
        """Whether agreeing with this value at ``se_ours`` says little: a 0 would agree too (:data:`WEAK_NOTE`)."""
        return weakly(self.band(se_ours), self.value, self.rounding)


@dataclass(frozen=True)
class Selection:
    """Hyperparameters the paper chose per column: the searched config ``keys`` whose runs have the best
    (``mode``: ``min`` or ``max``) mean of the validation ``metric`` over splits/seeds."""

    metric: str
    keys: tuple[str, ...]
    mode: str = "min"


@dataclass(frozen=True)
class PaperTable:
    """A published table and how our runs line up with it.

    ``metrics`` maps our metric key to (paper metric name, sign), the paper value being ``sign × ours``;
    ``column`` maps a run (flattened config) to the paper's method column; ``lookup`` (dataset, column, paper
    metric) gives the published value or ``None``; ``scale`` (dataset, paper metric) is the factor in the paper's
    row header ("KL (×10⁴)"), ours being shown divided by it; ``remarks``, printed under the table, say where a
    published number is a typo or inconsistent, with the evidence."""

    name: str
    metrics: Mapping[str, tuple[str, float]]
    column: Callable[[Mapping[str, Any]], str]
    lookup: Callable[[str, str, str], PaperValue | None]
    scale: Callable[[str, str], float] = lambda dataset, metric: 1.0
    selection: Selection | None = None
    remarks: tuple[str, ...] = ()


def _slang_table2() -> PaperTable:
    frame = read_paper_csv("slang_table2_uci.csv", printed=True).set_index(["dataset", "method"])

    def lookup(dataset: str, column: str, metric: str) -> PaperValue | None:
        if (dataset, column) not in frame.index:
            return None
        if metric == "test_ll_joint":  # the SLANG authors' definition, used for their SLANG and BBB columns
            if column not in ("slang", "bbb"):
                return None
            metric = "test_ll"
        row = frame.loc[(dataset, column)]
        return PaperValue.printed(row[f"{metric}_mean"], row[f"{metric}_se"])

    return PaperTable(
        name="slang_table2",
        # test_ll is the usual per-point predictive mixture; the SLANG authors' code (their SLANG and BBB
        # columns) averages whole-test-set likelihoods over samples (paper_numbers/README.md), which is
        # our test_ll_joint: both are put beside the paper's value (the dropout column is Gal's: test_ll)
        metrics={"rmse": ("rmse", 1.0), "test_ll": ("test_ll", 1.0), "test_ll_joint": ("test_ll_joint", 1.0)},
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


def _grid_lookup(frame: pd.DataFrame) -> Callable[[str, str, str], PaperValue | None]:
    """The lookup of a table printed as one row per (dataset, metric) and one column per method (no SEs), from
    its cells as printed (``read_paper_csv(..., printed=True)``), so that each value carries its rounding."""

    def lookup(dataset: str, column: str, metric: str) -> PaperValue | None:
        if (dataset, metric) not in frame.index or column not in frame.columns:
            return None
        printed = str(frame.loc[(dataset, metric), column]).strip()
        return PaperValue(float(printed), rounding=half_unit(printed)) if printed else None

    return lookup


def _slang_table1() -> PaperTable:
    frame = read_paper_csv("slang_table1_logreg.csv", printed=True).set_index(["dataset", "metric"])

    def scale(dataset: str, metric: str) -> float:
        return float(frame.loc[(dataset, metric), "scale"]) if (dataset, metric) in frame.index else 1.0

    return PaperTable(
        name="slang_table1",
        metrics={
            # the authors' ELBO leaves out the bias's log prior precision (evaluation.elbo_without_bias_logdet)
            "elbo_no_bias_logdet": ("neg_elbo_per_example", -1.0),
            "nll": ("test_nll", 1.0),
            # our sym_kl is KL(p||q) + KL(q||p); the authors' table averages the two
            # (make_paper_tables_1_7.m: KLs(s) = (KL(vi_exact, method) + KL(method, vi_exact)) / 2)
            "sym_kl": ("sym_kl_vs_full_exact", 0.5),
        },
        column=_table1_column,
        lookup=_grid_lookup(frame),
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
        # performance on the validation set"; the authors' code searched the learning rate's decay exponent.
        selection=Selection(metric="val_error", keys=("prior_precision", "method.lr", "method.decay")),
    )


def _def_table1_column(run: Mapping[str, Any]) -> str:
    """DEF Table 1's method column of a run: ``nn`` (MAP), the Laplace ``structure``, ``mc_dropout``,
    ``ensemble15`` (``ensemble<M>``: only M = 15 has a published value)."""
    name = str(run["method.name"])
    if name == "map":
        return "nn"
    if name == "laplace":
        return str(run["method.structure"])
    if name == "dropout":
        return "mc_dropout"
    if name == "ensemble":
        return f"ensemble{_plain_int(run['method.n_members'])}"
    return name


def _plain_int(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _def_table1() -> PaperTable:
    """DEF Laplace Table 1 (Lee et al. 2020): accuracy, ECE and the normalised predictive entropy on the
    out-of-distribution set (mean and its spread over the OOD images) of a MNIST LeNet (OOD: notMNIST) and a
    CIFAR-10 CNN (OOD: SVHN). The paper gives one number per cell, no standard error."""
    frame = read_paper_csv("def_table1_classification.csv", printed=True).set_index(["in_domain", "metric"])
    return PaperTable(
        name="def_table1",
        metrics={
            "accuracy": ("accuracy", 1.0),
            "ece": ("ece", 1.0),
            "ood_entropy_mean": ("ood_entropy_mean", 1.0),
            "ood_entropy_std": ("ood_entropy_std", 1.0),
        },
        column=_def_table1_column,
        lookup=_grid_lookup(frame),
        remarks=(
            "the paper's MNIST NN ECE of 0.395 cannot be right: an overconfident network (a softmax network trained"
            " by cross-entropy, whose confidence is at or above its accuracy in every bin) has ECE ≤ 1 − accuracy ="
            " 0.007 at its printed accuracy of 99.3 %, and 0.395 would need a mean confidence near 0.6; every other"
            " MNIST column is 0.0069–0.0635",
        ),
    )


# the k-tied paper's four models (Sec. 2.2), one per data set: data set -> (model, its tables' key, title)
KTIED_MODELS = {
    "mnist": ("mlp", "mnist_mlp", "MNIST MLP"),
    "cifar100": ("cnn_ktied", "cifar100_cnn", "CIFAR-100 CNN"),
    "imdb": ("lstm", "imdb_lstm", "IMDB LSTM"),
    "cifar10": ("resnet18", "cifar10_resnet18", "CIFAR-10 ResNet-18"),
}


def ktied_column(run: Mapping[str, Any]) -> str:
    """k-tied Fig. 6 left's column: ``mean_field`` (``gmfvi``) or ``<k>_tied`` (``ktied``, ``method.k``)."""
    name = str(run["method.name"])
    if name == "gmfvi":
        return "mean_field"
    if name == "ktied":
        return f"{_plain_int(run['method.k'])}_tied"
    return name


def _ktied_fig6() -> PaperTable:
    """k-tied Normal Fig. 6 left (Swiatkowski et al. 2020; ``ktied_table3_training.csv``): negative ELBO, NLL and
    accuracy (in percent) after ~300 epochs, mean and SEM over 100 weight samples. The paper's ELBO is on the test
    set, ours (``elbo``, per example) on the training set: the KL / N term is the same, the expected
    log-likelihood is that of the training data; and our ``nll`` is the predictive mixture's, the paper's the mean
    over weight samples. ``bdl-bench reproduce ktied_fig6`` computes the paper's definitions as well
    (:mod:`bdl_bench.report.ktied`)."""
    frame = read_paper_csv("ktied_table3_training.csv").set_index(["model_dataset", "method"])
    columns = {"neg_elbo": "neg_elbo", "nll": "nll", "accuracy_percent": "accuracy"}

    def lookup(dataset: str, column: str, metric: str) -> PaperValue | None:
        key = (KTIED_MODELS[dataset][1] if dataset in KTIED_MODELS else dataset, column)
        if key not in frame.index or metric not in columns:
            return None
        row = frame.loc[key]
        return PaperValue(float(row[f"{columns[metric]}_mean"]), float(row[f"{columns[metric]}_sem"]))

    return PaperTable(
        name="ktied_fig6",
        metrics={"elbo": ("neg_elbo", -1.0), "nll": ("nll", 1.0), "accuracy": ("accuracy_percent", 1.0)},
        column=ktied_column,
        lookup=lookup,
        # our accuracy is a fraction; the paper prints percent
        scale=lambda dataset, metric: 0.01 if metric == "accuracy_percent" else 1.0,
    )


PAPER_TABLES: dict[str, Callable[[], PaperTable]] = {
    "def_table1": _def_table1,
    "ktied_fig6": _ktied_fig6,
    "slang_table1": _slang_table1,
    "slang_table2": _slang_table2,
    "slang_table3": _slang_table3,
}


def get_paper_table(name: str) -> PaperTable:
    if name not in PAPER_TABLES:
        raise ResultsError(f"unknown paper table {name!r}; available: {', '.join(sorted(PAPER_TABLES))}")
    return PAPER_TABLES[name]()
