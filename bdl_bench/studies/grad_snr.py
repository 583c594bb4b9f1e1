"""Gradient SNR along training, mean-field vs k-tied (Swiatkowski et al. 2020, Fig. 6 top right).

Runs of ``method=gmfvi`` / ``method=ktied`` with ``method.snr_window=10`` write ``train/grad_snr``
(all layers) and ``train/grad_snr_l<i>`` (the i-th linear layer's std parameters) into ``history.csv``,
averaged over the SNR windows completed in each epoch (``bdl_bench.methods._grad_snr``).
:func:`snr_curves` collects them into one tidy frame and :func:`plot_grad_snr` draws them on a log
scale, one line per run labelled by method (and k).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import yaml


def run_label(config: dict) -> str:
    """``gmfvi``, ``ktied k=2``, ``elrg K=5`` ... from a run's resolved config."""
    method = config.get("method", {})
    name = str(method.get("name", "?"))
    if name == "ktied":
        return f"{method['k']}-tied"
    if name == "gmfvi":
        return "mean-field"
    if name == "elrg":
        return f"elrg K={method['rank']}" + (" (D)" if method.get("learn_diag") else "")
    return name


def snr_curves(run_dirs: Iterable[Path]) -> pd.DataFrame:
    """Rows ``run``, ``label``, ``epoch``, ``column`` (``grad_snr``, ``grad_snr_l1``, ...), ``snr``.

    Raises:
        ValueError: if no run has a gradient-SNR column (``method.snr_window`` was 0).
    """
    frames = []
    for run_dir in map(Path, run_dirs):
        history = pd.read_csv(run_dir / "history.csv")
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        columns = [c for c in history.columns if c.startswith("train/grad_snr")]
        if not columns:
            continue
        long = history.melt(id_vars=["epoch"], value_vars=columns, var_name="column", value_name="snr").dropna()
        long["column"] = long["column"].str.removeprefix("train/")
        long["run"] = str(run_dir)
        long["label"] = run_label(config)
        frames.append(long)
    if not frames:
        raise ValueError("no history.csv with train/grad_snr columns: run with method.snr_window=10")
    return pd.concat(frames, ignore_index=True)


def plot_grad_snr(frame: pd.DataFrame, out: Path, column: str = "grad_snr") -> Path:
    """Mean SNR per epoch (log scale), one line per run, for ``column`` (``grad_snr_l2`` is "Dense 2")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    part = frame[frame["column"] == column]
    if part.empty:
        raise ValueError(f"no {column!r} values; available: {', '.join(sorted(frame['column'].unique()))}")
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for (_, label), rows in part.groupby(["run", "label"], sort=True):
        ax.plot(rows["epoch"], rows["snr"], label=label)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"gradient SNR ({column.removeprefix('grad_snr').lstrip('_') or 'all layers'})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
