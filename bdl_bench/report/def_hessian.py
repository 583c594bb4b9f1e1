"""DEF App. E.1, Fig. 9 (Lee et al. 2020) from finished MAP runs: the first layer's information block of the toy
network trained on 20 and on 100 points, as heat maps, and how many of its parameters carry no information (the
figure kind ``hessian_blocks``, :mod:`bdl_bench.report.figures`).

A parameter carries no information when its diagonal entry of the block is zero; the block is positive
semi-definite, so its whole row and column are zero then (for a ReLU unit that no training input activates, its
weight and its bias both). App. E.1 reads Fig. 9 as "using 100 data points resulted in more number of zero diagonal
entries and corresponding rows and columns" than 20, and makes such parameters deterministic for its Laplace."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from torch import Tensor

from bdl_bench.errors import ResultsError
from bdl_bench.report.frobenius import run_block
from bdl_bench.report.plots import save_figure
from bdl_bench.report.tables import markdown, run_configs
from bdl_bench.results import METRICS_FILE

ZERO_TOLERANCE = 1e-10  # a diagonal entry at most this fraction of the largest one counts as zero


def zero_information(block: Tensor, tolerance: float = ZERO_TOLERANCE) -> int:
    """The number of parameters whose diagonal entry of ``block`` is zero (at most ``tolerance`` times the
    largest diagonal entry)."""
    diagonal = block.diagonal()
    return int((diagonal <= tolerance * diagonal.max()).sum())


def blocks_from_runs(
    folder: Path, *, method: str = "map", layer: int = 0, curvature: str = "ggn"
) -> list[tuple[int, int, Tensor]]:
    """(number of training points, seed, block) of every finished ``method`` run below ``folder``, sorted."""
    found = []
    for run_dir, config in run_configs(folder, METRICS_FILE):
        if (config.get("method") or {}).get("name") != method:
            continue
        block, config = run_block(run_dir, layer=layer, curvature=curvature)
        found.append((int(config["data"]["n_train"]), int(config.get("trainer", {}).get("seed", 0)), block))
    if not found:
        raise ResultsError(f"no finished {method} run below {folder} (the figure is computed at its parameters)")
    return sorted(found, key=lambda item: item[:2])


def zero_table(blocks: Sequence[tuple[int, int, Tensor]]) -> pd.DataFrame:
    """Per number of training points: the runs, the parameters of the block, and the zero-information count
    over the runs (mean, standard error, minimum, maximum, and each run's in seed order)."""
    rows = []
    for n_train in sorted({n for n, _, _ in blocks}):
        counts = [zero_information(b) for n, _, b in blocks if n == n_train]
        rows.append(
            {
                "n_train": n_train,
                "n_runs": len(counts),
                "n_params": int(blocks[0][2].shape[0]),
                "zero_diag": float(np.mean(counts)),
                "zero_diag_se": float(np.std(counts, ddof=1) / np.sqrt(len(counts))) if len(counts) > 1 else np.nan,
                "zero_min": min(counts),
                "zero_max": max(counts),
                "per_seed": " ".join(map(str, counts)),
            }
        )
    return pd.DataFrame(rows)


def plot(blocks: Sequence[tuple[int, int, Tensor]], table: pd.DataFrame, path: Path, layer: int) -> Path:
    """Fig. 9's layout: one heat map per number of training points, the block of its first seed's run scaled by
    its largest entry (a diverging map centred at zero), its zero-information count in the title."""
    sizes = list(table["n_train"])
    fig = Figure(figsize=(4.2 * len(sizes) + 0.8, 4.2))
    axes = np.atleast_1d(fig.subplots(1, len(sizes)))
    image = None
    for ax, n_train in zip(axes, sizes):
        _, seed, block = next(item for item in blocks if item[0] == n_train)
        scaled = (block / block.abs().max()).cpu().numpy()
        image = ax.imshow(scaled, cmap="RdBu_r", vmin=-1, vmax=1)
        row = table[table["n_train"] == n_train].iloc[0]
        ax.set_title(
            f"{n_train} points (seed {seed}): {zero_information(block)} of {block.shape[0]} zero\n"
            f"mean over {row['n_runs']} seeds {row['zero_diag']:.1f} (min {row['zero_min']}, max {row['zero_max']})",
            fontsize=10,
        )
        ticks = range(0, block.shape[0], 2)
        ax.set(xlabel="parameter", ylabel="parameter", xticks=ticks, yticks=ticks)
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="entry / largest |entry|")
    fig.suptitle(f"Layer {layer}'s information block at the MAP (cf. Lee et al. 2020, Fig. 9)")
    return save_figure(fig, path)


def plot_runs(folder: Path, out: Path, *, method: str = "map", layer: int = 0, curvature: str = "ggn"):
    """Fig. 9 from the finished ``method`` runs below ``folder`` into ``out``; returns (png, table, Markdown)."""
    blocks = blocks_from_runs(folder, method=method, layer=layer, curvature=curvature)
    table = zero_table(blocks)
    rows = [
        [
            str(r.n_train),
            str(r.n_runs),
            str(r.n_params),
            f"{r.zero_diag:.2f}" + ("" if pd.isna(r.zero_diag_se) else f" ± {r.zero_diag_se:.2f}"),
            f"{r.zero_min}–{r.zero_max}",
            r.per_seed,
        ]
        for r in table.itertuples()
    ]
    header = ["training points", "runs", "parameters", "zero-information parameters", "range", "per seed"]
    return plot(blocks, table, out, layer), table, markdown(header, rows)
