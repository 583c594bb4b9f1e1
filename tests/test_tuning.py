"""Hyperparameter search: an Optuna study (hydra-optuna-sweeper) on a validation split beats the
default, and a test run with ``tuned_from`` takes its study's best values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bdl_bench.runner import run
from bdl_bench.tuning import apply_tuned, override_dirname

CONF = Path(__file__).resolve().parents[1] / "conf"
SETTINGS = (["experiment", "tune", "tuned_from", "force"], ",", "=")


def test_tune_config_searches_the_dataset_bounds_for_this_job_only() -> None:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "experiment=slang_table2",
                "tune=slang_table2_sweeper",
                "method=bbb",
                "data=uci/concrete",
                "data.split=3",
            ],
            return_hydra_config=True,
        )
    params = OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=True)
    assert params["noise_precision"] == "tag(log, interval(0.02472, 0.06721))"  # exp(-3.7), exp(-2.7)
    assert params["prior_precision"] == "tag(log, interval(0.1353, 7.389))"  # exp(-2), exp(2)
    # the experiment's sweep keys are pinned to the job, so a study never searches over them
    assert (params["method"], params["data"], params["data.split"]) == ("bbb", "uci/concrete", "3")
    assert cfg.data.val_fraction > 0 and cfg.hydra.sweeper.direction == "maximize"


def test_tuned_from_feeds_the_best_values_of_the_runs_own_study(tmp_path: Path, compose_cfg) -> None:
    overrides = ["method=map", "data.split=3", f"tuned_from={tmp_path}"]
    study = tmp_path / override_dirname(overrides, *SETTINGS)
    assert study.name == "data.split=3,method=map"
    cfg = compose_cfg(overrides)
    with pytest.raises(FileNotFoundError, match="no tuning results .*run the study first"):
        apply_tuned(cfg, overrides, SETTINGS)
    study.mkdir(parents=True)
    (study / "optimization_results.yaml").write_text(
        yaml.safe_dump({"name": "optuna", "best_params": {"noise_precision": 0.5, "prior_precision": 3.0}})
    )
    tuned = apply_tuned(cfg, overrides, SETTINGS)
    assert (tuned.noise_precision, tuned.prior_precision) == (0.5, 3.0)
    assert cfg.prior_precision == 1.0  # the input config is left alone


@pytest.mark.slow
def test_optuna_study_finds_a_better_than_default_value(tmp_path: Path, compose_cfg) -> None:
    job = [
        "experiment=slang_table2",
        "method=map",
        "data=uci/boston",
        "data.split=0",
        "trainer=smoke",
        "trainer.n_epochs=5",
    ]
    study = tmp_path / "study"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bdl_bench.cli",
            "run",
            "-m",
            "tune=slang_table2_sweeper",
            *job,
            "hydra.sweeper.n_trials=8",
        ]
        + ["data.protocol.search.noise_precision=[0.01,1.0]", f"hydra.sweep.dir={study}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "8 runs: 8 ran, 0 skipped (finished earlier), 0 failed" in out.stdout
    best = yaml.safe_load((study / "optimization_results.yaml").read_text())
    # the dataset's default precisions, scored on the same validation part
    default = run(compose_cfg([*job, "data.val_fraction=0.2"]), tmp_path / "default").metrics["val_test_ll"]
    assert best["best_value"] > default
    assert set(best["best_params"]) == {"noise_precision", "prior_precision"}
