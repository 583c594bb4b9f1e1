"""``trainer.test_mc_prefixes``: a run also reports its test and OOD metrics from the first k of its test
samples (the effect of the sample count, DEF Table 1's 1,000 samples, at the cost of one run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bdl_bench.config_checks import check_config
from bdl_bench.data.base import Dataset
from bdl_bench.errors import ConfigError, ResultsError
from bdl_bench.likelihoods import Categorical
from bdl_bench.metrics import ood_metrics, predictive_metrics
from bdl_bench.orchestration.evaluation import prefix_metrics
from bdl_bench.orchestration.runner import run
from bdl_bench.report.sample_count import sample_count_table
from bdl_bench.results import config_hash


def test_prefix_metrics_are_those_of_the_first_k_samples_alone() -> None:
    y = torch.tensor([0, 1, 2, 0])
    right = 8.0 * torch.nn.functional.one_hot(y, 3).float()  # confident and right
    wrong = 8.0 * torch.nn.functional.one_hot((y + 1) % 3, 3).float()  # confident and wrong
    f_test = torch.stack([right, right, wrong, wrong, wrong])  # (S = 5, N = 4, 3)
    f_ood = torch.stack([right, right, wrong, right, wrong])
    x, empty = torch.zeros(4, 1), torch.zeros(0, 1)
    data = Dataset("toy", "classification", x, y, empty, y[:0], x, y, n_classes=3)
    likelihood = Categorical()
    method = object()  # prefix_metrics asks it only for closed-form regression moments
    got = prefix_metrics(method, likelihood, data, f_test, f_ood, 2)  # type: ignore[arg-type]
    assert got["accuracy_s2"] == 1.0 and got["ece_s2"] < 0.01  # the first two samples are right
    assert predictive_metrics(likelihood, f_test, y)["accuracy"] == 0.0  # all five: wrong on every point
    assert got["ood_entropy_mean_s2"] == pytest.approx(
        ood_metrics(likelihood.probs(f_test[:2]), likelihood.probs(f_ood[:2]))["ood_entropy_mean"]
    )
    assert set(got) == {f"{k}_s2" for k in predictive_metrics(likelihood, f_test, y)} | {
        f"{k}_s2" for k in ood_metrics(likelihood.probs(f_test), likelihood.probs(f_ood))
    }


def test_a_prefix_must_be_fewer_samples_than_the_run_draws(compose_cfg) -> None:
    check_config(compose_cfg(["+trainer.test_mc_prefixes=[1,2]"]))  # the smoke trainer draws 5
    for bad in ("[5]", "[0]", "[2.5]"):
        with pytest.raises(ConfigError, match=r"trainer.test_mc_prefixes=.*n_test_mc_samples - 1 = 4"):
            check_config(compose_cfg([f"trainer.test_mc_prefixes={bad}"]))


def test_the_null_default_leaves_earlier_runs_hashes_as_they_were(compose_cfg) -> None:
    config = OmegaConf.to_container(compose_cfg([]), resolve=True)
    assert config["trainer"]["test_mc_prefixes"] is None
    before = {**config, "trainer": {k: v for k, v in config["trainer"].items() if k != "test_mc_prefixes"}}
    assert config_hash(config) == config_hash(before)
    with_prefixes = {**config, "trainer": {**config["trainer"], "test_mc_prefixes": [2]}}
    assert config_hash(with_prefixes) != config_hash(config)


def test_a_run_reports_its_metrics_at_each_prefix_and_the_table_shows_them(compose_cfg, tmp_path: Path) -> None:
    overrides = ["method=bbb", "model=logreg", "data=libsvm/australian", "trainer.test_mc_prefixes=[1,3]"]
    runs = [run(compose_cfg([*overrides, f"trainer.seed={seed}"]), tmp_path / f"seed{seed}") for seed in (0, 1)]
    metrics = runs[0].metrics
    for k in (1, 3):
        assert {f"accuracy_s{k}", f"nll_s{k}", f"ece_s{k}"} <= set(metrics)
    assert metrics["nll_s1"] != metrics["nll_s3"] != metrics["nll"]  # different draws, different estimates
    table, text = sample_count_table(tmp_path, ["nll", "accuracy"])
    assert list(table["n_samples"]) == [1, 3, 5] and set(table["n_runs"]) == {2}  # the smoke trainer draws 5
    both = [r.metrics for r in runs]
    assert table["nll"].tolist() == pytest.approx([sum(m[f"nll{s}"] for m in both) / 2 for s in ("_s1", "_s3", "")])
    assert "| australian | bbb | 3 | 2 |" in text
    with pytest.raises(ResultsError, match=r"trainer.test_mc_prefixes"):
        sample_count_table(tmp_path, ["ood_entropy_mean"])
