"""The figures (and computed tables) an experiment's ``reproduce`` draws beside its table: its ``figures`` list,
each entry a name and one of :data:`KINDS` with its options (``docs/reproducing.md``). A figure whose runs are not
there yet is skipped with its reason."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from bdl_bench.errors import ResultsError
from bdl_bench.report.tables import markdown

KINDS = (
    "convergence",
    "covariance",
    "ood",
    "def_toy",
    "frobenius",
    "def_ranks",
    "hessian_blocks",
    "laplace_search",
    "layer_covariance",
    "std_spectra",
    "std_heatmaps",
    "weight_samples",
    "step_records",
    "sample_count",
    "information_form",
)


@dataclass(frozen=True)
class Drawn:
    """A drawn figure: its PNG, and the numbers it shows where its kind computes them (``frobenius``)."""

    png: Path | None  # None for a kind that computes a table only (``weight_samples``)
    spec: Mapping[str, Any]
    table: pd.DataFrame | None = None
    table_markdown: str | None = None  # ``table`` as reproduce.md shows it

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def is_table(self) -> bool:
        """Whether the spec makes this figure's numbers the reproduction's table (``table: true``)."""
        return self.table is not None and bool(self.spec.get("table"))


def draw_figure(spec: Mapping[str, Any], folder: Path, out_dir: Path) -> Drawn:
    """Draw one ``figures`` entry from the runs below ``folder`` into ``out_dir/<name>.png`` (a
    :class:`ResultsError` when the runs it needs are not there)."""
    name, kind = spec.get("name"), spec.get("kind")
    if not name or kind not in KINDS:
        raise ValueError(f"a figure needs a name and a kind in {KINDS}; got {dict(spec)}")
    png, table, text = _draw(str(kind), spec, folder, out_dir / f"{name}.png")
    return Drawn(png, spec, table, text)


def _draw(kind: str, spec: Mapping[str, Any], folder: Path, out: Path) -> tuple[Path | None, Any, str | None]:
    """``(png, table, table_markdown)`` of one figure (as :class:`Drawn` holds them)."""
    from bdl_bench.report import (
        def_hessian,
        def_ranks,
        def_search,
        frobenius,
        information_form,
        ktied,
        layer_covariance,
        ood_plots,
        plots,
        sample_count,
    )
    from bdl_bench.studies import def_toy

    methods = list(spec["methods"]) if spec.get("methods") else None
    # the block of a run's information matrix that hessian_blocks and frobenius show
    block = dict(
        method=str(spec.get("method", "map")),
        layer=int(spec.get("layer", 0)),
        curvature=str(spec.get("curvature", "ggn")),
    )
    if kind == "convergence":
        split = None if spec.get("split") is None else int(spec["split"])
        test_loss = str(spec.get("test_loss", "nll"))
        return plots.plot_convergence(folder, out, methods, split, test_loss), None, None
    if kind == "covariance":
        png, table = plots.plot_covariance(
            folder, out, spec.get("dataset"), int(spec.get("split", 0)), methods, int(spec.get("max_dim", 64))
        )
        cells = [[row[0], *(f"{v:.3f}" for v in row[1:])] for row in table.itertuples(index=False)]
        text = markdown(["method", "off-diagonal error", "mean error", "variance ratio", "variance corr."], cells)
        return png, table, text
    if kind == "def_toy":  # DEF Fig. 4, SLANG App. F.1
        png, table = def_toy.plot_runs(folder, out, methods, spec.get("title"))
        cells = [[row[0], *(f"{v:.3g}" for v in row[1:])] for row in table.itertuples(index=False)]
        return png, table, markdown(list(table.columns), cells)
    conv = bool(spec.get("conv", False))  # k-tied: study the convolutions' std matrices too (ResNet-18, Fig. 5)
    if kind == "std_spectra":  # k-tied Fig. 3, Fig. 5 top
        return ktied.std_spectra(folder, out, conv=conv)
    if kind == "std_heatmaps":  # k-tied Fig. 4
        ranks = [int(r) for r in spec.get("ranks", (1, 2))]
        return ktied.std_heatmaps(folder, out, str(spec.get("matrix", "dense 1")), ranks)
    if kind == "step_records":  # k-tied Fig. 6 right / Fig. 7
        steps = [int(s) for s in spec.get("steps", (1000, 5000, 9000))]
        return ktied.step_records(folder, out, steps, str(spec.get("snr_column", "grad_snr_l2")))
    if kind == "weight_samples":  # k-tied Table 2, Fig. 5 bottom, Table 3, Fig. 6 left: a table, no PNG of its own
        ranks = [int(r) for r in spec.get("ranks", ())]
        return None, *ktied.weight_samples(folder, ranks, str(spec["paper"]), spec.get("samples"), conv=conv)
    if kind == "sample_count":  # the effect of the number of test samples: a table, no PNG
        metrics = [str(m) for m in spec.get("metrics", ("accuracy", "ece", "ood_entropy_mean"))]
        return None, *sample_count.sample_count_table(folder, metrics)
    if kind == "def_ranks":  # DEF Table 2: a table, no PNG
        return None, *def_ranks.def_ranks_table(folder, str(spec.get("in_domain", "mnist")))
    if kind == "hessian_blocks":  # DEF Fig. 9
        return def_hessian.plot_runs(folder, out, **block)
    if kind == "laplace_search":  # DEF Fig. 10
        return def_search.plot_runs(folder, out, [str(s) for s in spec.get("structures", ("diag", "kfac"))])
    if kind == "layer_covariance":  # DEF Fig. 8
        return layer_covariance.plot_runs(folder, out, methods or ["kfac", "kfac_okf"])
    if kind == "information_form":  # DEF Fig. 1
        return information_form.plot_runs(folder, out, spec)
    if kind == "frobenius":  # DEF Fig. 5
        png, table = frobenius.plot_runs(folder, out, **block, n_samples=int(spec.get("n_samples", 16)))
        return png, table, frobenius.markdown_table(table)

    return ood_plots.plot_runs(folder, out, grouping=str(spec.get("grouping", "test"))), None, None


def draw_figures(specs: Sequence[Mapping[str, Any]], folder: Path) -> tuple[list[Drawn], list[str]]:
    """Every figure of ``specs`` into ``folder``: the figures drawn, and one line per figure skipped (why)."""
    drawn, skipped = [], []
    for spec in specs:
        try:
            drawn.append(draw_figure(spec, folder, folder))
        except ResultsError as error:
            skipped.append(f"{spec.get('name')}: {error}")
    return drawn, skipped
