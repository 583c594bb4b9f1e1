"""Hyperparameter search as stacked copies (bdl_bench/orchestration/search.py): batched BO, Gal's dropout protocol and
grid on tiny problems (yacht, 2 splits, 2 epochs), resuming after a kill, failed trials, bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from bdl_bench.errors import ConfigError, DataFileError
from bdl_bench.methods.dropout import MCDropout
from bdl_bench.orchestration.search import JOURNAL_FILE, SEARCH_DIR, TRIALS_FILE, read_spec, with_method_settings
from bdl_bench.orchestration.sweep import run_job
from bdl_bench.results import read_csv_exact

BO = ["search.n_random=2", "search.n_guided=2", "search.round_size=2"]
# the dropout grid of Gal's later experiment.py
GRID = "+search.grids.dropout={method.dropout_rate:dropout_rates.txt,noise_precision:tau_values.txt}"


def _cfg(compose_cfg, method: str, *extra: str):
    return compose_cfg(
        [f"method={method}", "data=uci/yacht", "data.split=[0,1]", "tune=slang_table2", "trainer.n_epochs=2", *extra]
    )


def _trials(job: Path) -> pd.DataFrame:
    return read_csv_exact(job / SEARCH_DIR / TRIALS_FILE)


def test_batched_search_beats_the_default_and_resumes_after_a_kill(tmp_path: Path, compose_cfg) -> None:
    # wide bounds around yacht's default precisions (noise 1.14, prior 1)
    bounds = ["search.params.noise_precision=[0.01,100]", "search.params.prior_precision=[0.01,100]"]
    cfg = _cfg(compose_cfg, "bbb", *BO, *bounds)
    run_job(cfg, tmp_path / "full")
    trials = _trials(tmp_path / "full")
    assert len(trials) == 8 and (trials["state"] == "COMPLETE").all()  # 2 splits x (2 random + 2 guided)
    # the default precisions, scored the same way (a stack of the splits on the same validation rows)
    run_job(
        compose_cfg(
            ["method=bbb", "data=uci/yacht", "data.split=[0,1]", "trainer.n_epochs=2", "data.val_fraction=0.2"]
        ),
        tmp_path / "default",
    )
    for split in (0, 1):
        best = trials[(trials["split"] == split) & trials["best"]].iloc[0]
        default_val = yaml.safe_load((tmp_path / "default" / f"split={split}" / "metrics.json").read_text())
        assert best["val_test_ll"] > default_val["val_test_ll"]
        # the test run holds the split's best values and trained on the whole training part
        config = yaml.safe_load((tmp_path / "full" / f"split={split}" / "config.yaml").read_text())
        assert config["noise_precision"] == pytest.approx(best["noise_precision"])
        assert config["prior_precision"] == pytest.approx(best["prior_precision"])
        assert config["data"]["val_fraction"] == 0.0
        assert (tmp_path / "full" / f"split={split}" / "search.csv").exists()
    # a kill after the second round's trials were asked and one of them told: cut the journal there
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "full", killed)
    lines = (killed / SEARCH_DIR / JOURNAL_FILE).read_text().splitlines()
    asks = [i for i, line in enumerate(lines) if '"ask"' in line]
    assert len(asks) == 2  # one line per round
    cut = asks[1] + 2  # round 2's asks and one tell
    (killed / SEARCH_DIR / JOURNAL_FILE).write_text("\n".join(lines[:cut]) + "\n")
    for split in (0, 1):
        shutil.rmtree(killed / f"split={split}")
    for trial_dir in (killed / SEARCH_DIR).glob("split=*/trial=00[23]"):
        if trial_dir != killed / SEARCH_DIR / "split=0" / "trial=002":  # the one told before the kill
            (trial_dir / "metrics.json").unlink()
    run_job(cfg, killed)
    resumed = _trials(killed)
    pd.testing.assert_frame_equal(resumed.drop(columns="val_test_ll"), trials.drop(columns="val_test_ll"))
    assert resumed["val_test_ll"].to_numpy() == pytest.approx(trials["val_test_ll"].to_numpy(), rel=1e-6)


def test_dropout_grid_picks_the_best_validation_cell_and_a_diverging_trial_fails(
    tmp_path: Path, compose_cfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = MCDropout.stack_step

    def diverge_at_rate_01(self, x, y):  # every trial with dropout rate 0.1 diverges
        out = step(self, x, y)
        out["loss"] = torch.where(self._rate_tensor == 0.1, torch.nan, out["loss"])
        return out

    monkeypatch.setattr(MCDropout, "stack_step", diverge_at_rate_01)
    run_job(_cfg(compose_cfg, "dropout", "~search.method_settings", GRID), tmp_path / "job")  # 2 epochs, not Gal's
    trials = _trials(tmp_path / "job")
    assert len(trials) == 2 * 4 * 3  # 2 splits x Gal's 4 rates x 3 taus for yacht
    failed = trials[trials["state"] == "FAIL"]
    assert set(failed["method.dropout_rate"]) == {0.1} and len(failed) == 6
    assert failed["val_test_ll"].isna().all() and failed["error"].str.contains("non-finite").all()
    for split in (0, 1):
        ok = trials[(trials["split"] == split) & (trials["state"] == "COMPLETE")]
        best = ok.loc[ok["val_test_ll"].idxmax()]
        assert bool(best["best"]) and ok["best"].sum() == 1
        config = yaml.safe_load((tmp_path / "job" / f"split={split}" / "config.yaml").read_text())
        assert config["method"]["dropout_rate"] == best["method.dropout_rate"]
        assert config["noise_precision"] == best["noise_precision"]


def test_a_diverging_trial_alone_in_its_round_fails_alone(tmp_path: Path, compose_cfg, monkeypatch) -> None:
    """A round of one trial is fitted as that trial's single run (runner.fit_job), whose divergence names no
    stacked copy: it is still that trial's failure, and the search goes on."""
    from bdl_bench.methods.bbb import BayesByBackprop

    step, calls = BayesByBackprop.stack_step, []

    def diverge_in_round_1(self, x, y):
        calls.append(self.n_copies)
        out = step(self, x, y)
        out["loss"] = out["loss"] * torch.nan if len(calls) == 1 else out["loss"]
        return out

    monkeypatch.setattr(BayesByBackprop, "stack_step", diverge_in_round_1)
    overrides = ["method=bbb", "data=uci/yacht", "data.split=[0]", "tune=slang_table2", "trainer.n_epochs=1"]
    run_job(compose_cfg([*overrides, "search.n_random=1", "search.n_guided=1", "search.round_size=1"]), tmp_path)
    trials = _trials(tmp_path)
    assert list(trials["state"]) == ["FAIL", "COMPLETE"] and set(calls) == {1}
    assert trials["error"].iloc[0].startswith("NonFiniteLossError") and bool(trials["best"].iloc[1])


@pytest.mark.parametrize(
    ("override", "error", "named"),
    [
        ("search.params.noise_precision=[2.0,1.0]", ConfigError, "search.params.noise_precision"),
        ("search.params.prior_precision=[0,1.0]", ConfigError, "search.params.prior_precision"),
        ("search.n_random=0", ConfigError, "budget"),
        ("+search.grids.bbb={noise_precision:no_such_file.txt}", DataFileError, "no_such_file.txt"),
    ],
)
def test_bad_search_input_names_the_key_or_file(compose_cfg, override: str, error: type, named: str) -> None:
    extra = [override, "search.n_guided=0"] if "n_random" in override else [override]
    with pytest.raises(error, match=named.replace(".", r"\.")) as info:
        read_spec(_cfg(compose_cfg, "bbb", *extra))
    assert "\n" not in str(info.value)


def test_an_empty_grid_file_is_refused(tmp_path: Path, compose_cfg) -> None:
    root = tmp_path / "data"
    shutil.copytree(Path(__file__).parents[1] / "data" / "uci" / "yacht", root / "uci" / "yacht")
    (root / "uci" / "yacht" / "tau_values.txt").write_text("\n")
    with pytest.raises(DataFileError, match="tau_values.txt is empty"):
        read_spec(_cfg(compose_cfg, "dropout", f"data.root={root}", GRID))


def test_gal_protocol_settings_and_weight_prior(compose_cfg) -> None:
    """tune=slang_table2's dropout runs take the set's dropout rate and lengthscale from Gal's code (yacht: 0.01,
    0.1), his weight decay as a weight prior precision l²(1 − p) s_y² / 2 (which makes our objective their Keras
    loss times τ s_y² / 2), Adam 0.001 and batch 32; the other methods' runs are untouched."""
    from bdl_bench.data import build_dataset
    from bdl_bench.models import build_model
    from bdl_bench.orchestration.runner import run_prior

    cfg = with_method_settings(_cfg(compose_cfg, "dropout", "bias_prior_precision=1e-6"))
    gal = (cfg.gal_lengthscale, cfg.method.dropout_rate, cfg.method.lr, cfg.trainer.batch_size)
    assert gal == (0.1, 0.01, 1e-3, 32)
    assert cfg.trainer.n_epochs == 400 and cfg.search.trial_settings.trainer.n_epochs == 200
    assert "gal_lengthscale" not in with_method_settings(_cfg(compose_cfg, "slang"))  # other methods untouched
    data = build_dataset({"name": "uci/yacht", "split": 0})
    model = build_model({"name": "mlp", "hidden": [50], "activation": "relu"}, in_features=6, out_features=1)
    prior = run_prior(model, cfg, data)
    weights = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("weight")]).numel()
    expected = 0.1**2 * (1 - 0.01) * data.y_std**2 / 2
    assert prior[:300].tolist() == pytest.approx([expected] * 300)  # the first layer's weights
    on_weights = torch.isclose(prior, torch.tensor(expected, dtype=prior.dtype))
    assert int(on_weights.sum()) == weights and bool((prior[~on_weights] == 1e-6).all())


def test_table_lists_what_each_split_search_chose(tmp_path: Path, compose_cfg, capsys) -> None:
    from bdl_bench.orchestration.cli import table_command

    run_job(_cfg(compose_cfg, "slang", "search.n_random=2", "search.n_guided=0"), tmp_path / "job")
    table_command([str(tmp_path), "--search"])
    out = capsys.readouterr().out
    summary = pd.read_csv(tmp_path / "search_table.csv")
    assert list(summary["split"]) == [0, 1] and (summary["trials"] == 2).all() and (summary["failed"] == 0).all()
    for split in (0, 1):
        best = _trials(tmp_path / "job").query(f"split == {split} and best").iloc[0]
        assert summary.loc[split, "noise_precision"] == pytest.approx(best["noise_precision"])
    assert "noise_precision" in out and "yacht" in out


def test_gal_protocol_searches_tau_alone_with_shorter_trials(tmp_path: Path, compose_cfg) -> None:
    """tune=slang_table2's dropout column: BO over τ alone, between the ends of the set's τ grid, each trial
    trained for search.trial_settings' epochs, the test run for the protocol's (here 2 and 3 instead of 200 and
    400), with the set's dropout rate."""
    settings = "search.method_settings.dropout"
    cfg = _cfg(
        compose_cfg,
        "dropout",
        *BO,
        f"{settings}.search.trial_settings.trainer.n_epochs=2",
        f"{settings}.trainer.n_epochs=3",
    )
    spec = read_spec(with_method_settings(cfg))
    assert [(p.key, p.low, p.high) for p in spec.params] == [("noise_precision", 0.25, 0.75)] and spec.grid is None
    run_job(cfg, tmp_path / "job")
    trials = _trials(tmp_path / "job")
    assert len(trials) == 8 and (trials["state"] == "COMPLETE").all()
    assert trials["noise_precision"].between(0.25, 0.75).all() and "prior_precision" not in trials
    trial = yaml.safe_load((tmp_path / "job" / SEARCH_DIR / "split=0" / "trial=000" / "config.yaml").read_text())
    assert trial["trainer"]["n_epochs"] == 2 and trial["data"]["val_fraction"] == 0.2
    for split in (0, 1):
        config = yaml.safe_load((tmp_path / "job" / f"split={split}" / "config.yaml").read_text())
        assert config["trainer"]["n_epochs"] == 3 and config["method"]["dropout_rate"] == 0.01
        best = trials[(trials["split"] == split) & trials["best"]].iloc[0]
        assert config["noise_precision"] == pytest.approx(best["noise_precision"])
