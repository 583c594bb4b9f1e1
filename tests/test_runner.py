"""The runner: results folder contents, bad input, non-finite losses."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from _runs import without_cost

from bdl_bench.methods.base import NonFiniteLossError
from bdl_bench.orchestration.runner import run


def test_run_writes_config_history_and_metrics(tmp_path: Path, compose_cfg) -> None:
    cfg = compose_cfg(["method=map"])
    result = run(cfg, tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics == pytest.approx(result.metrics)
    assert {"rmse", "test_ll", "test_ll_joint", "nll", "train_time_s", "cpu_time_s", "peak_rss_mib"} <= set(metrics)
    # the cost: CPU seconds of the training (one thread: at most its wall time, plus clock granularity)
    assert 0 < metrics["cpu_time_s"] <= metrics["train_time_s"] + 0.5 and metrics["peak_rss_mib"] > 50
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
        ("prior_precision=0", "prior_precision=0 is out of range: it must be a number > 0"),
        ("noise_precision=-1", "noise_precision=-1 is out of range"),
        ("trainer.dtype=float16", "trainer.dtype='float16'"),
    ],
)
def test_bad_values_give_one_line_errors(tmp_path: Path, compose_cfg, override: str, message: str) -> None:
    cfg = compose_cfg(["method=map", override])
    with pytest.raises(ValueError, match=message) as info:
        run(cfg, tmp_path)
    assert "\n" not in str(info.value)


def test_authors_elbo_leaves_out_only_the_bias_log_prior_precision() -> None:
    import torch

    from bdl_bench.orchestration.evaluation import elbo_without_bias_logdet

    logreg = torch.nn.Sequential(torch.nn.Linear(3, 1))
    prior = torch.tensor([1.0, 1.0, 1.0, 1e-5])  # weights, then the bias (flat parameter order)
    # their -KL lacks 0.5 * log(1e-5) = -5.756: their ELBO is higher by 5.756 / N per example
    assert elbo_without_bias_logdet(-0.5, logreg, prior, 100) == pytest.approx(-0.5 + 0.5 * math.log(1e5) / 100)
    assert elbo_without_bias_logdet(-0.5, logreg, torch.ones(4), 100) == pytest.approx(-0.5)  # log 1 = 0
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    assert elbo_without_bias_logdet(-0.5, mlp, torch.ones(21), 100) is None


def test_logistic_regression_run_reports_the_authors_elbo(tmp_path: Path, compose_cfg) -> None:
    cfg = compose_cfg(["experiment=slang_table1", "data=libsvm/breast_cancer", "variant=slang_table1/mf_exact"])
    metrics = run(cfg, tmp_path / "run").metrics
    n_train = 341  # 683 points, 50/50 split
    assert metrics["elbo_no_bias_logdet"] - metrics["elbo"] == pytest.approx(0.5 * math.log(1e5) / n_train, rel=1e-3)


def test_the_elbo_in_chunks_equals_the_one_pass_value(tmp_path: Path, compose_cfg, monkeypatch) -> None:
    """Chunks of rows replay the generator, so every chunk sees the same posterior samples."""
    import bdl_bench.orchestration.evaluation as evaluation_module

    cfg = compose_cfg(["method=bbb", "data=uci/boston", "model=mlp", "trainer.checkpoint_every=0"])
    one_pass = run(cfg, tmp_path / "one").metrics["elbo"]
    monkeypatch.setattr(evaluation_module, "ELBO_CHUNK_ELEMENTS", 2 * 50 * 7)  # 7 rows of 2 samples x 50 units
    chunked = run(cfg, tmp_path / "chunked").metrics["elbo"]
    assert chunked == pytest.approx(one_pass, rel=1e-6)


def test_deterministic_mode_is_opt_in_and_gives_the_same_cpu_numbers(tmp_path: Path, compose_cfg, monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    overrides = ["method=map", "data=uci/boston", "trainer.checkpoint_every=0"]
    plain = run(compose_cfg(overrides), tmp_path / "plain").metrics
    assert not torch.are_deterministic_algorithms_enabled()  # opt-in: the default leaves PyTorch as it is
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        strict = run(compose_cfg([*overrides, "trainer.deterministic=true"]), tmp_path / "strict").metrics
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    plain, strict = without_cost(plain), without_cost(strict)
    assert strict == plain  # CPU, one thread: bit for bit either way


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=resnet18", "model.batch_norm=true", "method=map"], "is BatchNorm2d: batch statistics"),
        (["model=lenet", "model.dropout=0.5", "method=map"], r"Dropout\(p=0.5\), which only method=dropout samples"),
    ],
    ids=["batch_norm", "dropout_under_map"],
)
def test_modules_that_depend_on_the_training_mode_are_refused(overrides, message, tmp_path: Path, compose_cfg) -> None:
    """A batch-normalised network's prediction of an image would depend on its batch (and no method switches to
    running statistics); dropout modules outside method=dropout would draw torch's masks in every pass."""
    from bdl_bench.errors import ConfigError

    cfg = compose_cfg(["data=toy/cubic", *overrides, "trainer.n_epochs=1", "model.image_size=1"])
    with pytest.raises(ConfigError, match=message):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.json").exists()
