"""DEF App. E.1, Fig. 8 (Lee et al. 2020): the posterior covariance of the toy network's first layer for KFAC
Laplace with eq. 3's damping against the undamped Kronecker form (OKF), at the same N and τ, beside how wide each
predictive is (the figure kind ``layer_covariance``, :mod:`bdl_bench.report.figures`).

Eq. 3 replaces the precision :math:`N\\,G\\otimes A + \\tau I` by :math:`(\\sqrt N G + \\sqrt\\tau I)\\otimes
(\\sqrt N A + \\sqrt\\tau I)`, which adds the cross terms :math:`\\sqrt{N\\tau}(G\\otimes I + I\\otimes A)`: a larger
precision, so a smaller covariance. App. E.1 reads Fig. 8 as: at the same τ the undamped form over-predicts the
uncertainty, and "equation 3 damps the magnitude of estimated covariance matrix"."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from bdl_bench.errors import ResultsError
from bdl_bench.gaussians.io import load_gaussian
from bdl_bench.report.plots import save_figure
from bdl_bench.report.tables import markdown, run_configs
from bdl_bench.results import METRICS_FILE

POSTERIOR_FILE = "posterior.pt"


def first_layer_size(config: dict) -> int:
    """The number of parameters (weights and biases) of the first weight layer of a run's model, which lead the
    flat parameter vector."""
    from bdl_bench.data import build_dataset
    from bdl_bench.models import build_model

    data = build_dataset(config["data"])
    model = build_model(config["model"], in_features=data.n_features, out_features=data.n_outputs)
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    return sum(p.numel() for p in first.parameters())


def layer_covariances(folder: Path, variants: Sequence[str]) -> dict[str, np.ndarray]:
    """Per def_toy variant (in the order given), the dense posterior covariance of the first layer of its finished
    run below ``folder`` (from ``posterior.pt``)."""
    from bdl_bench.studies.def_toy import variant_of

    found = {}
    for run_dir, config in run_configs(folder, POSTERIOR_FILE, METRICS_FILE):
        variant = variant_of(config)
        if variant in variants and variant not in found:
            size = first_layer_size(config)
            covariance = load_gaussian(run_dir / POSTERIOR_FILE).to_dense().covariance
            found[variant] = covariance[:size, :size].double().numpy()
    missing = [v for v in variants if v not in found]
    if missing:
        raise ResultsError(f"no finished run with a {POSTERIOR_FILE} below {folder} for {', '.join(missing)}")
    return {v: found[v] for v in variants}


def plot_runs(folder: Path, out: Path, variants: Sequence[str] = ("kfac", "kfac_okf")):
    """Fig. 8's covariance panels from the runs below ``folder`` into ``out`` (one shared colour scale), and a
    table per variant: the layer's covariance trace and largest entry, and the mean standard deviation of the
    network output inside and outside the training range (from ``predictive.npz``); returns (png, table, text)."""
    from bdl_bench.studies.def_toy import label_of, raw_data, read_runs

    covariances = layer_covariances(folder, variants)
    predictions, data_cfg = read_runs(folder, variants)
    grid = raw_data(data_cfg)[2]
    inside = grid.abs() <= float(data_cfg.get("train_bound", 4.0))
    rows = []
    for variant, cov in covariances.items():
        std = predictions[variant].epistemic_std
        rows.append(
            {
                "variant": variant,
                "trace": float(np.trace(cov)),
                "max_abs": float(np.abs(cov).max()),
                "std_inside": float(std[inside].mean()),
                "std_outside": float(std[~inside].mean()),
            }
        )
    table = pd.DataFrame(rows)
    scale = max(float(np.abs(c).max()) for c in covariances.values())
    fig = Figure(figsize=(4.2 * len(covariances) + 0.8, 4.2))
    axes = np.atleast_1d(fig.subplots(1, len(covariances)))
    image = None
    for ax, (variant, cov), row in zip(axes, covariances.items(), rows):
        image = ax.imshow(cov, cmap="RdBu_r", vmin=-scale, vmax=scale)
        ax.set_title(
            f"{label_of(variant)}\ntrace {row['trace']:.3g}, largest |entry| {row['max_abs']:.3g}", fontsize=10
        )
        ticks = range(0, cov.shape[0], 2)
        ax.set(xlabel="parameter (weights, then biases)", ylabel="parameter", xticks=ticks, yticks=ticks)
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="covariance")
    fig.suptitle("First layer's posterior covariance (cf. Lee et al. 2020, Fig. 8)")
    cells = [[r["variant"], *(f"{r[k]:.4g}" for k in ("trace", "max_abs", "std_inside", "std_outside"))] for r in rows]
    header = ["variant", "layer-1 covariance trace", "largest entry", "output std inside", "output std outside"]
    return save_figure(fig, out), table, markdown(header, cells)
