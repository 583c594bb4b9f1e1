"""The figures an experiment's ``reproduce`` draws beside its table (the experiment's ``figures`` list).

Each entry names a PNG and one of ``bdl-bench plot``'s kinds with its options, e.g. SLANG Fig. 4 (left)::

    figures:
      - {name: fig4_left, kind: convergence, methods: [slang_L1, slang_L5, slang_L10, mf_hess, full_hess]}
      - {name: fig1, kind: covariance, dataset: usps_3vs5, split: 0, methods: [full_exact, slang_L1, mf_exact]}
      - {name: def_toy, kind: def_toy}   # DEF Fig. 4 from the runs' predictive.npz (bdl_bench.studies.def_toy)

A figure whose runs are not there yet (a sweep restricted to some datasets) is skipped with its reason, so a
partial reproduction still gets its table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bdl_bench.errors import ResultsError

KINDS = ("convergence", "covariance", "ood", "def_toy")


def draw_figure(spec: Mapping[str, Any], folder: Path, out_dir: Path) -> Path:
    """Draw one ``figures`` entry from the runs below ``folder`` into ``out_dir/<name>.png``.

    Raises:
        ResultsError: when the runs it needs are not there.
        ValueError: for an unknown kind or a missing name.
    """
    from bdl_bench.report import plots

    name, kind = spec.get("name"), spec.get("kind")
    if not name or kind not in KINDS:
        raise ValueError(f"a figure needs a name and a kind in {KINDS}; got {dict(spec)}")
    out = out_dir / f"{name}.png"
    methods = list(spec["methods"]) if spec.get("methods") else None
    if kind == "convergence":
        return plots.plot_convergence(folder, out, methods)
    if kind == "covariance":
        return plots.plot_covariance(
            folder, out, spec.get("dataset"), int(spec.get("split", 0)), methods, int(spec.get("max_dim", 64))
        )
    if kind == "def_toy":
        from bdl_bench.studies.def_toy import plot_runs

        return plot_runs(folder, out, methods)
    from bdl_bench.report.ood_plots import plot_uncertainty
    from bdl_bench.results import find_run_dirs

    run_dirs = [d for d in find_run_dirs(folder) if (d / "uncertainty.npz").exists()]
    if not run_dirs:
        raise ResultsError(f"no run below {folder} has uncertainty.npz (runs with an OOD set)")
    return plot_uncertainty(run_dirs, out)


def draw_figures(specs: Sequence[Mapping[str, Any]], folder: Path) -> tuple[list[Path], list[str]]:
    """Every figure of ``specs`` into ``folder``: the PNGs drawn, and one line per figure skipped (why)."""
    drawn, skipped = [], []
    for spec in specs:
        try:
            drawn.append(draw_figure(spec, folder, folder))
        except ResultsError as error:
            skipped.append(f"{spec.get('name')}: {error}")
    return drawn, skipped
