"""DEF Fig. 5 (Lee et al. 2020, Sec. 4.1) from finished MAP runs: the normalised Frobenius errors of one layer's
Diag, KFAC, EFB and DEF(K) information matrices against its exact block, and the block's eigenvalue histogram
(the figure kind ``frobenius``, :mod:`bdl_bench.report.figures`). Over several runs the table and the curves are
the mean, with the standard error in the table."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import Tensor

from bdl_bench.checkpoint import atomic_torch_save, load_params
from bdl_bench.curvature.exact import exact_blocks
from bdl_bench.curvature.frobenius import ERRORS, layer_approximations
from bdl_bench.curvature.kron import KronFactors, kron_factors
from bdl_bench.curvature.pseudo_grads import iter_pseudo_grads, kron_layout
from bdl_bench.errors import ResultsError
from bdl_bench.report.plots import save_figure
from bdl_bench.report.tables import markdown, run_configs
from bdl_bench.results import CONFIG_FILE, METRICS_FILE, PARAMS_FILE, package_digest, read_config

logger = logging.getLogger(__name__)

FISHER_SEED_OFFSET = 4  # the sampled labels of curvature=fisher: torch.Generator seeded trainer.seed + 4


def _run_problem(
    run_dir: Path, layer: int, dtype: torch.dtype = torch.float64
) -> tuple[torch.nn.Module, Tensor, Any, Any, torch.Generator, dict]:
    """One finished run's model, parameters, data, likelihood, generator of curvature=fisher's labels and config,
    rebuilt from its ``config.yaml`` and ``params.pt`` in ``dtype``, with ``layer`` checked against its weight
    layers (linear and convolutional, in model order)."""
    from bdl_bench.data import build_dataset
    from bdl_bench.likelihoods import build_likelihood
    from bdl_bench.models import build_model

    config = read_config(run_dir / CONFIG_FILE)
    if not (run_dir / PARAMS_FILE).is_file():
        raise ResultsError(f"{run_dir} has no {PARAMS_FILE} (a finished run of a method with a point estimate)")
    data = build_dataset(config["data"])
    torch.manual_seed(0)  # the initial weights are replaced by the run's parameters below
    model = build_model(config["model"], in_features=data.n_features, out_features=data.n_outputs).to(dtype)
    n_layers = len(kron_layout(model).slots)
    if not 0 <= layer < n_layers:
        raise ResultsError(f"layer {layer}: the model of {run_dir} has weight layers 0 … {n_layers - 1}")
    theta = load_params(run_dir / PARAMS_FILE)["theta"].to(dtype)
    generator = torch.Generator().manual_seed(int(config.get("trainer", {}).get("seed", 0)) + FISHER_SEED_OFFSET)
    return model, theta, data, build_likelihood(data, config.get("noise_precision")), generator, config


def run_errors(
    run_dir: Path, *, layer: int = 0, curvature: str = "ggn", n_samples: int = 16
) -> tuple[pd.DataFrame, Tensor, dict]:
    """:func:`~bdl_bench.curvature.frobenius.layer_approximations` at one finished run's parameters, on its
    training set (rebuilt from its ``config.yaml``): (table, eigenvalues of the exact block, the run's config)."""
    model, theta, data, likelihood, generator, config = _run_problem(run_dir, layer)
    table, eigenvalues = layer_approximations(
        model,
        theta,
        data.x_train,
        data.y_train,
        likelihood,
        layer=layer,
        kind=curvature,
        n_samples=n_samples,
        generator=generator,
    )
    return table, eigenvalues, config


LAYER_CURVATURE_DIR = "layer_curvature"  # in a finished run's folder: run_layer_curvature's results, reused


def run_layer_curvature(
    run_dir: Path,
    *,
    layer: int = 0,
    curvature: str = "ggn",
    n_samples: int = 16,
    n_examples: int | None = None,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, KronFactors, dict, int]:
    """The exact information block of weight layer ``layer`` (weights and biases, ``(P, P)`` in augmented
    row-major order, float64) and its KFAC factors at one finished run's parameters, on the first
    ``n_examples`` of its training set (all by default), in one pass of minibatches of ``batch_size`` rows
    computed in ``dtype``: (block, factors, the run's config, the number of examples). The result is kept in the
    run's ``layer_curvature/`` under a hash of these settings, the parameters and the package's source, and read back
    from there while all three are the same."""
    model, theta, data, likelihood, generator, config = _run_problem(run_dir, layer, dtype)
    x, y = data.x_train[:n_examples], data.y_train[:n_examples]
    n = x.shape[0]
    parameters = hashlib.sha256(theta.numpy().tobytes()).hexdigest()
    settings = [layer, curvature, n_samples, n, batch_size, str(dtype), parameters, package_digest()]
    cache = run_dir / LAYER_CURVATURE_DIR / f"{hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]}.pt"
    slot = kron_layout(model).slots[layer]
    if cache.is_file():
        saved = torch.load(cache, map_location="cpu", weights_only=True)
        return saved["block"], KronFactors(slot, saved["a_factor"], saved["g_factor"]), config, n
    batches = iter_pseudo_grads(
        model,
        theta,
        x.to(dtype),
        y,
        likelihood,
        batch_size=batch_size or n,
        kind=curvature,
        n_samples=n_samples,
        generator=generator,
    )
    block, a_sum, g_sum = 0.0, 0.0, 0.0
    for batch in batches:  # each minibatch's means, weighted by its size: only this layer's block is formed
        one = dataclasses.replace(batch, layers=(batch.layers[layer],))
        factors = kron_factors([one])[0]
        block = block + exact_blocks([one])[0] * one.n_examples
        a_sum = a_sum + factors.a_factor * one.n_examples
        g_sum = g_sum + factors.g_factor * one.n_examples
    block, factors = block / n, KronFactors(slot, a_sum / n, g_sum / n)
    try:  # a run folder we may not write to (someone else's results) only loses the shortcut
        cache.parent.mkdir(exist_ok=True)
        atomic_torch_save({"block": block, "a_factor": factors.a_factor, "g_factor": factors.g_factor}, cache)
    except OSError as err:
        logger.warning("could not keep the layer's curvature in %s (%s); it will be computed again", cache, err)
    return block, factors, config, n


def run_block(run_dir: Path, *, layer: int = 0, curvature: str = "ggn", n_samples: int = 16) -> tuple[Tensor, dict]:
    """The exact information block of weight layer ``layer`` (weights and biases) at one finished run's
    parameters, on its training set: (the ``(P, P)`` block, the run's config)."""
    block, _, config, _ = run_layer_curvature(run_dir, layer=layer, curvature=curvature, n_samples=n_samples)
    return block, config


def errors_from_runs(
    folder: Path, *, method: str = "map", layer: int = 0, curvature: str = "ggn", n_samples: int = 16
) -> tuple[pd.DataFrame, Tensor, dict]:
    """:func:`run_errors` of every finished ``method`` run below ``folder``, averaged: one row per approximation
    (``method``, ``rank`` K, ``kept`` L, ``n_runs``, each error and its standard error ``<error>_se``, NaN for a
    single run); returns (table, the exact blocks' eigenvalues of all runs, the first run's config)."""
    tables, eigenvalues, configs = [], [], []
    for run_dir, config in run_configs(folder, METRICS_FILE):
        if (config.get("method") or {}).get("name") != method:
            continue
        table, eigs, config = run_errors(run_dir, layer=layer, curvature=curvature, n_samples=n_samples)
        tables.append(table.assign(run=run_dir.name))
        eigenvalues.append(eigs)
        configs.append(config)
    if not tables:
        raise ResultsError(f"no finished {method} run below {folder} (the figure is computed at its parameters)")
    frame = pd.concat(tables, ignore_index=True)
    frame["rank"] = frame["rank"].astype("Int64")
    frame["kept"] = frame["kept"].astype("Int64")
    keys = ["method", "rank", "kept"]
    grouped = frame.groupby(keys, dropna=False, sort=False)
    table = grouped[list(ERRORS)].mean()
    table.insert(0, "n_runs", grouped.size())
    for error in ERRORS:
        table[f"{error}_se"] = grouped[error].sem() if len(tables) > 1 else float("nan")
    return table.reset_index(), torch.cat(eigenvalues), configs[0]


def plot(table: pd.DataFrame, eigenvalues: Tensor, path: Path, title: str) -> Path:
    """Fig. 5's layout: the diagonal, off-diagonal and overall error against K (DEF, one point per K) with
    Diag, KFAC and EFB as horizontal lines, and the histogram of the exact block's eigenvalues (counting those
    that are zero to rounding, at most 1e-10 of the largest, and those below 1% of it)."""
    fig = Figure(figsize=(16, 3.6))
    axes = fig.subplots(1, 4)
    def_rows = table[table["method"] == "DEF"]
    colors = {"Diag": "tab:green", "KFAC": "tab:orange", "EFB": "tab:purple"}
    names = ("(a) diagonal", "(b) off-diagonal", "(c) overall")
    for ax, key, name in zip(axes, ERRORS, names):
        ax.plot(def_rows["rank"], def_rows[key], marker="o", color="tab:blue", label="DEF (top K kept)")
        for method, color in colors.items():
            ax.axhline(float(table.loc[table["method"] == method, key].iloc[0]), color=color, ls="--", label=method)
        ax.set(xlabel="K (top eigenvalues kept)", title=f"{name} error, normalised")
        ax.set_ylim(-0.03, max(1.05, float(table[key].max()) * 1.05))
    axes[0].legend(fontsize=8)
    values = eigenvalues.clamp_min(0).cpu()
    axes[3].hist(values.numpy(), bins=30, color="tab:gray")
    zero, small = (int((values <= f * values.max()).sum()) for f in (1e-10, 1e-2))
    axes[3].set_title(
        f"(d) eigenvalues of I\n{zero} ≈ 0, {small} of {values.numel()} below 1% of the largest", fontsize=10
    )
    axes[3].set(xlabel="eigenvalue", ylabel="count")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_runs(
    folder: Path, out: Path, *, method: str = "map", layer: int = 0, curvature: str = "ggn", n_samples: int = 16
) -> tuple[Path, pd.DataFrame]:
    """Fig. 5 from the finished ``method`` runs below ``folder`` into ``out``; returns (png, the figure's table
    of :func:`errors_from_runs`)."""
    table, eigenvalues, config = errors_from_runs(
        folder, method=method, layer=layer, curvature=curvature, n_samples=n_samples
    )
    n_runs = int(table["n_runs"].max())
    model = config.get("model") or {}
    title = (
        f"Layer {layer} of the MLP {list(model.get('hidden', []))} ({curvature}, N={config['data'].get('n_train')}, "
        f"{n_runs} {method} run{'s' if n_runs > 1 else ''}): normalised Frobenius error against the exact block "
        "(cf. Lee et al. 2020, Fig. 5)"
    )
    return plot(table, eigenvalues, out, title), table


def markdown_table(table: pd.DataFrame, columns: Sequence[str] = ERRORS) -> str:
    """The figure's table as Markdown: one row per approximation, K and L where they apply, mean ± SE."""
    rows = []
    for _, row in table.iterrows():
        cells = [str(row["method"])]
        cells += ["–" if pd.isna(row[k]) else str(int(row[k])) for k in ("rank", "kept")]
        cells.append(str(int(row["n_runs"])))
        for c in columns:
            se = row.get(f"{c}_se")
            cells.append(f"{row[c]:.4f}" + ("" if se is None or pd.isna(se) else f" ± {se:.4f}"))
        rows.append(cells)
    return markdown(["approximation", "K", "L", "n", *columns], rows)
