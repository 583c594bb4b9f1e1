"""``trainer.n_val_mc_samples``: the final validation metrics from their own number of posterior samples, or none
(DEF Table 1's validation set serves the Laplace search, whose scores the run reports; its 10k images at the test
count would be a third of each column's evaluation)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bdl_bench.config_checks import check_config
from bdl_bench.errors import ConfigError
from bdl_bench.orchestration.runner import run
from bdl_bench.results import config_hash

UCI_WITH_VAL = ["data=uci/yacht", "data.val_fraction=0.2", "trainer.n_epochs=3"]


def test_the_count_must_be_a_whole_number_from_zero(compose_cfg) -> None:
    for good in ("0", "3", "null"):
        check_config(compose_cfg([f"trainer.n_val_mc_samples={good}"]))
    for bad in ("-1", "2.5", "true"):
        with pytest.raises(ConfigError, match=r"trainer.n_val_mc_samples=.*whole number >= 0"):
            check_config(compose_cfg([f"trainer.n_val_mc_samples={bad}"]))


def test_the_null_default_leaves_earlier_runs_hashes_as_they_were(compose_cfg) -> None:
    config = OmegaConf.to_container(compose_cfg([]), resolve=True)
    assert config["trainer"]["n_val_mc_samples"] is None
    before = {**config, "trainer": {k: v for k, v in config["trainer"].items() if k != "n_val_mc_samples"}}
    assert config_hash(config) == config_hash(before)
    assert config_hash({**config, "trainer": {**config["trainer"], "n_val_mc_samples": 0}}) != config_hash(config)


@pytest.mark.parametrize("method", ["laplace", "bbb"])  # Laplace predicts all sets per sample; BBB set by set
def test_validation_metrics_follow_their_own_count(compose_cfg, tmp_path: Path, method: str) -> None:
    def metrics(name: str, *extra: str) -> dict[str, float]:
        return run(compose_cfg([f"method={method}", *UCI_WITH_VAL, *extra]), tmp_path / name).metrics

    default, none, two = (
        metrics("default"),
        metrics("none", "trainer.n_val_mc_samples=0"),
        metrics("two", "trainer.n_val_mc_samples=2"),
    )
    assert {"val_rmse", "val_test_ll"} <= set(default)
    assert not any(k.startswith("val_") for k in none)
    assert none["test_ll"] == default["test_ll"] == two["test_ll"]  # the test draws come first, unchanged
    sampled = "val_test_ll_mc" if method == "laplace" else "val_test_ll"  # Laplace's own is closed-form
    assert two[sampled] != default[sampled]  # 2 of the samples instead of the smoke trainer's 5
