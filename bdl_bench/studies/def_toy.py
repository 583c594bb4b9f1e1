r"""DEF toy-regression figure (Lee et al. 2020, Fig. 4): predictive mean and up to ±3σ of every method.

Drawn from finished run folders holding ``predictive.npz`` (``trainer.save_predictive: true``, as
``conf/experiment/def_toy.yaml`` sets): :func:`plot_runs`, which ``bdl-bench reproduce def_toy`` calls, or
:func:`run_study`, which first runs each ``variant=def_toy/<name>`` through the runner and also writes
``def_toy.csv``: per method, the test metrics and the mean absolute difference of the predictive standard
deviation from HMC's, relative to HMC's, inside and outside the training range (``docs/reproducing.md``).

Each method's predictive on the grid is the mean and standard deviation of the network output over
``trainer.n_test_mc_samples`` samples (epistemic), and with the noise variance added (predictive), in original
units.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import Tensor

from bdl_bench.data.toy import make_cubic
from bdl_bench.errors import ResultsError
from bdl_bench.report.plots import save_figure
from bdl_bench.report.tables import run_configs
from bdl_bench.results import METRICS_FILE

VARIANTS = ("hmc", "bbb", "map", "diag", "kfac", "efb", "block", "def", "def_rank1")
N_SIGMA = 3  # Fig. 4 shades up to three standard deviations
LABELS = {
    "hmc": "HMC",
    "bbb": "BBB",
    "map": "MAP (deterministic)",
    "diag": "Diag Laplace",
    "kfac": "KFAC Laplace",
    "kfac_okf": "OKF Laplace (KFAC without eq. 3)",
    "efb": "EFB Laplace",
    "block": "FB Laplace (exact blocks)",
    "def": "DEF Laplace (full rank)",
}


@dataclass(frozen=True)
class ToyPrediction:
    """One method's predictive on the grid ``(G,)``, in original units."""

    mean: Tensor
    epistemic_std: Tensor  # standard deviation of the network output over samples
    predictive_std: Tensor  # with the noise variance added
    metrics: dict[str, float]  # the run's test metrics on the toy/cubic test set


def run_study(out: Path, variants: Sequence[str] = VARIANTS, overrides: Sequence[str] = ()) -> tuple[Path, Path]:
    """Run every variant as ``bdl-bench run experiment=def_toy variant=def_toy/<name> [overrides]`` does, into
    ``out/<name>``, then draw the figure and write the table from those runs; returns (png, csv) paths."""
    from hydra import compose, initialize_config_dir

    from bdl_bench.orchestration.hydra_app import CONF_DIR
    from bdl_bench.orchestration.runner import run

    for variant in variants:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=["experiment=def_toy", f"variant=def_toy/{variant}", *overrides])
        run(cfg, out / variant)
    found, data_cfg = read_runs(out, variants)
    predictions = {variant: found[variant] for variant in variants}
    x_train, y_train, x_grid = raw_data(data_cfg)
    png = _plot(out / "def_toy.png", predictions, x_train, y_train, x_grid)
    csv = out / "def_toy.csv"
    _table(predictions, x_grid, float(data_cfg.get("train_bound", 4.0))).to_csv(csv, index=False)
    return png, csv


def _table(predictions: dict[str, ToyPrediction], x_grid: Tensor, bound: float) -> pd.DataFrame:
    inside = x_grid.abs() <= bound
    rows = []
    reference = predictions.get("hmc")
    for variant, p in predictions.items():
        row = {"variant": variant, "label": label_of(variant), **p.metrics}
        if reference is not None:
            for name, mask in (("inside", inside), ("outside", ~inside)):
                ref = reference.predictive_std[mask]
                row[f"std_rel_diff_to_hmc_{name}"] = float((p.predictive_std[mask] - ref).abs().mean() / ref.mean())
        rows.append(row)
    return pd.DataFrame(rows)


def spread_table(predictions: dict[str, ToyPrediction], x_grid: Tensor, bound: float) -> pd.DataFrame:
    """Per variant: the mean standard deviation of the network output on the grid points inside the training range
    ``|x| <= bound`` and outside it (original units), its ratio to HMC's where HMC is among ``predictions``, and
    the run's test RMSE and log-likelihood: the numbers under the toy figures."""
    inside = torch.as_tensor(x_grid).abs() <= bound
    reference = predictions.get("hmc")
    rows = []
    for variant, p in predictions.items():
        row = {"variant": label_of(variant)}
        row.update(
            {
                f"std_{name}": float(p.epistemic_std[mask].mean())
                for name, mask in (("inside", inside), ("outside", ~inside))
            }
        )
        if reference is not None:
            ratios = spread_ratios(p, reference, x_grid, bound)
            row.update({f"std_{name}_over_hmc": ratio for name, ratio in ratios.items()})
        row.update({k: p.metrics.get(k, float("nan")) for k in ("rmse", "test_ll", "elbo")})
        rows.append(row)
    return pd.DataFrame(rows)


def _plot(
    path: Path, predictions: dict[str, ToyPrediction], x_train, y_train, x_grid, title: str | None = None
) -> Path:
    """Fig. 4's layout: one panel per method (HMC first), the training points, the true x³, the deterministic
    network (MAP, red, in every panel when it is among ``predictions``), the method's mean (blue) and its ±1σ …
    ±3σ bands of the network output (the epistemic part, blue shades: Lee et al. fit the Laplace variants on a
    squared error, with no noise model); HMC's ±3σ as dotted lines in the other panels, each of which also
    prints its :func:`spread_ratios` to HMC."""
    deterministic = predictions.get("map")
    panels = {k: v for k, v in predictions.items() if k != "map" or len(predictions) == 1}
    n = len(panels)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(3.6 * cols, 3.0 * rows))
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    x = torch.as_tensor(x_grid)
    reference = predictions.get("hmc")
    for ax, (variant, p) in zip(axes.flat, panels.items()):
        for k in range(N_SIGMA, 0, -1):
            ax.fill_between(
                x,
                p.mean - k * p.epistemic_std,
                p.mean + k * p.epistemic_std,
                color="tab:blue",
                alpha=0.12 + 0.1 * (N_SIGMA - k),
                lw=0,
                label=f"±{N_SIGMA}σ … ±1σ" if k == N_SIGMA else None,
            )
        if reference is not None and variant != "hmc":
            for sign in (-1, 1):
                ax.plot(
                    x,
                    reference.mean + sign * N_SIGMA * reference.epistemic_std,
                    color="k",
                    lw=0.8,
                    ls=":",
                    label=f"HMC ±{N_SIGMA}σ" if sign < 0 else None,
                )
        ax.plot(x, x**3, color="k", lw=1, label="x³")
        if deterministic is not None and variant != "map":
            ax.plot(x, deterministic.mean, color="tab:red", lw=1.2, label="deterministic NN")
        ax.plot(x, p.mean, color="tab:blue", lw=1.5, label="mean")
        ax.scatter(x_train, y_train, s=6, color="k", zorder=3, label="data")
        ax.axvspan(float(x.min()), -4, color="0.92", zorder=0)
        ax.axvspan(4, float(x.max()), color="0.92", zorder=0)
        if reference is not None and variant != "hmc":
            ratios = spread_ratios(p, reference, x)
            ax.text(
                0.97,
                0.04,
                f"σ / σ_HMC: {ratios['inside']:.2g} inside, {ratios['outside']:.2g} outside",
                transform=ax.transAxes,
                ha="right",
                fontsize=7,
            )
        ax.set_title(label_of(variant), fontsize=10)
        ax.set_ylim(-250, 250)
        ax.set_xlim(float(x.min()), float(x.max()))
    for ax in axes.flat[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, loc="upper left")
    fig.suptitle(
        f"Toy regression y = x³ + N(0, 3²), {len(x_train)} points: mean and up to ±{N_SIGMA}σ of the network output\n"
        f"({title or 'cf. Lee et al. 2020, Fig. 4'}; grey: outside the training range)",
        fontsize=10,
    )
    fig.tight_layout()
    return save_figure(fig, path)


def spread_ratios(p: ToyPrediction, reference: ToyPrediction, x_grid: Tensor, bound: float = 4.0) -> dict[str, float]:
    """Mean network-output std of ``p`` over that of ``reference`` (HMC) on the grid points inside the training
    range ``|x| <= bound`` and outside it: 1 is HMC's spread, above 1 wider (the numbers each panel prints)."""
    inside = torch.as_tensor(x_grid).abs() <= bound
    return {
        name: float(p.epistemic_std[mask].mean() / reference.epistemic_std[mask].mean())
        for name, mask in (("inside", inside), ("outside", ~inside))
    }


def label_of(variant: str) -> str:
    """The panel title of a variant (``def_rank<K>`` for any K)."""
    if variant in LABELS:
        return LABELS[variant]
    if variant.startswith("def_rank"):
        return f"DEF Laplace (rank {variant.removeprefix('def_rank')})"
    if variant.startswith("slang_L"):
        return f"SLANG (L = {variant.removeprefix('slang_L')})"
    return variant


def variant_of(config: dict) -> str:
    """The def_toy variant name of a run's config: the method's name, a Laplace run's structure, ``kfac_okf`` for
    KFAC with the exact Kronecker prior (``kfac_prior: exact``), ``def_rank<K>`` for DEF with a rank,
    ``slang_L<L>`` for SLANG (SLANG App. F.1)."""
    method = config.get("method") or {}
    if method.get("name") == "slang":
        return f"slang_L{method.get('rank')}"
    if method.get("name") != "laplace":
        return str(method.get("name"))
    structure = str(method.get("structure"))
    if structure == "kfac" and method.get("kfac_prior") == "exact":
        return "kfac_okf"
    if structure == "def" and method.get("rank") is not None:
        return f"def_rank{method['rank']}"
    return structure


def raw_data(data_cfg: dict) -> tuple[Tensor, Tensor, Tensor]:
    """The training points and the test grid in original units, redrawn from a run's ``data`` config."""
    params = {
        k: v for k, v in data_cfg.items() if k not in ("name", "split", "val_fraction", "protocol", "standardise")
    }
    x_tr, y_tr, x_te, _ = make_cubic(**params)
    return torch.as_tensor(x_tr[:, 0]), torch.as_tensor(y_tr), torch.as_tensor(x_te[:, 0])


def read_runs(folder: Path, variants: Sequence[str] | None = None) -> tuple[dict[str, ToyPrediction], dict]:
    """Each finished run's predictive below ``folder`` (its ``predictive.npz`` and ``metrics.json``), by variant in
    the order of :data:`VARIANTS` (others after, sorted), and the ``data`` config they share. ``variants``: only
    these."""
    found: dict[str, ToyPrediction] = {}
    data_cfg = None
    for run_dir, config in run_configs(folder, "predictive.npz", METRICS_FILE):
        variant = variant_of(config)
        if variants is not None and variant not in variants:
            continue
        if data_cfg is not None and config.get("data") != data_cfg:
            raise ResultsError(f"the runs below {folder} use different data configs; draw one sweep at a time")
        data_cfg = config.get("data")
        arrays = np.load(run_dir / "predictive.npz")
        std = torch.as_tensor(arrays["f_std"])
        found[variant] = ToyPrediction(
            torch.as_tensor(arrays["f_mean"]),
            std,
            (std.square() + float(arrays["noise_std"]) ** 2).sqrt(),
            json.loads((run_dir / METRICS_FILE).read_text()),
        )
    if not found:
        raise ResultsError(f"no finished run below {folder} has predictive.npz (trainer.save_predictive: true)")
    order = [v for v in VARIANTS if v in found] + sorted(v for v in found if v not in VARIANTS)
    return {v: found[v] for v in order}, data_cfg or {}


def plot_runs(
    folder: Path, out: Path, variants: Sequence[str] | None = None, title: str | None = None
) -> tuple[Path, pd.DataFrame]:
    """Fig. 4 (or, with its ``title``, another toy figure) from the finished runs below ``folder``
    (:func:`read_runs`); the training points are redrawn from the runs' ``data`` config. Returns the PNG and
    the :func:`spread_table` of the runs."""
    predictions, data_cfg = read_runs(folder, variants)
    x_train, y_train, x_grid = raw_data(data_cfg)
    png = _plot(out, predictions, x_train, y_train, x_grid, title)
    return png, spread_table(predictions, x_grid, float(data_cfg.get("train_bound", 4.0)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bdl_bench.studies.def_toy", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/def_toy_figure"))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated def_toy variants")
    parser.add_argument("--from-runs", type=Path, help="draw from the finished runs below this folder (runs nothing)")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides applied to every variant (e.g. trainer.n_epochs=500)"
    )
    ns = parser.parse_args(argv)
    if ns.from_runs is not None:
        print(f"figure → {plot_runs(ns.from_runs, ns.out / 'def_toy.png', ns.variants.split(','))[0]}")
        return
    png, csv = run_study(ns.out, ns.variants.split(","), ns.overrides)
    print(pd.read_csv(csv).to_string(index=False))
    print(f"figure → {png}\ntable → {csv}")


if __name__ == "__main__":
    main()
