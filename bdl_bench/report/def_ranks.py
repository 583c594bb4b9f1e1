"""DEF Table 2 (Lee et al. 2020): per layer, the parameter dimension N and the rank L that DEF's low-rank reduction
keeps, from each DEF run's ``def_ranks.csv`` (``structure=def``), beside the paper's. The paper's N counts a
layer's weights only; our block also holds the bias column, and L = g x a is Alg. 1's kept grid over it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from bdl_bench.errors import ResultsError
from bdl_bench.methods.laplace.structures import DEF_RANKS_FILE
from bdl_bench.report.paper import read_paper_csv
from bdl_bench.report.tables import markdown, run_configs


def layer_names(kinds: list[str]) -> list[str]:
    """The paper's layer names: ``CNN-1``, ``CNN-2``, ... for convolutions, ``FC-1``, ... for dense layers."""
    counts = {"conv": 0, "linear": 0}
    names = []
    for kind in kinds:
        counts[kind] += 1
        names.append(f"{'CNN' if kind == 'conv' else 'FC'}-{counts[kind]}")
    return names


def def_ranks_table(folder: Path, in_domain: str = "mnist") -> tuple[pd.DataFrame, str]:
    """One row per layer and DEF run below ``folder``, with the paper's N and L of ``in_domain``."""
    paper = read_paper_csv("def_table2_ranks.csv")
    paper = paper[paper["in_domain"] == in_domain].set_index("layer")
    frames = []
    for run, config in run_configs(folder, DEF_RANKS_FILE):
        ranks = pd.read_csv(run / DEF_RANKS_FILE)
        ranks.insert(0, "layer", layer_names(list(ranks["kind"])))
        ranks.insert(0, "rank_k", config["method"].get("rank"))
        ranks["percent"] = 100 * ranks["kept_rank"] / ranks["n_weights"]
        ranks["paper_n"] = ranks["layer"].map(paper["n"])
        ranks["paper_l"] = ranks["layer"].map(paper["l"])
        ranks["paper_percent"] = ranks["layer"].map(paper["percent"])
        frames.append(ranks.assign(dataset=in_domain, method="def", n_runs=1))
    if not frames:
        raise ResultsError(f"no run below {folder} has {DEF_RANKS_FILE} (DEF runs, structure=def)")
    table = pd.concat(frames, ignore_index=True)
    headers = [
        "layer",
        "K",
        "N (weights)",
        "block m x n",
        "kept g x a",
        "L",
        "L / N %",
        "paper N",
        "paper L",
        "paper %",
    ]
    rows = [
        [r["layer"], _int(r["rank_k"]), str(r["n_weights"]), f"{r['m']} x {r['n']}", f"{r['g']} x {r['a']}"]
        + [str(r["kept_rank"]), f"{r['percent']:.2f}", _int(r["paper_n"]), _int(r["paper_l"]), _num(r["paper_percent"])]
        for r in table.to_dict("records")
    ]
    note = (
        "\n\nDEF Table 2: N the layer's weights (the paper's count; our block adds the bias column), L = g x a the "
        "kept rank of Alg. 1 for the run's K = method.rank per layer; the paper does not say how it chose its L."
    )
    return table, markdown(headers, rows) + note


def _int(value: object) -> str:
    return "–" if value is None or pd.isna(value) else str(int(value))


def _num(value: object) -> str:
    return "–" if value is None or pd.isna(value) else f"{float(value):.2f}"
