"""k-tied Fig. 6 right from the runs' steps.csv: mean and SEM over seeds at the paper's steps, beside the paper's."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from bdl_bench.errors import ResultsError
from bdl_bench.report.ktied import step_records

MNIST_MLP = {"data": {"name": "vision/mnist"}, "model": {"name": "mlp"}}


def _run(root: Path, method: dict, seed: int, snr: list[float], elbo: list[float], model: dict = MNIST_MLP) -> None:
    folder = root / f"{method['name']}{method.get('k', '')}_seed{seed}"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"method": method, "trainer": {"seed": seed}, **model}))
    (folder / "metrics.json").write_text(json.dumps({"accuracy": 0.9}))
    steps = {"step": [1000, 2000, 5000], "val_neg_elbo": elbo, "grad_snr_l2": snr}
    pd.DataFrame(steps).to_csv(folder / "steps.csv", index=False)


def test_step_records_average_the_seeds_at_the_paper_steps(tmp_path: Path) -> None:
    _run(tmp_path, {"name": "gmfvi"}, 0, [4.0, 4.2, 4.4], [42.0, 35.0, 26.5])
    _run(tmp_path, {"name": "gmfvi"}, 1, [4.2, 4.4, 4.6], [42.2, 35.2, 26.5])
    _run(tmp_path, {"name": "ktied", "k": 2}, 0, [7000.0, 500.0, 140.0], [42.7, 20.0, 14.0])
    png, table, text = step_records(tmp_path, tmp_path / "fig6_right.png", [1000, 5000, 9000])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(zip(table["step"], table["method"])) == [
        (1000, "2_tied"),
        (1000, "mean_field"),
        (5000, "2_tied"),
        (5000, "mean_field"),
    ]  # step 2000 is not one of the paper's; nobody reached 9000
    mean_field = table[(table["method"] == "mean_field") & (table["step"] == 1000)].iloc[0]
    assert mean_field["n_runs"] == 2 and mean_field["snr"] == pytest.approx(4.1)
    assert mean_field["snr_se"] == pytest.approx(0.1)  # sample std 0.1414 over sqrt(2)
    assert mean_field["paper_snr"] == 4.13 and bool(mean_field["agrees_snr"])
    assert mean_field["paper_val_neg_elbo"] == 42.16 and bool(mean_field["agrees_val_neg_elbo"])
    tied = table[(table["method"] == "2_tied") & (table["step"] == 5000)].iloc[0]
    assert tied["paper_snr"] == 140 and bool(tied["agrees_snr"])  # one run: its value, the paper's SEM only
    assert "| 5000 | 2-tied | 1 | 140.00 | 140.00 ± 11.00 | yes |" in text
    with pytest.raises(ResultsError, match="any of the steps"):
        step_records(tmp_path, tmp_path / "x.png", [7])


def test_step_records_of_another_model_have_no_paper_values_and_models_are_not_mixed(tmp_path: Path) -> None:
    """Fig. 6 right's numbers are the MNIST MLP's: a CIFAR-100 CNN's records are printed without them, and a folder
    whose runs train different models is refused rather than averaged."""
    cnn = {"data": {"name": "vision/cifar100"}, "model": {"name": "cnn_ktied"}}
    _run(tmp_path / "cnn", {"name": "gmfvi"}, 0, [4.0, 4.2, 4.4], [42.0, 35.0, 26.5], cnn)
    _, table, text = step_records(tmp_path / "cnn", tmp_path / "cnn.png", [1000])
    assert table["paper_snr"].isna().all() and table["paper_val_neg_elbo"].isna().all()
    assert table["dataset"].tolist() == ["cifar100"] and "| 1000 | mean-field | 1 | 4.00 | – |" in text
    _run(tmp_path / "cnn", {"name": "gmfvi"}, 1, [4.0, 4.2, 4.4], [42.0, 35.0, 26.5])
    with pytest.raises(ResultsError, match="different models"):
        step_records(tmp_path / "cnn", tmp_path / "x.png", [1000])
