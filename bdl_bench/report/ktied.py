"""k-tied Normal figures and tables from finished runs (Swiatkowski et al. 2020), the ``figures`` kinds
``std_spectra`` (Fig. 3), ``weight_samples`` (Table 2, Fig. 6 left) and ``step_records`` (Fig. 6 right, Fig. 7)
(``docs/reproducing.md``; the studies in :mod:`bdl_bench.studies.low_rank_std`). Agreement is the project's
rounding-aware two-SE rule (:data:`bdl_bench.report.paper.ROUNDING_RULE`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from matplotlib.figure import Figure

from bdl_bench.errors import ResultsError
from bdl_bench.report.paper import (
    KTIED_MODELS,
    WEAK_NOTE,
    PaperValue,
    any_weak,
    dataset_short_name,
    half_unit,
    ktied_column,
    read_paper_csv,
    verdict_cell,
)
from bdl_bench.report.plots import save_figure
from bdl_bench.report.tables import markdown, mean_se, run_configs
from bdl_bench.results import METRICS_FILE, atomic_write_text, flatten

PAPER_TABLES = {"table2": "ktied_table2_low_rank.csv", "fig6_left": "ktied_table3_training.csv"}
LABELS = {"mean_field": "mean-field", "1_tied": "1-tied", "2_tied": "2-tied", "3_tied": "3-tied"}
UNCERTAINTY_TABLE = "ktied_table3_resnet18.csv"  # Table 3: Brier (TFP's), NLL, ECE of ResNet-18's rank-k posteriors


def model_dataset(config: dict) -> tuple[str, str]:
    """``(model_dataset, title)`` of a run: the paper's key and name of its model on the run's data set
    (:data:`~bdl_bench.report.paper.KTIED_MODELS`), ``<dataset>_<model>`` for a model the paper has not."""
    dataset, model = dataset_short_name(str(config["data"]["name"])), str(config["model"]["name"])
    paper_model, key, title = KTIED_MODELS.get(dataset, (None, None, None))
    return (key, title) if model == paper_model else (f"{dataset}_{model}", f"{config['data']['name']} {model}")


def _runs(
    folder: Path, *, posterior: bool = False, methods: Sequence[str] = ("gmfvi", "ktied")
) -> list[tuple[Path, dict]]:
    """(folder, config) of the finished runs of ``methods`` below ``folder`` (with ``posterior.pt`` where asked)."""
    files = (METRICS_FILE, "posterior.pt") if posterior else (METRICS_FILE,)
    found = [(d, config) for d, config in run_configs(folder, *files) if config["method"]["name"] in methods]
    if not found:
        what = "with posterior.pt " if posterior else ""
        raise ResultsError(f"no finished {'/'.join(methods)} run {what}below {folder}")
    return found


def _paper(csv: str, model_dataset: str) -> dict[tuple[str, str], PaperValue]:
    """(column, metric) → the printed value with its SEM and rounding, for the rows of ``model_dataset``."""
    frame = read_paper_csv(csv, printed=True)
    out = {}
    for row in frame[frame["model_dataset"] == model_dataset].to_dict("records"):
        for metric in ("neg_elbo", "nll", "accuracy", "brier_tfp"):
            if f"{metric}_mean" in row:
                out[(row["method"], metric)] = PaperValue.printed(row[f"{metric}_mean"], row[f"{metric}_sem"])
        if "ece" in row:  # Table 3's ECE: the predictive mixture's, one number without SEM
            out[(row["method"], "ece")] = PaperValue(float(row["ece"]), None, half_unit(row["ece"]))
        if "num_params_k" in row:  # Fig. 6 left's parameter count, in thousands: Table 1's formulas on the MLP
            out[(row["method"], "num_params_k")] = PaperValue(float(row["num_params_k"]))
    return out


def _beside(row: dict, metric: str, paper: PaperValue | None) -> None:
    """Put the paper's ``metric`` (value, SE) beside ours in ``row``, and whether they agree (None where either
    is missing; a NaN standard error of ours counts as 0, :meth:`~bdl_bench.report.paper.PaperValue.band`)."""
    row[f"paper_{metric}"] = None if paper is None else paper.value
    row[f"paper_{metric}_se"] = None if paper is None else paper.se
    missing = paper is None or math.isnan(row[metric])
    row[f"agrees_{metric}"] = None if missing else abs(row[metric] - paper.value) <= paper.band(row[f"{metric}_se"])
    row[f"weak_{metric}"] = None if missing else row[f"agrees_{metric}"] and paper.weak(row[f"{metric}_se"])


def _weak_note(frame: pd.DataFrame) -> str:
    """:data:`~bdl_bench.report.paper.WEAK_NOTE` where a cell of ``frame`` agrees only weakly, else nothing."""
    return f" {WEAK_NOTE}." if any_weak(frame) else ""


def _compared(r: dict, metric: str, digits: int, paper_digits: int) -> list[str]:
    """Three cells of ``r``'s ``metric``: ours, the paper's (mean ± SE) and whether they agree."""
    return [
        mean_se(r[metric], r[f"{metric}_se"], digits),
        mean_se(r[f"paper_{metric}"], r[f"paper_{metric}_se"], paper_digits),
        verdict_cell(r[f"agrees_{metric}"], r.get(f"weak_{metric}")),
    ]


# ---------------------------------------------------------------------------------------------- Fig. 3
def std_spectra(folder: Path, out: Path, max_k: int = 10, conv: bool = False) -> tuple[Path, pd.DataFrame, str]:
    """Fig. 3 (``conv`` false: the dense layers and LSTM kernels) or Fig. 5 top (``conv``: the convolutions as
    well) from the first finished GMFVI run with a posterior: the PNG, the spectra's first three fractions per
    matrix and parameter, and that table as markdown."""
    from bdl_bench.studies.low_rank_std import MeanFieldNetwork, spectra

    run, config = _runs(folder, posterior=True, methods=("gmfvi",))[0]
    net, _, _ = MeanFieldNetwork.from_run(run, conv=conv)
    frame = spectra(net)
    png = _plot_spectra(frame, out, max_k=max_k)
    index = ["layer", "matrix", "shape", "parameter"]
    table = frame[frame["k"] <= 3].pivot_table(index=index, columns="k", values="fraction")
    table.columns = [f"k{k}" for k in table.columns]
    table = table.reset_index()
    table["top2"] = table["k1"] + table.get("k2", 0.0)
    dataset = dataset_short_name(str(config["data"]["name"]))
    table = table.assign(dataset=dataset, method=table["parameter"], n_runs=1)
    headers = ["weight", "shape", "posterior", "k = 1", "k = 2", "k = 3", "k <= 2"]
    rows = [  # "–" for a k beyond the matrix's number of singular values
        [str(r.matrix), str(r.shape), f"{r.parameter}s"]
        + [f"{getattr(r, c):.3f}" if not pd.isna(getattr(r, c, None)) else "–" for c in ("k1", "k2", "k3", "top2")]
        for r in table.itertuples()
    ]
    return png, table, markdown(headers, rows) + f"\n\nfraction of variance per singular value; run {run.name}"


def _plot_spectra(frame: pd.DataFrame, out: Path, max_k: int = 10) -> Path:
    """Bar charts of the explained variance per singular value (std vs mean), one panel per matrix (up to four
    panels a row)."""
    matrices = list(dict.fromkeys(frame["matrix"]))
    n_cols = min(len(matrices), 4)
    n_rows = math.ceil(len(matrices) / n_cols)
    fig = Figure(figsize=(3.2 * n_cols, 2.8 * n_rows))
    axes = fig.subplots(n_rows, n_cols, squeeze=False).ravel()
    for ax, matrix in zip(axes, matrices):
        part = frame[(frame["matrix"] == matrix) & (frame["k"] <= max_k)]
        for offset, parameter in ((-0.2, "mean"), (0.2, "std")):
            rows = part[part["parameter"] == parameter]
            ax.bar(rows["k"] + offset, rows["fraction"], width=0.4, label=f"posterior {parameter}s")
        ax.set_title(f"{matrix} ({part['shape'].iloc[0]})")
        ax.set_xlabel("singular value k")
        ax.set_ylim(0, 1)
    for ax in axes[len(matrices) :]:
        ax.set_axis_off()
    axes[0].set_ylabel("fraction of variance explained")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out)


# ---------------------------------------------------------------------------------------------- Fig. 4
def std_heatmaps(folder: Path, out: Path, matrix: str, ranks: Sequence[int]) -> tuple[Path, pd.DataFrame, str]:
    """Fig. 4 from the first finished GMFVI run with a posterior: heat maps of the std matrix ``matrix`` (a label
    of :func:`~bdl_bench.studies.low_rank_std.std_matrices`, ``dense 1``) and of its rank-k approximations, on one
    colour scale, with each approximation's relative Frobenius error ``||A - A_k|| / ||A||``."""
    from bdl_bench.studies.low_rank_std import MeanFieldNetwork, low_rank_nonnegative

    run, config = _runs(folder, posterior=True, methods=("gmfvi",))[0]
    net, _, _ = MeanFieldNetwork.from_run(run, conv=True)
    found = {m.label: std for m, std in zip(net.matrices, net.weight_stds())}
    if matrix not in found:
        raise ResultsError(f"std_heatmaps: the run's network has no matrix {matrix!r}; it has {', '.join(found)}")
    exact = found[matrix].detach().cpu().double()
    panels = [("no approximation", exact)] + [
        (f"rank-{k} approximation", low_rank_nonnegative(exact, k)) for k in ranks
    ]
    errors = [float(torch.linalg.matrix_norm(exact - a) / torch.linalg.matrix_norm(exact)) for _, a in panels]
    fig = Figure(figsize=(3.4 * len(panels), 3.2))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    low, high = float(exact.min()), float(exact.max())
    for ax, (title, values), error in zip(axes, panels, errors):
        image = ax.imshow(values.T.numpy(), aspect="auto", cmap="viridis", vmin=low, vmax=high)  # inputs down
        ax.set_title(f"{title}\nrelative error {error:.3f}", fontsize=9)
        ax.set_xlabel("output unit")
    axes[0].set_ylabel("input unit")
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="posterior std")
    png = save_figure(fig, out)
    dataset = dataset_short_name(str(config["data"]["name"]))
    table = pd.DataFrame(
        {
            "dataset": dataset,
            "method": [title for title, _ in panels],
            "rank": [0, *ranks],
            "relative_error": errors,
            "n_runs": 1,
        }
    )
    shape = f"{exact.shape[0]} x {exact.shape[1]}"
    cells = [[title, f"{error:.4f}"] for (title, _), error in zip(panels, errors)]
    text = markdown(["std matrix", "||A - A_k|| / ||A||"], cells)
    return png, table, text + f"\n\n{matrix} ({shape}) of run {run.name}; one colour scale"


# ---------------------------------------------------------------------------------------------- Table 2, Fig. 6 left
def n_variational_params(net: object, k: int | None) -> int:
    """Means plus std parameters: every parameter's mean, one std per parameter outside the network's studied
    matrices (biases, embeddings, untied convolutions), and per studied matrix ``mn`` (mean-field, ``k = None``)
    or ``k(m + n)`` (k-tied; Table 1 of the paper)."""
    total = 2 * int(net.mean.numel())  # type: ignore[attr-defined]
    for matrix in net.matrices:  # type: ignore[attr-defined]
        total += 0 if k is None else matrix.tied_size(k) - matrix.size
    return total


STUDY_FILE = "weight_samples.csv"  # a run's rows of weight_samples, kept beside its posterior.pt
COMPARED = (("neg_elbo", 3), ("nll", 3), ("accuracy", 1))  # Table 2 / Fig. 6 left: metric, the paper's decimals
UNCERTAINTY = (("brier_tfp", 3),)  # Table 3 (ResNet-18) adds this, and its ECE, which has no SE to judge by


def weight_samples(
    folder: Path, ranks: Sequence[int], paper: str, samples: int | None = None, seed: int = 0, conv: bool = False
) -> tuple[pd.DataFrame, str]:
    """Table 2 (``ranks`` [1, 2, 3], ``paper`` ``table2``), Fig. 5 bottom and Table 3 (the same with ``conv``, on
    ResNet-18) or Fig. 6 left (``ranks`` [], ``paper`` ``fig6_left``): one row per run and approximation;
    ``samples`` weight samples (default: the run's ``trainer.n_test_mc_samples``)."""
    rows, titles = [], set()
    methods = ("gmfvi",) if ranks else ("gmfvi", "ktied")
    for run, config in _runs(folder, methods=methods):
        key, title = model_dataset(config)
        titles.add(title)
        published = _paper(PAPER_TABLES[paper], key)
        if paper == "table2":
            published.update(_paper(UNCERTAINTY_TABLE, key))
        n = int(samples or config["trainer"]["n_test_mc_samples"])
        for row in _run_rows(run, config, list(ranks), n, seed, conv):
            for metric, _ in COMPARED + UNCERTAINTY:
                if metric in row and not pd.isna(row[metric]):
                    _beside(row, metric, published.get((row["column"], metric)))
            count, ece = published.get((row["column"], "num_params_k")), published.get((row["column"], "ece"))
            row["paper_n_variational_params_k"] = None if count is None else count.value
            row["paper_ece"] = None if ece is None else ece.value
            rows.append(row)
    frame = pd.DataFrame(rows).drop(columns=["column", "study"])
    order = {name: i for i, name in enumerate(LABELS)}
    frame = frame.sort_values(
        ["seed", "method"],
        key=lambda c: c.map(lambda v: order.get(v, len(order))) if c.name == "method" else c,
        kind="stable",
        ignore_index=True,
    )
    return frame, _weight_samples_markdown(frame, paper, " / ".join(sorted(titles)))


def _run_rows(run: Path, config: dict, ranks: list[int], n: int, seed: int, conv: bool) -> list[dict]:
    """``run``'s rows: the low-rank study of its posterior over ``n`` weight samples (generator seed ``seed``),
    also written to its ``weight_samples.csv``. A run whose ``posterior.pt`` was not kept (the committed pieces of a
    reproduction longer than one machine's session, ``docs/reproducing.md``) is read back from that file, which
    must be of the same ranks, ``n``, ``seed`` and ``conv``."""
    study_key = f"ranks {ranks}, {n} samples, seed {seed}" + (", conv" if conv else "")
    if not (run / "posterior.pt").exists():
        kept = pd.read_csv(run / STUDY_FILE).to_dict("records") if (run / STUDY_FILE).exists() else []
        if not kept or any(r["study"] != study_key for r in kept):
            raise ResultsError(f"{run} has no posterior.pt and no {STUDY_FILE} of {study_key}; re-run it")
        return kept
    from bdl_bench.studies.low_rank_std import MeanFieldNetwork, low_rank_study

    trained = ktied_column(flatten(config))
    # a k-tied run's tied matrices: its dense layers and LSTM kernels, and its convolutions with tie_conv
    tied_conv = conv if trained == "mean_field" else bool(config["method"].get("tie_conv", False))
    net, dataset, likelihood = MeanFieldNetwork.from_run(run, conv=tied_conv)
    study = low_rank_study(
        net, dataset, likelihood, ranks=ranks, n_samples=n, generator=torch.Generator().manual_seed(seed)
    )
    k = None if trained == "mean_field" else int(config["method"]["k"])
    rows = []
    for r in study.to_dict("records"):
        column = trained if r["rank"] == 0 else f"{int(r['rank'])}_tied"
        row = {
            "dataset": dataset_short_name(str(config["data"]["name"])),
            "method": column if r["rank"] == 0 else f"mean_field, rank-{int(r['rank'])} std",
            "column": column,
            "seed": int(config["trainer"]["seed"]),
            "n_runs": 1,
            "n_samples": n,
            "n_train": dataset.n_train,
            "n_variational_params": n_variational_params(net, k if r["rank"] == 0 else int(r["rank"])),
            "neg_elbo": r["test_neg_elbo_mean"],
            "neg_elbo_se": r["test_neg_elbo_sem"],
            "train_neg_elbo": r["neg_elbo_mean"],
            "nll": r["nll_mean"],
            "nll_se": r["nll_sem"],
            "accuracy": 100 * r["accuracy_mean"],
            "accuracy_se": 100 * r["accuracy_sem"],
            "ensemble_nll": r["ensemble_nll"],
            "ensemble_accuracy": 100 * r["ensemble_accuracy"],
            "ece": r["ensemble_ece"],
            "brier_tfp": r["brier_mean"] - 1,  # TensorFlow Probability's Brier score, the usual one minus 1
            "brier_tfp_se": r["brier_sem"],
            "study": study_key,
        }
        rows.append(row)
    atomic_write_text(run / STUDY_FILE, pd.DataFrame(rows).to_csv(index=False))
    return rows


def _weight_samples_markdown(frame: pd.DataFrame, paper: str, title: str) -> str:
    uncertainty = [m for m in UNCERTAINTY if f"paper_{m[0]}" in frame and frame[f"paper_{m[0]}"].notna().any()]
    headers = ["posterior", "seed", "# var. params [k] (ours)", "(paper)"]
    labels = {"neg_elbo": "-ELBO (test)", "nll": "NLL", "accuracy": "accuracy %", "brier_tfp": "Brier (TFP)"}
    for metric, _ in COMPARED + tuple(uncertainty):
        headers += [f"{labels[metric]} (ours)", f"{labels[metric]} (paper)", "agrees"]
    headers += ["-ELBO (train)", "mixture NLL", "mixture accuracy %", "ECE"] + (["ECE (paper)"] if uncertainty else [])
    rows = []
    for r in frame.to_dict("records"):
        paper_count = r["paper_n_variational_params_k"]
        cells = [str(r["method"]), str(r["seed"]), f"{r['n_variational_params'] / 1000:.0f}"]
        cells.append("–" if paper_count is None or pd.isna(paper_count) else f"{paper_count:.0f}")
        for metric, digits in COMPARED + tuple(uncertainty):
            cells += _compared(r, metric, digits + 1, digits)
        cells += [mean_se(r["train_neg_elbo"], None), mean_se(r["ensemble_nll"], None)]
        cells.append(mean_se(r["ensemble_accuracy"], None, 2))
        cells.append(mean_se(r["ece"], None, 4 if uncertainty else 3))
        rows.append(cells + ([mean_se(r.get("paper_ece"), None, 4)] if uncertainty else []))
    n = int(frame["n_samples"].iloc[0]) if len(frame) else 0
    n_train = frame["n_train"].iloc[0] if "n_train" in frame and len(frame) else 50000  # rows kept before n_train
    source = f"Table 2 ({title})" if paper == "table2" else f"Fig. 6 left ({title})"
    if uncertainty:
        source = f"Fig. 5 bottom and Table 3 ({title})"
    note = (
        f"\n\nPaper: {source}. Ours: mean ± SEM over {n} weight samples of each run (the paper's 100); -ELBO per "
        f"example, the test NLL plus KL / N (N = {int(n_train):,} training examples); the mixture columns score the "
        "predictive average of the samples. agrees: the rounding-aware two-SE rule stated under the runs' table."
    )
    if uncertainty:
        note += (
            " Brier (TFP): TensorFlow Probability's score, the usual Brier score minus 1, as the paper prints it; ECE"
            " (15 bins) of the mixture, beside the paper's, which gives no SEM to judge agreement by."
        )
    return markdown(headers, rows) + note + _weak_note(frame)


# ---------------------------------------------------------------------------------------------- Fig. 6 right, Fig. 7
def step_records(
    folder: Path, out: Path, steps: Sequence[int], snr_column: str = "grad_snr_l2"
) -> tuple[Path, pd.DataFrame, str]:
    """Fig. 6 right's table (mean ± SEM over seeds at ``steps``) and a PNG of the SNR and the validation -ELBO
    along training (Fig. 7's panel of the runs' model), from every run's ``steps.csv``. The paper's numbers (Fig. 6
    right) are the MNIST MLP's: runs of another model are printed without them."""
    records, models = [], set()
    for run, config in _runs(folder):
        if (run / "steps.csv").exists():
            frame = pd.read_csv(run / "steps.csv")
            models.add(model_dataset(config))
            records.append(frame.assign(column=ktied_column(flatten(config)), seed=int(config["trainer"]["seed"])))
    if len(models) > 1:
        raise ResultsError(f"step_records: the runs below {folder} train different models ({sorted(models)})")
    if not records:
        raise ResultsError(f"no run below {folder} has steps.csv (runs with method.record_every > 0)")
    every = pd.concat(records, ignore_index=True)
    median_column = snr_column.replace("grad_snr_", "grad_snr_median_", 1)  # a robust twin of the mean SNR
    for column in (snr_column, median_column):
        if column not in every.columns:
            every[column] = float("nan")
    ((key, title),) = models
    paper = read_paper_csv("ktied_fig6_right.csv", printed=True)
    if key != "mnist_mlp":
        paper = paper.iloc[:0]
    rows = []
    for (column, step), group in every[every["step"].isin(list(steps))].groupby(["column", "step"]):
        row: dict = {"dataset": key.split("_")[0], "method": column, "step": int(step), "n_runs": len(group)}
        match = paper[(paper["method"] == column) & (paper["step"].astype(int) == int(step))]
        for metric, source, paper_key in (("snr", snr_column, "snr"), ("val_neg_elbo", "val_neg_elbo", "neg_elbo")):
            values = group[source].astype(float)
            row[metric] = float(values.mean())
            row[f"{metric}_se"] = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
            value = None
            if len(match):
                value = PaperValue.printed(match.iloc[0][f"{paper_key}_mean"], match.iloc[0][f"{paper_key}_sem"])
            _beside(row, metric, value)
        row["snr_median"] = float(group[median_column].astype(float).mean())
        rows.append(row)
    if not rows:
        raise ResultsError(f"no run below {folder} recorded any of the steps {list(steps)}")
    table = pd.DataFrame(rows).sort_values(["step", "method"], ignore_index=True)
    png = _plot_steps(every, out, snr_column, paper, title)
    return png, table, _steps_markdown(table, snr_column)


def _steps_markdown(table: pd.DataFrame, snr_column: str) -> str:
    headers = ["step", "posterior", "runs", "SNR (ours)", "SNR (paper)", "agrees"]
    headers += ["median SNR (ours)", "val -ELBO (ours)", "val -ELBO (paper)", "agrees"]
    rows = []
    for r in table.to_dict("records"):
        cells = [str(r["step"]), LABELS.get(r["method"], r["method"]), str(r["n_runs"])]
        cells += [*_compared(r, "snr", 2, 2), mean_se(r["snr_median"], None, 2)]
        rows.append(cells + _compared(r, "val_neg_elbo", 3, 3))
    note = (
        f"\n\nSNR: {snr_column} of steps.csv, the mean over the layer's std parameters of E[g²]/Var[g] over the "
        "10 batches up to the step (the paper's footnote 3); median SNR: the median over those parameters instead "
        "(a parameter whose gradient hardly varies, e.g. one that only the KL term moves, has an SNR in the "
        "millions and can carry the mean alone; the median is not compared, the paper states the mean); val -ELBO: "
        "validation NLL per example over 10 weight samples plus the full KL / N. Ours and the paper's: mean ± SEM "
        "over the seeds; agrees: the rounding-aware two-SE rule stated under the runs' table."
    )
    return markdown(headers, rows) + note + _weak_note(table)


def _plot_steps(every: pd.DataFrame, out: Path, snr_column: str, paper: pd.DataFrame, title: str) -> Path:
    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    for i, column in enumerate(sorted(every["column"].unique(), key=list(LABELS).index)):
        colour = f"C{i}"
        mean = every[every["column"] == column].groupby("step")[["val_neg_elbo", snr_column]].mean()
        label = LABELS.get(column, column)
        axes[0].plot(mean.index, mean["val_neg_elbo"], ".-", color=colour, label=label)
        axes[1].plot(mean.index, mean[snr_column], ".-", color=colour, label=label)
        published = paper[paper["method"] == column]
        steps = published["step"].astype(int)
        axes[0].plot(steps, published["neg_elbo_mean"].astype(float), "x", color=colour, ms=8)
        axes[1].plot(steps, published["snr_mean"].astype(float), "x", color=colour, ms=8)
    marks = "; x = paper, Fig. 6" if len(paper) else ""
    axes[0].set(ylabel="validation -ELBO per example", title=f"Fig. 7 ({title}): validation -ELBO{marks}")
    axes[1].set(ylabel=f"gradient SNR ({snr_column.removeprefix('grad_snr_')})")
    layer = snr_column.removeprefix("grad_snr_l")
    axes[1].set(title=f"Fig. 6 right: SNR of layer {layer}'s std parameters" if layer.isdigit() else "gradient SNR")
    for ax in axes:
        ax.set(xlabel="training step", xscale="log", yscale="log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out)
