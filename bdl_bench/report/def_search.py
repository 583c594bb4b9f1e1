"""DEF App. E.3.1, Fig. 10 (Lee et al. 2020): the validation grid search over the prior precision τ (and the
pseudo-observation count N) of the Laplace columns, drawn from each run's ``laplace_search.csv``
(:mod:`bdl_bench.methods.laplace.search`; the figure kind ``laplace_search``, :mod:`bdl_bench.report.figures`).

Per Laplace structure two panels, as the paper's: validation accuracy and validation ECE against τ, one curve per
N, the MAP's validation accuracy as a dashed line and the chosen (N, τ) marked. The search keeps the points whose
accuracy is within the tolerance of the MAP's and takes the one of least ECE among them ("the minimum ece points
were selected"); a point below the accuracy floor ends its N's sweep (pruned, not drawn)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from bdl_bench.errors import ResultsError
from bdl_bench.report.plots import save_figure
from bdl_bench.report.tables import markdown, run_configs
from bdl_bench.results import METRICS_FILE

SEARCH_FILE = "laplace_search.csv"


def search_grids(folder: Path, structures: Sequence[str]) -> dict[str, tuple[pd.DataFrame, dict]]:
    """Per Laplace ``structure`` (in the order given): the evaluated grid points of its finished run below
    ``folder`` and the run's metrics. A structure with several runs (seeds) takes the first in folder order."""
    found: dict[str, tuple[pd.DataFrame, dict]] = {}
    for run_dir, config in run_configs(folder, SEARCH_FILE, METRICS_FILE):
        structure = str((config.get("method") or {}).get("structure"))
        if structure in structures and structure not in found:
            grid = pd.read_csv(run_dir / SEARCH_FILE)
            metrics = json.loads((run_dir / METRICS_FILE).read_text())
            found[structure] = (grid[grid["status"] == "evaluated"], metrics)
    missing = [s for s in structures if s not in found]
    if missing:
        raise ResultsError(f"no finished Laplace run with a {SEARCH_FILE} below {folder} for {', '.join(missing)}")
    return {s: found[s] for s in structures}


def plot(grids: dict[str, tuple[pd.DataFrame, dict]], path: Path) -> Path:
    """Fig. 10's layout: per structure, validation accuracy and ECE against τ (log scale), one curve per N."""
    fig = Figure(figsize=(4.2 * 2 * len(grids), 3.8))
    axes = np.asarray(fig.subplots(1, 2 * len(grids))).reshape(len(grids), 2)
    for (structure, (grid, metrics)), (ax_acc, ax_ece) in zip(grids.items(), axes):
        for scale, points in grid.groupby("dataset_scale"):
            points = points.sort_values("prior_precision")
            for ax, key in ((ax_acc, "val_accuracy"), (ax_ece, "val_ece")):
                ax.plot(points["prior_precision"], points[key], marker=".", label=f"N = {scale:g}")
        map_accuracy = metrics.get("search_map_val_accuracy")
        if map_accuracy is not None:
            ax_acc.axhline(map_accuracy, color="black", ls="--", lw=1, label="MAP")
        chosen = grid[grid["chosen"].astype(str) == "True"]
        for ax, key in ((ax_acc, "val_accuracy"), (ax_ece, "val_ece")):
            ax.scatter(chosen["prior_precision"], chosen[key], s=80, facecolors="none", edgecolors="red", zorder=3)
            ax.set(xscale="log", xlabel="τ (prior precision)")
        ax_acc.set(ylabel="validation accuracy", title=f"{structure} Laplace: accuracy")
        ax_ece.set(ylabel="validation ECE", title=f"{structure} Laplace: ECE (chosen: red circle)")
        ax_acc.legend(fontsize=8)
    fig.suptitle("Validation grid search of the Laplace columns (cf. Lee et al. 2020, Fig. 10)")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_runs(folder: Path, out: Path, structures: Sequence[str] = ("diag", "kfac")):
    """Fig. 10 from the runs below ``folder`` into ``out``; returns (png, table, Markdown): per structure the
    points evaluated, the chosen N and τ with their validation accuracy and ECE, and the MAP's accuracy."""
    grids = search_grids(folder, structures)
    rows = []
    for structure, (grid, metrics) in grids.items():
        rows.append(
            {
                "structure": structure,
                "n_evaluated": len(grid),
                "chosen_dataset_scale": metrics.get("chosen_dataset_scale"),
                "chosen_prior_precision": metrics.get("chosen_prior_precision"),
                "val_accuracy": metrics.get("search_val_accuracy"),
                "val_ece": metrics.get("search_val_ece"),
                "map_val_accuracy": metrics.get("search_map_val_accuracy"),
            }
        )
    table = pd.DataFrame(rows)
    header = ["structure", "points evaluated", "chosen N", "chosen τ", "val accuracy", "val ECE", "MAP val accuracy"]
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    return plot(grids, out), table, markdown(header, cells)
