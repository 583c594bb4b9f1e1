"""``bdl-bench plot``: figures drawn from run folders only.

- ``kind=convergence`` (SLANG Fig. 4): negative ELBO per example and test NLL against epoch, one
  row per dataset, one line per method (mean over the runs of that cell), from ``history.csv``.
- ``kind=ood``: reliability diagram and predictive-entropy histograms of the test and OOD sets
  (DEF Fig. 6), from the ``uncertainty.npz`` that runs with an OOD set write.
- ``kind=covariance`` (SLANG Fig. 1): heat maps of the posterior correlation (off-diagonal) of each
  method on one dataset and split, from ``posterior.pt``, plus the marginal standard deviations."""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import pandas as pd
import torch
from matplotlib.figure import Figure

from bdl_bench.errors import ResultsError
from bdl_bench.gaussians import FullGaussian
from bdl_bench.gaussians.io import load_gaussian
from bdl_bench.report.paper import dataset_short_name, get_paper_table
from bdl_bench.report.tables import natural_key, setting_labels
from bdl_bench.results import HISTORY_FILE, load_runs


def save_figure(fig: Figure, out: Path) -> Path:
    """``fig`` as a PNG at 120 dpi in ``out`` (its folder made); every figure of the package is a
    :class:`~matplotlib.figure.Figure` of its own, so no pyplot state or backend is involved."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def labelled_runs(folder: Path) -> pd.DataFrame:
    """The finished runs below ``folder`` (:func:`~bdl_bench.results.load_runs`) with ``dataset`` (short name) and
    ``label`` (the paper table's column, else the settings that tell the runs apart)."""
    runs = load_runs(folder)
    if runs.empty:
        raise ResultsError(f"no finished runs (folders with metrics.json) below {folder}")
    paper = runs["paper_table"].dropna().unique() if "paper_table" in runs.columns else []
    if len(paper) == 1:
        spec = get_paper_table(str(paper[0]))
        labels = [spec.column(r) for r in runs.to_dict("records")]
    else:
        labels = list(setting_labels(runs, runs["method.name"]))
    return runs.assign(dataset=runs["data.name"].map(dataset_short_name), label=labels)


_LOG_EPOCHS_FROM = 100  # runs this long get a logarithmic epoch axis (10,000-epoch runs converge in the first 1 %)


TEST_LOSSES = {"nll": "test NLL", "nll_joint": "test log-loss, joint over the test set"}


def plot_convergence(
    folder: Path, out: Path, methods: list[str] | None = None, split: int | None = None, test_loss: str = "nll"
) -> Path:
    """Fig. 4: −ELBO/N and a test loss against epoch, averaged over the runs of each dataset × method (or of one
    ``split``: :func:`convergence_figure`), saved to ``out``."""
    return save_figure(convergence_figure(folder, methods, split, test_loss), out)


def convergence_figure(
    folder: Path, methods: list[str] | None = None, split: int | None = None, test_loss: str = "nll"
) -> Figure:
    """The figure of :func:`plot_convergence`: one row per dataset, one line per method; the epoch axis is
    logarithmic once the runs reach 100 epochs (as in the paper's Fig. 4, where the methods separate early). A
    run's history is its ``history.csv``, or ``history.csv.gz`` where that was kept instead (a committed piece).
    ``test_loss``: ``nll``, the mean per-point predictive NLL, or ``nll_joint``, −(1/N) log (1/S) Σ_s Π_i p(y_i | θ_s)
    (:func:`~bdl_bench.metrics.joint_test_ll`), what the SLANG authors plot for their BNNs (Fig. 4 right)."""
    if test_loss not in TEST_LOSSES:
        raise ValueError(f"test_loss {test_loss!r}: choose one of {', '.join(TEST_LOSSES)}")
    runs = labelled_runs(folder)
    if split is not None:
        runs = runs[runs["data.split"] == split]
    if methods and not runs["label"].isin(methods).any():
        found = ", ".join(sorted(runs["label"].astype(str).unique()))
        raise ResultsError(f"none of the methods {methods} has runs below {folder}; found: {found}")
    if methods:
        runs = runs[runs["label"].isin(methods)]
    datasets = sorted(runs["dataset"].unique())
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = sorted(runs["label"].unique(), key=natural_key)  # slang rank=8 before rank=16
    colors = {label: palette[i % len(palette)] for i, label in enumerate(labels)}
    fig = Figure(figsize=(10, 3.2 * len(datasets)))
    axes = fig.subplots(len(datasets), 2, squeeze=False)
    for row, dataset in enumerate(datasets):
        last_epoch = 0
        for label, group in sorted(runs[runs["dataset"] == dataset].groupby("label"), key=lambda g: natural_key(g[0])):
            paths = [Path(d) / HISTORY_FILE for d in group["run_dir"]]
            histories = [pd.read_csv(p if p.exists() else p.with_name(f"{HISTORY_FILE}.gz")) for p in paths]
            history = pd.concat(histories).groupby("epoch").mean(numeric_only=True)
            last_epoch = max(last_epoch, int(history.index.max()))
            if "train/elbo" in history:
                axes[row, 0].plot(history.index, -history["train/elbo"], label=label, color=colors[label])
            column = "test/nll" if test_loss == "nll" else "test/test_ll_joint"
            if column in history:
                loss = history[column].dropna() * (1 if test_loss == "nll" else -1)
                axes[row, 1].plot(loss.index, loss, label=label, color=colors[label])
        xscale = "log" if last_epoch >= _LOG_EPOCHS_FROM else "linear"
        axes[row, 0].set(title=f"{dataset}: negative ELBO per example", xlabel="epoch", yscale="log", xscale=xscale)
        axes[row, 1].set(title=f"{dataset}: {TEST_LOSSES[test_loss]}", xlabel="epoch", xscale=xscale)
        axes[row, 1].legend(fontsize="small")
    fig.tight_layout()
    return fig


def _correlation(covariance: torch.Tensor) -> torch.Tensor:
    std = covariance.diagonal().sqrt()
    return covariance / std[:, None] / std[None, :]


def plot_covariance(
    folder: Path,
    out: Path,
    dataset: str | None = None,
    split: int = 0,
    methods: list[str] | None = None,
    max_dim: int = 64,
) -> tuple[Path, pd.DataFrame]:
    """Fig. 1: off-diagonal posterior correlations of each method (first ``max_dim`` parameters); returns the
    PNG and :func:`covariance_agreement` of every method against the first one (the full Gaussian in Fig. 1)."""
    runs = labelled_runs(folder)
    runs = runs[runs["data.split"] == split]
    dataset = dataset or sorted(runs["dataset"].unique())[0]
    runs = runs[runs["dataset"] == dataset]
    runs = runs[runs["run_dir"].map(lambda d: (Path(d) / "posterior.pt").exists()).astype(bool)]
    if methods:  # in the order given; a method without runs is left out, except the first (the reference)
        runs = runs[runs["label"].isin(methods)].set_index("label")
        if not runs.empty and methods[0] not in runs.index:
            raise ResultsError(
                f"no {methods[0]} run with posterior.pt for dataset {dataset!r}, split {split} "
                f"below {folder}: the other methods are compared with it"
            )
        runs = runs.loc[[m for m in methods if m in runs.index]].reset_index()
    if runs.empty:
        raise ResultsError(f"no runs with posterior.pt for dataset {dataset!r}, split {split} below {folder}")
    n = len(runs)
    fig = Figure(figsize=(3.2 * (n + 1), 3.4))
    axes = fig.subplots(1, n + 1, squeeze=False)
    gaussians = [load_gaussian(Path(d) / "posterior.pt").to_dense() for d in runs["run_dir"]]
    corrs = []
    for gaussian in gaussians:
        corr = _correlation(gaussian.covariance.double())[:max_dim, :max_dim].clone()
        corrs.append(corr.fill_diagonal_(0.0))
    # one colour scale for every panel, set by the strongest off-diagonal correlation shown
    limit = max(float(c.abs().max()) for c in corrs) or 1.0
    image = None
    for ax, label, gaussian, corr in zip(axes[0, :n], runs["label"], gaussians, corrs):
        image = ax.imshow(corr.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit)
        ax.set(title=str(label), xticks=[], yticks=[])
        axes[0, n].plot(gaussian.covariance.diagonal().sqrt()[:max_dim].numpy(), label=str(label))
    fig.colorbar(image, ax=list(axes[0, :n]), shrink=0.8, label="correlation")
    axes[0, n].set(title="marginal std", xlabel="parameter")
    axes[0, n].legend(fontsize="x-small")
    n_dim = corrs[0].shape[0]
    shown = f"all {n_dim} parameters" if n_dim == gaussians[0].mean.numel() else f"first {n_dim} parameters"
    fig.suptitle(f"{dataset}, split {split}: posterior correlations (off-diagonal, {shown})")
    return save_figure(fig, out), covariance_agreement(dict(zip(runs["label"].astype(str), gaussians)))


def covariance_agreement(gaussians: dict[str, FullGaussian]) -> pd.DataFrame:
    r"""How closely each Gaussian matches the first (the reference), by what SLANG's Fig. 1 shows (Sec. 4.1): the
    error of the off-diagonal correlations the figure draws, :math:`\|\mathrm{off}(C - C_{ref})\|_F /
    \|\mathrm{off}(C_{ref})\|_F` ("more accurate as the rank is increased"; mean field's is 1), the relative
    error of the mean ("the means match closely"), the median ratio of the marginal variances to the reference's
    ("heavily underestimated by the mean-field method") and their correlation with the reference's (negative for
    the "trend reversal" of mean field)."""
    reference = next(iter(gaussians.values()))
    ref_corr, ref_var = _correlation(reference.covariance.double()), reference.covariance.double().diagonal()
    off = ~torch.eye(ref_corr.shape[0], dtype=torch.bool)
    rows = []
    for label, gaussian in gaussians.items():
        corr, var = _correlation(gaussian.covariance.double()), gaussian.covariance.double().diagonal()
        rows.append(
            {
                "method": label,
                "offdiag_error": float((corr - ref_corr)[off].norm() / ref_corr[off].norm()),
                "mean_error": float((gaussian.mean - reference.mean).norm() / reference.mean.norm()),
                "variance_ratio": float((var / ref_var).median()),
                "variance_corr": float(torch.corrcoef(torch.stack([var, ref_var]))[0, 1]),
            }
        )
    return pd.DataFrame(rows)


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bdl-bench plot", description="Figures from run folders.")
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "kind",
        choices=["convergence", "covariance", "ood"],
        help="Fig. 4 (convergence), Fig. 1 (covariance) or reliability diagram + OOD entropy histograms (ood)",
    )
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default <folder>/<kind>.png)")
    parser.add_argument("--methods", default=None, help="comma-separated method labels, in plotting order")
    parser.add_argument("--dataset", default=None, help="covariance: dataset short name (default: first)")
    parser.add_argument(
        "--split",
        type=int,
        default=None,
        help="covariance: split index (default 0); convergence: that split's runs alone",
    )
    parser.add_argument("--max-dim", type=int, default=64, help="covariance: parameters shown")
    ns = parser.parse_args([a.removeprefix("kind=") for a in args])
    if not ns.folder.is_dir():
        raise SystemExit(f"bdl-bench plot: {ns.folder} is not a folder")
    out = ns.out or ns.folder / f"{ns.kind}.png"
    methods = ns.methods.split(",") if ns.methods else None
    if ns.kind == "convergence":
        plot_convergence(ns.folder, out, methods, ns.split)
    elif ns.kind == "ood":
        from bdl_bench.report.ood_plots import plot_runs

        plot_runs(ns.folder, out)
    else:
        split = 0 if ns.split is None else ns.split
        print(plot_covariance(ns.folder, out, ns.dataset, split, methods, ns.max_dim)[1].to_string(index=False))
    print(f"wrote {out}")
