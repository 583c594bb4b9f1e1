"""Calibration and out-of-distribution figures (DEF Fig. 6): per run, its reliability diagram and histograms of
normalised predictive entropy, from the ``uncertainty.npz`` a classification run saves
(:func:`bdl_bench.metrics.uncertainty_arrays`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bdl_bench.errors import MissingFileError, ResultsError
from bdl_bench.metrics import ReliabilityDiagram, reliability_from_confidence
from bdl_bench.report.plots import save_figure
from bdl_bench.results import find_run_dirs

UNCERTAINTY_FILE = "uncertainty.npz"


def plot_reliability_diagram(diagram: ReliabilityDiagram, ax: Axes, title: str) -> None:
    """Bars of per-bin accuracy against the bin centres, the gap to the diagonal, and the ECE in the title."""
    edges = diagram.bin_edges.numpy()
    width = np.diff(edges)
    centres = edges[:-1] + width / 2
    accuracy = np.nan_to_num(diagram.accuracy.numpy(), nan=0.0)
    confidence = np.where(diagram.counts.numpy() > 0, diagram.confidence.numpy(), centres)
    ax.bar(centres, accuracy, width=width, edgecolor="black", linewidth=0.5, label="accuracy")
    ax.bar(
        centres,
        confidence - accuracy,
        bottom=accuracy,
        width=width,
        color="tab:red",
        alpha=0.3,
        edgecolor="tab:red",
        label="gap",
    )
    ax.plot([0, 1], [0, 1], "k--", linewidth=1)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy")
    ax.set_title(f"{title + ': ' if title else ''}ECE {diagram.ece:.4f}", fontsize="medium")
    ax.legend(loc="upper left", fontsize="small")


def plot_entropy_histograms(entropies: Mapping[str, np.ndarray], ax: Axes, title: str) -> None:
    """Overlaid density histograms of normalised predictive entropy (values in [0, 1], 20 bins), one per label."""
    edges = np.linspace(0.0, 1.0, 21)
    for label, values in entropies.items():
        values = np.asarray(values, dtype=float)
        ax.hist(values, bins=edges, density=True, alpha=0.5, label=f"{label} (mean {values.mean():.3f})")
    ax.set(xlim=(0, 1), xlabel="predictive entropy / log C", ylabel="density")
    if title:
        ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="small")


def load_uncertainty(run_dir: Path) -> dict[str, np.ndarray]:
    """The arrays a run saved in ``uncertainty.npz`` (a missing file is a :class:`MissingFileError`)."""
    path = Path(run_dir) / UNCERTAINTY_FILE
    if not path.is_file():
        raise MissingFileError(f"{path} is missing: the run saved no per-example uncertainty arrays")
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def entropy_groups(arrays: Mapping[str, np.ndarray], grouping: str = "test") -> dict[str, np.ndarray]:
    """The normalised entropies a histogram panel shows, by label (:func:`plot_uncertainty`'s ``grouping``)."""
    if grouping == "test":
        groups = {"test (in-distribution)": arrays["test_entropy"]}
        if "ood_entropy" in arrays:
            groups["out-of-distribution"] = arrays["ood_entropy"]
        return groups
    if grouping != "paper":
        raise ValueError(f"grouping must be test or paper, got {grouping!r}")
    correct = arrays["test_correct"].astype(bool)
    wrong = [arrays["test_entropy"][~correct], arrays.get("ood_entropy", np.empty(0))]
    return {
        "in-dist (correct test)": arrays["test_entropy"][correct],
        "out-dist (OOD and misclassified)": np.concatenate(wrong),
    }


def plot_uncertainty(run_dirs: Sequence[Path], out: Path, grouping: str = "test") -> Path:
    """``out``: one row per run (titled with its folder's name), its reliability diagram (15 bins) and its
    entropy histograms. ``grouping``: ``"test"``, the whole test set against the OOD set; ``"paper"``, DEF Fig. 6's
    groups: the correctly classified test images ("in-dist") against the OOD images and the misclassified test
    images together ("out-dist")."""
    if not run_dirs:
        raise ResultsError("plot_uncertainty needs at least one run folder")
    fig = Figure(figsize=(10, 3.8 * len(run_dirs)))
    axes = fig.subplots(len(run_dirs), 2, squeeze=False)
    for row, run_dir in enumerate(run_dirs):
        arrays = load_uncertainty(Path(run_dir))
        label = Path(run_dir).name
        diagram = reliability_from_confidence(
            torch.from_numpy(arrays["test_confidence"]), torch.from_numpy(arrays["test_correct"]), 15
        )
        plot_reliability_diagram(diagram, axes[row, 0], title=label)
        plot_entropy_histograms(entropy_groups(arrays, grouping), axes[row, 1], title=label)
    fig.tight_layout()
    return save_figure(fig, out)


def plot_runs(folder: Path, out: Path, grouping: str = "test") -> Path:
    """:func:`plot_uncertainty` of every run below ``folder`` that saved ``uncertainty.npz``."""
    run_dirs = [d for d in find_run_dirs(folder) if (d / UNCERTAINTY_FILE).exists()]
    if not run_dirs:
        raise ResultsError(f"no run below {folder} has {UNCERTAINTY_FILE} (runs with an OOD set)")
    return plot_uncertainty(run_dirs, out, grouping)
