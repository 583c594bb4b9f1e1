"""The runner: results folder contents, bad input, non-finite losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bdl_bench.methods.base import NonFiniteLossError
from bdl_bench.runner import run


def test_run_writes_config_history_and_metrics(tmp_path: Path, compose_cfg) -> None:
    cfg = compose_cfg(["method=map"])
    result = run(cfg, tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics == pytest.approx(result.metrics)
    assert {"rmse", "test_ll", "test_ll_joint", "nll", "train_time_s"} <= set(metrics)
    history = (tmp_path / "history.csv").read_text().splitlines()
    assert len(history) == 1 + cfg.trainer.n_epochs


def test_same_seed_is_bit_for_bit_repeatable(tmp_path: Path, compose_cfg) -> None:
    cfg = compose_cfg(["method=map"])
    a = run(cfg, tmp_path / "a").metrics
    b = run(cfg, tmp_path / "b").metrics
    assert a["rmse"] == b["rmse"] and a["test_ll"] == b["test_ll"]


def test_non_finite_loss_stops_without_metrics(tmp_path: Path, compose_cfg) -> None:
    cfg = compose_cfg(["method=map", "method.lr=1e30"])
    with pytest.raises(NonFiniteLossError, match=r"method 'map'.*epoch \d+, step \d+"):
        run(cfg, tmp_path)
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.split=20", "split"),
        ("prior_precision=0", "prior_precision must be positive, got 0"),
        ("noise_precision=-1", "noise_precision must be positive, got -1"),
        ("trainer.dtype=float16", "trainer.dtype='float16'"),
    ],
)
def test_bad_values_give_one_line_errors(tmp_path: Path, compose_cfg, override: str, message: str) -> None:
    cfg = compose_cfg(["method=map", override])
    with pytest.raises(ValueError, match=message) as info:
        run(cfg, tmp_path)
    assert "\n" not in str(info.value)
