r"""DEF Fig. 1 (Lee et al. 2020, "Main idea") on one layer of a finished network (the figure kind
``information_form``):

(a) the layer's covariance :math:`\Sigma = (N\,\mathbf I + \tau\,\mathbb 1)^{-1}` under its exact information
    block :math:`\mathbf I` (weights and biases, the "block" Laplace of the paper's Fig. 4);
(b) the sorted eigenvalues of :math:`\mathbf I`, the paper's insight that they are sparse: a few carry nearly all
    of it;
(c) :math:`\mathbf I` beside DEF's sparse information form (eq. 8: Alg. 1's top-K Kronecker-preserving low-rank
    part of EFB plus eq. 5's exact diagonal), with the normalised Frobenius errors of Fig. 5.

The block is the mean curvature over the first ``n_examples`` training examples (``exact_blocks``), N and
:math:`\tau` are those the run's Laplace column chose on validation (``scales_from``) or given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import Tensor

from bdl_bench.curvature.frobenius import block_approximations, def_information
from bdl_bench.curvature.kron import eigenbasis
from bdl_bench.errors import ResultsError
from bdl_bench.report.frobenius import markdown_table, run_layer_curvature
from bdl_bench.report.plots import save_figure
from bdl_bench.report.tables import markdown, run_configs
from bdl_bench.results import METRICS_FILE

TRACE_SHARE = 0.99  # (b): how many of the largest eigenvalues hold this share of the trace
SMALL = 1e-2  # (b): eigenvalues below this fraction of the largest count as near zero


def spectrum_summary(eigenvalues: Tensor) -> dict[str, float]:
    """(b)'s numbers for the eigenvalues of a PSD matrix: their count ``P``, how many are below :data:`SMALL` of
    the largest, and how many of the largest hold :data:`TRACE_SHARE` of the trace (also as fractions of P)."""
    values = eigenvalues.double().clamp_min(0).sort(descending=True).values
    share = values.cumsum(0) / values.sum()
    n_top = int((share < TRACE_SHARE).sum()) + 1
    n_small = int((values < SMALL * values[0]).sum())
    p = values.numel()
    return {"n_params": p, "n_small": n_small, "frac_small": n_small / p, "n_trace": n_top, "frac_trace": n_top / p}


def _chosen_scales(folder: Path, structure: str) -> tuple[float, float]:
    """(N, τ) of the finished Laplace run of ``structure`` below ``folder``: those its search chose, else its
    fixed ``method.dataset_scale`` and ``method.prior_precision``."""
    for run_dir, config in run_configs(folder, METRICS_FILE):
        method = config.get("method") or {}
        if method.get("name") != "laplace" or method.get("structure") != structure:
            continue
        metrics = json.loads((run_dir / METRICS_FILE).read_text())
        n = metrics.get("chosen_dataset_scale") or method.get("dataset_scale")
        tau = metrics.get("chosen_prior_precision") or method.get("prior_precision") or config.get("prior_precision")
        if n is None or tau is None:
            raise ResultsError(f"{run_dir} records no dataset scale N and prior precision tau")
        return float(n), float(tau)
    raise ResultsError(f"no finished Laplace run with structure {structure} below {folder} (its N and tau draw (a))")


def information_form(folder: Path, spec: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the figure shows, from the finished ``spec['method']`` run below ``folder``: the block, its
    eigenvalues, DEF's form at ``spec['rank']``, the covariance, the spectrum summary and the error table."""
    method = str(spec.get("method", "map"))
    runs = [d for d, c in run_configs(folder, METRICS_FILE) if (c.get("method") or {}).get("name") == method]
    if not runs:
        raise ResultsError(f"no finished {method} run below {folder} (the figure is computed at its parameters)")
    if "scales_from" in spec:
        n, tau = _chosen_scales(folder, str(spec["scales_from"]))
    else:
        n, tau = float(spec["dataset_scale"]), float(spec["prior_precision"])
    layer, rank = int(spec.get("layer", 0)), int(spec["rank"])
    block, factors, config, n_examples = run_layer_curvature(
        runs[0],
        layer=layer,
        curvature=str(spec.get("curvature", "ggn")),
        n_examples=spec.get("n_examples"),
        batch_size=spec.get("batch_size"),
        dtype=getattr(torch, str(spec.get("dtype", "float64"))),
    )
    eigenvalues = torch.linalg.eigvalsh(block)
    def_matrix, kept = def_information(block, eigenbasis([factors])[0], rank)
    covariance = torch.linalg.inv(n * block + tau * torch.eye(block.shape[0], dtype=block.dtype))
    table = block_approximations(block, factors, [rank]).assign(n_runs=1)
    return {
        "block": block,
        "eigenvalues": eigenvalues,
        "def": def_matrix,
        "kept": kept,
        "rank": rank,
        "covariance": covariance,
        "scales": (n, tau),
        "layer": layer,
        "n_examples": n_examples,
        "summary": spectrum_summary(eigenvalues),
        "table": table,
        "model": (config.get("model") or {}).get("name", "the model"),
    }


def _heatmap(fig: Figure, ax, matrix: Tensor, title: str, vmax: float) -> None:
    image = ax.imshow(matrix.cpu().numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03)


def _off_diagonal_scale(matrix: Tensor) -> float:
    """The colour limit of a heatmap: the 99.5th percentile of the off-diagonal magnitudes (the diagonal would
    wash the off-diagonal structure out; entries beyond it are drawn at the limit)."""
    off = matrix[~torch.eye(matrix.shape[0], dtype=torch.bool)].abs()
    return float(torch.quantile(off.float()[:: max(1, off.numel() // 10**6)], 0.995)) or 1.0


def plot(form: Mapping[str, Any], path: Path) -> Path:
    """Fig. 1's three ideas in four panels: (a) Σ, (b) the spectrum of I, (c) I and DEF's form of it."""
    fig = Figure(figsize=(18, 4.4))
    axes = fig.subplots(1, 4)
    n, tau = form["scales"]
    _heatmap(
        fig,
        axes[0],
        form["covariance"],
        f"(a) covariance Σ = (N·I + τ)⁻¹\nN = {n:.3g}, τ = {tau:.3g}",
        _off_diagonal_scale(form["covariance"]),
    )
    values = form["eigenvalues"].clamp_min(0).sort(descending=True).values.cpu().numpy()
    summary = form["summary"]
    axes[1].semilogy(np.arange(1, values.size + 1), np.maximum(values, values[0] * 1e-12), color="tab:blue")
    axes[1].axvline(summary["n_trace"], color="tab:gray", ls=":", label=f"{TRACE_SHARE:.0%} of the trace")
    axes[1].axvline(form["kept"], color="tab:red", ls="--", label=f"DEF keeps L = {form['kept']} (K = {form['rank']})")
    axes[1].axhline(values[0] * SMALL, color="tab:orange", ls="-.", lw=0.8, label=f"{SMALL:.0%} of the largest")
    axes[1].set(xlabel="eigenvalue index (descending)", ylabel="eigenvalue of I")
    axes[1].set_title(
        f"(b) spectrum of I: {summary['n_trace']} of {summary['n_params']} hold {TRACE_SHARE:.0%} of the trace,\n"
        f"{summary['n_small']} below {SMALL:.0%} of the largest",
        fontsize=9,
    )
    axes[1].legend(fontsize=7)
    scale = _off_diagonal_scale(form["block"])
    def_row = form["table"][form["table"]["method"] == "DEF"].iloc[0]
    _heatmap(fig, axes[2], form["block"], "(c) information matrix I (exact block)", scale)
    _heatmap(
        fig,
        axes[3],
        form["def"],
        f"(c) DEF: top-{form['kept']} low rank + exact diagonal\n"
        f"error off-diagonal {def_row['err_offdiag']:.2f}, overall {def_row['err_total']:.2f}",
        scale,
    )
    fig.suptitle(
        f"Weight layer {form['layer']} of the {form['model']} (weights and biases, P = {summary['n_params']}), "
        f"GGN over {form['n_examples']} training images; colours clipped at the 99.5th percentile of the "
        "off-diagonal (cf. Lee et al. 2020, Fig. 1)",
        fontsize=10,
    )
    fig.tight_layout()
    return save_figure(fig, path)


def plot_runs(folder: Path, out: Path, spec: Mapping[str, Any]) -> tuple[Path, pd.DataFrame, str]:
    """The figure from the runs below ``folder`` into ``out``: (png, the error table, its Markdown with the
    spectrum's numbers above it)."""
    form = information_form(folder, spec)
    png = plot(form, out)
    s = form["summary"]
    spectrum = markdown(
        [
            "P",
            "examples",
            f"eigenvalues below {SMALL:.0%} of the largest",
            f"eigenvalues holding {TRACE_SHARE:.0%} of the trace",
        ],
        [
            [
                str(s["n_params"]),
                str(form["n_examples"]),
                f"{s['n_small']} ({s['frac_small']:.1%})",
                f"{s['n_trace']} ({s['frac_trace']:.1%})",
            ]
        ],
    )
    table = form["table"]
    for key in ("n_params", "n_small", "n_trace"):
        table[key] = s[key]
    return png, table, spectrum + "\n\n" + markdown_table(table)
