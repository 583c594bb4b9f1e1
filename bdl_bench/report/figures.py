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
    "weight_samples",
    "step_records",
)
KTIED_KINDS = KINDS[-3:]  # k-tied Fig. 3, Table 2 / Fig. 6 left, Fig. 6 right / Fig. 7 (bdl_bench.report.ktied)


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
    from bdl_bench.report import plots

    name, kind = spec.get("name"), spec.get("kind")
    if not name or kind not in KINDS:
        raise ValueError(f"a figure needs a name and a kind in {KINDS}; got {dict(spec)}")
    out = out_dir / f"{name}.png"
    methods = list(spec["methods"]) if spec.get("methods") else None
    if kind == "convergence":
        return Drawn(plots.plot_convergence(folder, out, methods), spec)
    if kind == "covariance":
        png, table = plots.plot_covariance(
            folder, out, spec.get("dataset"), int(spec.get("split", 0)), methods, int(spec.get("max_dim", 64))
        )
        cells = [[row[0], *(f"{v:.3f}" for v in row[1:])] for row in table.itertuples(index=False)]
        text = markdown(["method", "off-diagonal error", "mean error", "variance ratio", "variance corr."], cells)
        return Drawn(png, spec, table, text)
    if kind == "def_toy":
        from bdl_bench.studies.def_toy import plot_runs

        return Drawn(plot_runs(folder, out, methods), spec)
    if kind in KTIED_KINDS:
        return _ktied(spec, folder, out)
    if kind == "def_ranks":  # DEF Table 2: a table, no PNG
        from bdl_bench.report.def_ranks import def_ranks_table

        table, text = def_ranks_table(folder, str(spec.get("in_domain", "mnist")))
        return Drawn(None, spec, table, text)
    if kind == "hessian_blocks":  # DEF Fig. 9
        from bdl_bench.report.def_hessian import plot_runs as plot_blocks

        png, table, text = plot_blocks(
            folder,
            out,
            method=str(spec.get("method", "map")),
            layer=int(spec.get("layer", 0)),
            curvature=str(spec.get("curvature", "ggn")),
        )
        return Drawn(png, spec, table, text)
    if kind == "laplace_search":  # DEF Fig. 10
        from bdl_bench.report.def_search import plot_runs as plot_search

        structures = [str(s) for s in spec.get("structures", ("diag", "kfac"))]
        png, table, text = plot_search(folder, out, structures)
        return Drawn(png, spec, table, text)
    if kind == "layer_covariance":  # DEF Fig. 8
        from bdl_bench.report.layer_covariance import plot_runs as plot_layer_covariance

        png, table, text = plot_layer_covariance(folder, out, methods or ["kfac", "kfac_okf"])
        return Drawn(png, spec, table, text)
    if kind == "frobenius":
        from bdl_bench.report.frobenius import markdown_table
        from bdl_bench.report.frobenius import plot_runs as plot_frobenius

        png, table = plot_frobenius(
            folder,
            out,
            method=str(spec.get("method", "map")),
            layer=int(spec.get("layer", 0)),
            curvature=str(spec.get("curvature", "ggn")),
            n_samples=int(spec.get("n_samples", 16)),
        )
        return Drawn(png, spec, table, markdown_table(table))
    from bdl_bench.report.ood_plots import plot_runs

    return Drawn(plot_runs(folder, out, grouping=str(spec.get("grouping", "test"))), spec)


def _ktied(spec: Mapping[str, Any], folder: Path, out: Path) -> Drawn:
    from bdl_bench.report import ktied

    if spec["kind"] == "std_spectra":
        png, table, text = ktied.std_spectra(folder, out)
    elif spec["kind"] == "step_records":
        steps = [int(s) for s in spec.get("steps", (1000, 5000, 9000))]
        png, table, text = ktied.step_records(folder, out, steps, str(spec.get("snr_column", "grad_snr_l2")))
    else:  # weight_samples: a table without a PNG of its own
        ranks = [int(r) for r in spec.get("ranks", ())]
        table, text = ktied.weight_samples(folder, ranks, str(spec["paper"]), spec.get("samples"))
        png = None
    return Drawn(png, spec, table, text)


def draw_figures(specs: Sequence[Mapping[str, Any]], folder: Path) -> tuple[list[Drawn], list[str]]:
    """Every figure of ``specs`` into ``folder``: the figures drawn, and one line per figure skipped (why)."""
    drawn, skipped = [], []
    for spec in specs:
        try:
            drawn.append(draw_figure(spec, folder, folder))
        except ResultsError as error:
            skipped.append(f"{spec.get('name')}: {error}")
    return drawn, skipped
