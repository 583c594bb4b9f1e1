"""The effect of the number of test samples on a table's metrics (#38: DEF Table 1 used 1,000 samples, more than
a CPU affords): per column, the metrics each run reports from its first k samples (``trainer.test_mc_prefixes``,
``<metric>_s<k>`` in ``metrics.json``) beside those from all of its ``trainer.n_test_mc_samples``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from bdl_bench.errors import ResultsError
from bdl_bench.report.tables import markdown, mean_se

PREFIX = re.compile(r"^(?P<metric>.+)_s(?P<k>\d+)$")


def sample_count_table(folder: Path, metrics: Sequence[str]) -> tuple[pd.DataFrame, str]:
    """One row per dataset, column and sample count: the mean ± SE over the column's runs of each of ``metrics``
    from the first k samples (every k the runs report) and from all of them."""
    from bdl_bench.report.plots import labelled_runs

    runs = labelled_runs(folder)
    counts = sorted({int(m["k"]) for c in runs.columns if (m := PREFIX.match(c)) and m["metric"] in metrics})
    if not counts:
        raise ResultsError(
            f"no run below {folder} reports {', '.join(metrics)} from fewer samples: run with "
            "trainer.test_mc_prefixes=[k, ...] (k below trainer.n_test_mc_samples)"
        )
    rows = []
    for (dataset, label), group in runs.groupby(["dataset", "label"], sort=True):
        full = int(group["trainer.n_test_mc_samples"].iloc[0])
        for k in [*counts, full]:
            suffix = "" if k == full else f"_s{k}"
            if any(f"{m}{suffix}" not in group or group[f"{m}{suffix}"].isna().all() for m in metrics):
                continue
            row = {"dataset": dataset, "method": label, "n_samples": k, "n_runs": len(group)}
            for metric in metrics:
                values = group[f"{metric}{suffix}"].astype(float)
                row[metric] = values.mean()
                row[f"{metric}_se"] = values.std(ddof=1) / len(values) ** 0.5 if len(values) > 1 else float("nan")
            rows.append(row)
    table = pd.DataFrame(rows)
    headers = ["dataset", "column", "test samples", "runs", *metrics]
    cells = [
        [r["dataset"], str(r["method"]), str(r["n_samples"]), str(r["n_runs"])]
        + [mean_se(r[m], r[f"{m}_se"], 4) for m in metrics]
        for r in rows
    ]
    note = (
        "\n\nEach run's metrics from its first k test samples (trainer.test_mc_prefixes) and from all of them: the "
        "samples are independent, so the first k are what a run with k samples would have drawn. A column whose "
        "metrics hardly move between the counts is not limited by the sample count."
    )
    return table, markdown(headers, cells) + note
