"""Stacked splits (bdl_bench/orchestration/stacked.py): R splits fitted at once equal R single runs.

The slow, obviously-correct twin of a stacked fit is the single run of each split (same seed, so the same
noise); they must agree up to float rounding, at the method level (states after two epochs) and at the
runner level (every metric of every split's folder)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from _runs import without_cost
from omegaconf import OmegaConf

from bdl_bench.data import build_dataset
from bdl_bench.likelihoods import Gaussian, build_likelihood, stacked_nll
from bdl_bench.methods import Method, Problem, build_method
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector
from bdl_bench.orchestration.reproduce import make_plan
from bdl_bench.orchestration.runner import _check_stackable, run
from bdl_bench.orchestration.stacked import stacked_splits
from bdl_bench.orchestration.sweep import ConfigVersionError, run_job
from bdl_bench.results import config_hash, read_run_record

METHODS = {
    "bbb": {"name": "bbb", "lr": 0.01, "n_train_mc_samples": 3, "estimator": "local_reparam", "init_std": 0.05},
    "bbb_reparam": {"name": "bbb", "lr": 0.01, "n_train_mc_samples": 3, "estimator": "reparam", "init_std": 0.05},
    "dropout": {"name": "dropout", "lr": 0.01, "dropout_rate": 0.1, "n_train_mc_samples": 2, "dropout_inputs": True},
    "ivon": {
        "name": "ivon",
        "lr": 0.01,
        "beta1": 0.9,
        "beta2": 0.999,
        "hess_init": 1.0,
        "n_train_mc_samples": 3,
        "clip_radius": None,
        "decay": 0.0,
    },
    "slang": {
        "name": "slang",
        "rank": 2,
        "lr": 0.02,
        "beta": 0.05,
        "decay": 0.0,
        "momentum": 0.9,
        "n_train_mc_samples": 3,
        "init_prec_diag": 1.0,
    },
    **{
        f"vogn_{cov}_{curv}": {
            "name": "vogn",
            "covariance": cov,
            "curvature": curv,
            "lr": 0.05 if curv == "ef" else 0.01,  # the diagonal GGN step diverges on this MLP at 0.05
            "beta": 0.05,
            "decay": 0.51,
            "n_train_mc_samples": 3,
            "init_prec": 1.0,
        }
        for cov in ("diag", "full")
        for curv in ("ef", "hessian")
    },
}
SPLITS = (0, 3, 7)


def test_every_stacking_method_has_a_stacked_equals_single_config() -> None:
    """The registry says which methods stack (``stacks``); each is in METHODS above, so a new
    stacking method cannot skip the stacked-equals-single test."""
    from bdl_bench.methods import METHODS as REGISTERED
    from bdl_bench.methods import import_all

    import_all()

    stacking = {name for name, cls in REGISTERED.items() if cls.stacks}
    assert stacking == {config["name"] for config in METHODS.values()}
    overriding = {name for name, cls in REGISTERED.items() if cls.setup_stack is not Method.setup_stack}
    assert overriding == stacking  # the flag says what the class does


def _problem(
    split: int, model: torch.nn.Module, generator: torch.Generator, noise: float = 2.0, prior_precision: float = 1.0
) -> tuple[Problem, object]:
    """Yacht split ``split`` in float64 (so that stacked and single fits agree far below float32 rounding: to ~1e-7, set by the
    stopping rule of the iterative eigensolver of the stacked SLANG update), on the model's device."""
    data = build_dataset({"name": "uci/yacht", "split": split})
    device = next(model.parameters()).device
    data = dataclasses.replace(data, **{k: getattr(data, k).double().to(device) for k in ("x_train", "y_train")})
    likelihood = build_likelihood(data, noise)
    prior = prior_precision_vector(model, prior_precision, 1e-6).to(device)
    return Problem(
        model=model, likelihood=likelihood, n_data=data.n_train, prior_precision=prior, generator=generator
    ), data


def _model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model({"name": "mlp", "hidden": [20], "activation": "relu"}, in_features=6, out_features=1)
    return model.double().to(device)


def _state(method: object) -> dict[str, torch.Tensor]:
    """What defines a fitted copy: the parameters of its posterior (or weights)."""
    if hasattr(method, "hess"):  # ivon
        return {"mean": method.mean, "hess": method.hess, "momentum": method.momentum}
    if hasattr(method, "rho"):
        return {"mean": method.mean.detach(), "rho": method.rho.detach()}
    if hasattr(method, "theta"):
        return {"theta": method.theta.detach()}
    s = method.state
    if hasattr(s, "precision"):  # vogn
        return {"mean": s.mean, "precision": s.precision}
    return {"mean": s.mean, "precision": s.prec_factor @ s.prec_factor.mT, "diag": s.prec_diag}


def _single_fit(option: dict, split: int, noise: float = 2.0, prior: float = 1.0, device: str = "cpu") -> object:
    """The slow twin: one split fitted alone for 2 epochs (the seeds a stack of it uses)."""
    problem, data = _problem(split, _model(device), torch.Generator(device).manual_seed(1), noise, prior)
    method = build_method(option)
    method.setup(problem)
    method.fit(data.x_train, data.y_train, n_epochs=2, batch_size=16, data_generator=torch.Generator().manual_seed(2))
    return method


ON_CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_stacked_fit_equals_single_fits(name: str, device: str) -> None:
    singles, stats = [], []
    for split in SPLITS:
        singles.append(_single_fit(METHODS[name], split, device=device))
    model, generator = _model(device), torch.Generator(device).manual_seed(1)
    problems, datasets = zip(*(_problem(split, model, generator) for split in SPLITS))
    stacked = build_method(METHODS[name])
    stacked.setup_stack(list(problems))
    stacked.fit_stack(
        torch.stack([d.x_train for d in datasets]),
        torch.stack([d.y_train for d in datasets]),
        n_epochs=2,
        batch_size=16,
        data_generator=torch.Generator().manual_seed(2),
        on_epoch_end=lambda epoch, rows: stats.append(rows),
    )
    assert len(stats) == 2 and len(stats[-1]) == len(SPLITS) and "train/loss" in stats[-1][0]
    # on a GPU the batched and single kernels round differently, and full-covariance VOGN with the empirical
    # Fisher amplifies that (on the CPU, a 1e-15 relative change of its start moves the mean by 1e-7 in these two
    # epochs; on an H200 its copies differed by 1.9e-5): there it agrees to 1e-4, a wrong copy differs by > 1e-3
    tolerance = 1e-4 if (name, device) == ("vogn_full_ef", "cuda") else 1e-6
    for r, single in enumerate(singles):
        copy = stacked.copy_at(r)
        assert copy.problem.likelihood is problems[r].likelihood
        for key, value in _state(single).items():
            assert value.device.type == _state(copy)[key].device.type == device
            error = (_state(copy)[key] - value).norm() / value.norm()
            assert error < tolerance, f"{name} copy {r}: {key} differs by {float(error):.2e} (relative, Frobenius)"
    # the copies were really fitted on different data: their states differ
    key = next(iter(_state(singles[0])))
    assert (_state(singles[0])[key] - _state(singles[1])[key]).norm() > 1e-3 * _state(singles[0])[key].norm()


# search trials as copies: (split, noise precision, prior precision, dropout rate) of each copy
TRIALS = [(0, 2.0, 1.0, 0.1), (0, 0.5, 10.0, 0.01), (3, 8.0, 0.1, 0.3)]


@pytest.mark.parametrize("name", ["bbb", "dropout", "ivon", "slang", "vogn_diag_ef", "vogn_full_hessian"])
def test_stacked_trials_with_their_own_hyperparameters_equal_single_fits(name: str) -> None:
    """Copies that differ in noise precision, prior precision (and dropout's rate), as the trials of a
    stacked hyperparameter search do, each equal the single run with the same values."""
    options = [{**METHODS[name], "dropout_rate": rate} if name == "dropout" else METHODS[name] for *_, rate in TRIALS]
    singles = []
    for (split, noise, prior, _), option in zip(TRIALS, options):
        singles.append(_single_fit(option, split, noise, prior))
    model, generator = _model(), torch.Generator().manual_seed(1)
    problems, datasets = zip(*(_problem(s, model, generator, n, p) for s, n, p, _ in TRIALS))
    stacked = build_method(METHODS[name])
    stacked.configure_stack([{k: v for k, v in o.items() if k != "name"} for o in options])
    stacked.setup_stack(list(problems))
    stacked.fit_stack(
        torch.stack([d.x_train for d in datasets]),
        torch.stack([d.y_train for d in datasets]),
        n_epochs=2,
        batch_size=16,
        data_generator=torch.Generator().manual_seed(2),
    )
    for r, single in enumerate(singles):
        copy = stacked.copy_at(r)
        for key, value in _state(single).items():
            error = (_state(copy)[key] - value).norm() / value.norm()
            assert error < 1e-6, f"{name} trial {r}: {key} differs by {float(error):.2e} (relative, Frobenius)"
    # trials 0 and 1 share a split: only their hyperparameters differ, and so do their fits
    key = next(iter(_state(singles[0])))
    assert (_state(singles[0])[key] - _state(singles[1])[key]).norm() > 1e-3 * _state(singles[0])[key].norm()


def test_only_copy_options_may_differ_between_copies() -> None:
    from bdl_bench.methods.base import CannotStack

    method = build_method(METHODS["slang"])
    with pytest.raises(CannotStack, match="method.rank"):
        method.configure_stack([{"rank": 2}, {"rank": 3}])
    dropout = build_method(METHODS["dropout"])
    dropout.configure_stack([{"dropout_rate": 0.1}, {"dropout_rate": 0.2}])  # allowed


@pytest.mark.parametrize("precisions", [(0.5, 3.0), (2.0,)])  # several copies, and a single run's one
def test_stacked_nll_matches_each_likelihood(precisions: tuple[float, ...]) -> None:
    likelihoods = [Gaussian(tau) for tau in precisions]
    f, y = torch.randn(len(precisions), 4, 5, 1), torch.randn(len(precisions), 5)
    out = stacked_nll(likelihoods, f, y)
    assert out.shape == (len(precisions), 4, 5)
    for r, lik in enumerate(likelihoods):
        for s in range(4):
            torch.testing.assert_close(out[r, s], lik.nll(f[r, s], y[r]))


def test_stacked_job_writes_each_split_as_its_single_run(tmp_path: Path, compose_cfg) -> None:
    cfg = compose_cfg(["method=slang", "data=uci/yacht", "data.split=[1,4]", "trainer.n_epochs=3"])
    job = run_job(cfg, tmp_path / "stack")
    assert not job.skipped
    for split in (1, 4):
        member = tmp_path / "stack" / f"split={split}"
        single_cfg = compose_cfg(["method=slang", "data=uci/yacht", f"data.split={split}", "trainer.n_epochs=3"])
        single = run(single_cfg, tmp_path / f"single{split}").metrics
        stacked = json.loads((member / "metrics.json").read_text())
        assert stacked["stack_size"] == 2
        for key in ("rmse", "test_ll", "elbo"):
            assert stacked[key] == pytest.approx(single[key], rel=1e-4), key
        stored = OmegaConf.load(member / "config.yaml")
        assert stored.data.split == split
        expected = config_hash(OmegaConf.to_container(single_cfg, resolve=True))
        assert read_run_record(member)["config_hash"] == expected and read_run_record(member)["status"] == "finished"
        assert (member / "history.csv").read_text().count("\n") == 4  # header + 3 epochs
    # a re-run skips both; with one split's metrics gone, only that split runs again
    assert run_job(cfg, tmp_path / "stack").skipped
    (tmp_path / "stack" / "split=4" / "metrics.json").unlink()
    again = run_job(cfg, tmp_path / "stack")
    assert not again.skipped
    assert read_run_record(tmp_path / "stack" / "split=1")["status"] == "skipped"
    assert read_run_record(tmp_path / "stack" / "split=4")["attempts"] == 2
    # another config version is refused and, as for a single run, recorded in every split's folder (so
    # `reproduce` and `table` see the conflict instead of silently using the old runs)
    changed = compose_cfg(
        ["method=slang", "data=uci/yacht", "data.split=[1,4]", "trainer.n_epochs=3", "noise_precision=0.5"]
    )
    with pytest.raises(ConfigVersionError, match="another config version"):
        run_job(changed, tmp_path / "stack")
    for split in (1, 4):
        member = tmp_path / "stack" / f"split={split}"
        assert read_run_record(member)["status"] == "failed"
        assert json.loads((member / "failure.json").read_text())["error_type"] == "ConfigVersionError"
        assert (member / "metrics.json").exists()  # the old run is kept


@pytest.mark.parametrize("group_elements", [None, 1])
def test_stacked_dropout_predicts_its_copies_together_as_single_runs_would(
    tmp_path: Path, compose_cfg, monkeypatch: pytest.MonkeyPatch, group_elements: int | None
) -> None:
    """MC dropout's final test and validation predictions are made for all copies at once (shared masks,
    ``SharedPredictions``; with ``group_elements=1`` one copy per group, each replaying the shared
    generator state), and every split's metrics equal its single run's."""
    from bdl_bench.methods.dropout import MCDropout
    from bdl_bench.orchestration import runner

    if group_elements is not None:
        monkeypatch.setattr(runner.SharedPredictions, "PREDICTION_ELEMENTS", group_elements)
    calls = []
    original = MCDropout.predict_stack

    def recorded(self: MCDropout, *args: object) -> torch.Tensor:
        if self.n_copies > 1:  # the stack's shared predictions (a single copy's own predict is a stack of one)
            calls.append(args[2])
        return original(self, *args)

    monkeypatch.setattr(MCDropout, "predict_stack", recorded)
    common = ["method=dropout", "data=uci/yacht", "data.val_fraction=0.2", "trainer.n_test_mc_samples=70"]
    job = run_job(compose_cfg([*common, "data.split=[1,4,6]"]), tmp_path / "stack")
    assert not job.skipped
    assert calls == ([[0, 1, 2]] * 2 if group_elements is None else [[0], [0], [1], [1], [2], [2]])  # test, val
    for split in (1, 4, 6):
        single = run(compose_cfg([*common, f"data.split={split}"]), tmp_path / f"single{split}").metrics
        stacked_metrics = json.loads((tmp_path / "stack" / f"split={split}" / "metrics.json").read_text())
        for key in ("rmse", "test_ll", "test_ll_joint", "val_rmse", "val_test_ll"):
            assert stacked_metrics[key] == pytest.approx(single[key], rel=1e-5), (split, key)


def test_stacked_validation_at_its_own_count_is_predicted_per_copy_as_single_runs_would(
    tmp_path: Path, compose_cfg
) -> None:
    """With ``trainer.n_val_mc_samples`` unlike the test count, the copies share the test predictions only; every
    split's validation metrics (its own 3 samples) equal its single run's."""
    common = ["method=dropout", "data=uci/yacht", "data.val_fraction=0.2", "trainer.n_val_mc_samples=3"]
    run_job(compose_cfg([*common, "data.split=[1,4]"]), tmp_path / "stack")
    for split in (1, 4):
        single = run(compose_cfg([*common, f"data.split={split}"]), tmp_path / f"single{split}").metrics
        stacked_metrics = json.loads((tmp_path / "stack" / f"split={split}" / "metrics.json").read_text())
        for key in ("rmse", "test_ll", "val_rmse", "val_test_ll"):
            assert stacked_metrics[key] == pytest.approx(single[key], rel=1e-5), (split, key)


class Crash(Exception):
    pass


def _crash_after(epoch: int):
    def hook(done: int) -> None:
        if done == epoch:
            raise Crash(f"killed after epoch {done}")

    return hook


def test_stacked_job_resumes_after_a_kill_and_records_failures(tmp_path: Path, compose_cfg, at_epoch_end) -> None:
    overrides = ["method=bbb", "data=uci/yacht", "data.split=[0,2]", "trainer.n_epochs=4", "trainer.checkpoint_every=2"]
    cfg = compose_cfg(overrides)
    unbroken = tmp_path / "unbroken"
    run_job(cfg, unbroken)
    killed = tmp_path / "killed"
    with at_epoch_end(_crash_after(3)), pytest.raises(Crash):
        run_job(cfg, killed)
    assert (killed / "checkpoint.pt").exists()
    for split in (0, 2):
        assert read_run_record(killed / f"split={split}")["status"] == "failed"
        assert "killed after epoch 3" in (killed / f"split={split}" / "failure.txt").read_text()
    run_job(cfg, killed)
    assert not (killed / "checkpoint.pt").exists()
    for split in (0, 2):
        a = json.loads((unbroken / f"split={split}" / "metrics.json").read_text())
        b = json.loads((killed / f"split={split}" / "metrics.json").read_text())
        assert without_cost(a) == without_cost(b)


@pytest.mark.parametrize("method", ["dropout", "laplace"])
def test_a_stack_of_one_split_is_its_single_run(tmp_path: Path, compose_cfg, capsys, method: str) -> None:
    """One loop (runner.fit_job): a job of one split (data.split=[k]) fits it as its single run, through the
    method's single-run API, whether the method stacks (dropout) or not (laplace: no CannotStack detour, its extra metrics kept);
    the metrics and history are the single run's bit for bit, and the stack's metrics add stack_size."""
    common = [f"method={method}", "data=uci/yacht", "trainer.n_epochs=2", "trainer.eval_every=1"]
    run_job(compose_cfg([*common, "data.split=[2]"]), tmp_path / "stack")
    assert "one after another" not in capsys.readouterr().err
    single = run(compose_cfg([*common, "data.split=2"]), tmp_path / "single").metrics
    member = tmp_path / "stack" / "split=2"
    stacked = json.loads((member / "metrics.json").read_text())
    assert stacked.pop("stack_size") == 1.0 and without_cost(stacked) == without_cost(single)
    histories = [pd.read_csv(d / "history.csv").drop(columns="time_s") for d in (member, tmp_path / "single")]
    pd.testing.assert_frame_equal(histories[0], histories[1], check_exact=True)


def test_stacking_refusals(compose_cfg, tmp_path: Path) -> None:
    assert stacked_splits(compose_cfg(["data=uci/yacht", "data.split=all"])) == list(range(20))
    assert stacked_splits(compose_cfg(["data=uci/yacht", "data.split=3"])) is None
    with pytest.raises(ValueError, match="distinct splits"):
        stacked_splits(compose_cfg(["data=uci/yacht", "data.split=[1,1]"]))
    a, b = build_dataset({"name": "uci/yacht", "split": 0}), build_dataset({"name": "uci/boston", "split": 0})
    with pytest.raises(ValueError, match="need equal training sets"):
        _check_stackable({0: a, 1: b}, compose_cfg(["data=uci/yacht"]))


def test_reproduce_plans_stacked_jobs_for_data_split_all() -> None:
    plan = make_plan("slang_table2", ["method=bbb", "data=uci/yacht"], quick=True, tune=False)
    assert plan.stack_splits
    assert [j for j in plan.jobs if "data.split=0" in j] and len(plan.jobs) == 2  # --quick: 2 splits
    per_split = make_plan(
        "slang_table2", ["method=bbb", "data=uci/yacht", "data.split=range(3)"], quick=False, tune=False
    )
    assert not per_split.stack_splits and len(per_split.jobs) == 3


def test_cli_names_split_folders_like_single_runs(tmp_path: Path) -> None:
    args = ["run", "method=dropout", "data=uci/yacht", "trainer=smoke", "data.split=[0,1]", f"results_root={tmp_path}"]
    out = subprocess.run(
        [sys.executable, "-m", "bdl_bench.orchestration.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    names = sorted(str(p.parent.relative_to(tmp_path)) for p in tmp_path.rglob("metrics.json"))
    assert names == [f"runs/data.split={k},data=uci/yacht,method=dropout,trainer=smoke" for k in (0, 1)], names
    overrides = (tmp_path / names[1] / ".hydra" / "overrides.yaml").read_text()
    assert "data.split=1" in overrides


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_eigenpairs_match_eigh(dtype: torch.dtype) -> None:
    """The SLANG update's subspace iteration (a stack of matrices) against ``torch.linalg.eigh`` (its fallback and
    twin), on Gram matrices shaped like SLANG's: a dominant rank-L block plus P per-example gradient columns."""
    from bdl_bench.curvature.eigen import top_eigenpairs

    g = torch.Generator().manual_seed(0)
    rank, size = 2, 101
    factor = torch.randn(4, size, rank, generator=g, dtype=dtype) * torch.tensor([30.0, 12.0], dtype=dtype)
    noise = torch.randn(4, size, size - rank, generator=g, dtype=dtype)
    matrix = factor @ factor.mT + 0.05 * noise @ noise.mT
    values, vectors = top_eigenpairs(matrix, rank)
    evals, evecs = torch.linalg.eigh(matrix)
    top = evecs[:, :, -rank:].flip(-1)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(values, evals[:, -rank:].flip(-1), rtol=1e3 * eps, atol=0.0)
    torch.testing.assert_close(vectors @ vectors.mT, top @ top.mT, rtol=0.0, atol=1e4 * eps)
    torch.testing.assert_close(
        vectors.mT @ vectors, torch.eye(rank, dtype=dtype).expand(4, -1, -1), rtol=0, atol=1e3 * eps
    )
    # started from the matrix's first L columns (as the SLANG update does), one copy's start all zero
    start = matrix[:, :, :rank].clone()
    start[1] = 0.0
    values, vectors = top_eigenpairs(matrix, rank, start=start)
    torch.testing.assert_close(values, evals[:, -rank:].flip(-1), rtol=1e3 * eps, atol=0.0)
    torch.testing.assert_close(vectors @ vectors.mT, top @ top.mT, rtol=0.0, atol=1e4 * eps)
    # equal top eigenvalues: the iteration cannot separate them, so eigh answers (same eigenvalues)
    tied = torch.diag_embed(torch.tensor([[5.0, 5.0, 5.0, 1.0] + [0.5] * 8] * 2, dtype=dtype))
    values, vectors = top_eigenpairs(tied, 2)
    torch.testing.assert_close(values, torch.tensor([[5.0, 5.0]] * 2, dtype=dtype))


def test_checkpoint_of_another_set_of_splits_is_discarded(tmp_path: Path, compose_cfg, at_epoch_end) -> None:
    """A stack killed while writing its splits' results leaves a checkpoint of the full set; the re-run
    (only the unfinished splits) warns and starts them afresh instead of failing."""
    common = ["method=dropout", "data=uci/yacht", "trainer.n_epochs=3", "trainer.checkpoint_every=1"]
    with at_epoch_end(_crash_after(2)), pytest.raises(Crash):
        run_job(compose_cfg([*common, "data.split=[0,2]"]), tmp_path / "stack")
    assert (tmp_path / "stack" / "checkpoint.pt").exists()
    with pytest.warns(UserWarning, match="belongs to another stack of splits"):
        run_job(compose_cfg([*common, "data.split=[2]"]), tmp_path / "stack")
    assert (tmp_path / "stack" / "split=2" / "metrics.json").exists()
    assert not (tmp_path / "stack" / "split=0" / "metrics.json").exists()


def test_stacked_slang_equals_single_runs_that_take_the_dense_path(compose_cfg, tmp_path: Path) -> None:
    """Logistic regression (D = 15 <= L + P): the single run decomposes the D x D matrix, the stacked one
    the Gram matrix of each copy; with one eigenvector sign convention (gram.canonical_signs) they draw the same
    samples, so a whole Table 1 run agrees to float64 rounding."""
    common = ["experiment=slang_table1", "variant=slang_table1/slang_L1", "data=libsvm/australian"]
    common += ["trainer.n_epochs=3", "trainer.n_test_mc_samples=10", "reference=null"]
    run_job(compose_cfg([*common, "data.split=[0,1]"]), tmp_path / "stack")
    for split in (0, 1):
        single = run(compose_cfg([*common, f"data.split={split}"]), tmp_path / f"single{split}").metrics
        stacked = json.loads((tmp_path / "stack" / f"split={split}" / "metrics.json").read_text())
        for key in ("elbo", "test_ll", "accuracy"):
            assert stacked[key] == pytest.approx(single[key], rel=1e-9), key


@pytest.mark.parametrize("n_cols", [12, 40])
def test_stacked_dense_update_equals_the_gram_update(n_cols: int) -> None:
    """The two stacked top-L updates (D x D matrix for D <= L + P, Gram matrix otherwise) agree on U_new
    (signs included), the eigenvalues and the diagonal residual, on a small two-layer net (D = 11)."""
    from bdl_bench.curvature.gram import low_rank_update
    from bdl_bench.curvature.per_example import linear_layout

    g = torch.Generator().manual_seed(3)
    model = build_model({"name": "mlp", "hidden": [2], "activation": "relu"}, in_features=3, out_features=1)
    layout = linear_layout(model)
    n_copies, rank, f64 = 3, 2, torch.float64
    u = torch.randn(n_copies, layout.n_params, rank, generator=g, dtype=f64)
    acts = [torch.randn(n_copies, n_cols, s.in_features, generator=g, dtype=f64) for s in layout.slots]
    deltas = [torch.randn(n_copies, n_cols, s.out_features, generator=g, dtype=f64) for s in layout.slots]
    factors = _factors(acts, deltas, n_samples=1)
    dense = low_rank_update(factors, layout, u, old_weight=0.9, new_weight=2.5, path="dense")
    gram = low_rank_update(factors, layout, u, old_weight=0.9, new_weight=2.5, path="gram")
    for name in ("prec_factor", "eigenvalues", "factor_sqnorms", "diag_residual"):
        torch.testing.assert_close(getattr(dense, name), getattr(gram, name), rtol=1e-9, atol=1e-9)


def _factors(inputs: list[torch.Tensor], deltas: list[torch.Tensor], n_samples: int, shared: bool = False):
    """Layer factors of R copies from given inputs and output gradients (zero losses and outputs)."""
    from bdl_bench.curvature.stacked import StackedFactors

    n_copies, n_cols = deltas[0].shape[:2]
    losses = deltas[0].new_zeros(n_copies, n_samples, n_cols // n_samples)
    return StackedFactors(inputs, deltas, losses, losses[..., None], first_input_shared=shared)


@pytest.mark.parametrize("shared", [True, False])
def test_gram_update_from_the_lower_blocks_equals_the_whole_gram(monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    """From ``_HALF_GRAM_COLUMNS`` columns on, the Gram update forms only the lower 3/4 of G^T G and never
    writes B^T B's upper right block (the eigensolver multiplies by its transpose): the same U_new, eigenvalues
    and diagonal residual as from the whole matrix and as the dense update, with a first-layer input shared by
    S = 2 samples (the blocks start at whole samples) and without (P = 13, an odd split)."""
    from bdl_bench.curvature import gram
    from bdl_bench.curvature.per_example import linear_layout

    g = torch.Generator().manual_seed(5)
    model = build_model({"name": "mlp", "hidden": [4], "activation": "relu"}, in_features=3, out_features=1)
    layout = linear_layout(model)
    n_copies, rank, f64 = 3, 2, torch.float64
    n_samples, n_examples = (2, 9) if shared else (1, 13)
    n_cols = n_samples * n_examples
    u = torch.randn(n_copies, layout.n_params, rank, generator=g, dtype=f64)
    x = torch.randn(n_copies, n_examples, 3, generator=g, dtype=f64)
    acts = [x, torch.randn(n_copies, n_cols, 4, generator=g, dtype=f64)]  # the first input once per example
    deltas = [torch.randn(n_copies, n_cols, s.out_features, generator=g, dtype=f64) for s in layout.slots]
    factors = _factors(acts, deltas, n_samples, shared)
    kwargs = dict(old_weight=0.9, new_weight=2.5, factor_gram=u.mT @ u, factor_sqnorms=u.square().sum(-1))
    products = []
    monkeypatch.setattr(gram, "top_eigenpairs", _recording(gram.top_eigenpairs, products))
    whole = gram.low_rank_update(factors, layout, u, **kwargs, path="gram", workspace={})
    monkeypatch.setattr(gram, "_HALF_GRAM_COLUMNS", 4)
    workspace = {"gram_btb": torch.full((n_copies * (rank + n_cols) ** 2,), torch.nan, dtype=f64)}  # never read there
    lower = gram.low_rank_update(factors, layout, u, **kwargs, path="gram", workspace=workspace)
    assert products[0].split == rank + n_cols and products[1].split == rank + (9 if shared else 6)
    # the lower part stands for the whole matrix: filled in, and in the eigensolver's products
    torch.testing.assert_close(products[1].dense(), products[0].data, rtol=1e-12, atol=1e-12)
    vectors = torch.linalg.qr(torch.randn(n_copies, rank + n_cols, 6, generator=g, dtype=f64)).Q
    torch.testing.assert_close(products[1] @ vectors, products[0].data @ vectors, rtol=1e-12, atol=1e-12)
    dense = gram.low_rank_update(factors, layout, u, **kwargs, path="dense")
    for name in ("prec_factor", "eigenvalues", "factor_sqnorms", "diag_residual"):
        a, b, c = (getattr(update, name) for update in (whole, lower, dense))
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(b, c, rtol=1e-9, atol=1e-9)


def _recording(function, calls: list):
    """``function``, recording the matrix each call gets."""

    def wrapped(matrix, *args, **kwargs):
        calls.append(matrix)
        return function(matrix, *args, **kwargs)

    return wrapped


@pytest.mark.parametrize("variant", ["full_hess", "mf_ef"])
def test_stacked_table1_vogn_job_equals_its_single_runs(tmp_path: Path, compose_cfg, variant: str) -> None:
    """SLANG Table 1's natural-gradient columns (logistic regression) stack their splits too (and checkpoint the
    stack after epoch 1)."""
    common = ["experiment=slang_table1", f"variant=slang_table1/{variant}", "data=libsvm/breast_cancer"]
    common += ["trainer.n_epochs=2", "trainer.eval_every=1", "trainer.checkpoint_every=1"]
    run_job(compose_cfg([*common, "data.split=[0,2]"]), tmp_path / "stack")
    for split in (0, 2):
        single = run(compose_cfg([*common, f"data.split={split}"]), tmp_path / f"single{split}").metrics
        stacked = json.loads((tmp_path / "stack" / f"split={split}" / "metrics.json").read_text())
        assert stacked["stack_size"] == 2
        for key in ("nll", "elbo", "sym_kl"):
            assert stacked[key] == pytest.approx(single[key], rel=1e-6), key


def test_a_method_that_cannot_stack_runs_the_splits_one_by_one(tmp_path: Path, compose_cfg, capsys) -> None:
    """exact_vi (L-BFGS on the whole set) cannot stack: the job runs each split as its single run."""
    common = ["experiment=slang_table1", "variant=slang_table1/mf_exact", "data=libsvm/breast_cancer"]
    job = run_job(compose_cfg([*common, "data.split=[0,2]"]), tmp_path / "stack")
    assert not job.skipped and "cannot fit several splits at once" in capsys.readouterr().err
    for split in (0, 2):
        single = run(compose_cfg([*common, f"data.split={split}"]), tmp_path / f"single{split}").metrics
        member = tmp_path / "stack" / f"split={split}"
        stacked = json.loads((member / "metrics.json").read_text())
        assert "stack_size" not in stacked and read_run_record(member)["status"] == "finished"
        for key in ("nll", "elbo", "sym_kl"):
            assert stacked[key] == single[key], key
    assert run_job(compose_cfg([*common, "data.split=[0,2]"]), tmp_path / "stack").skipped


@pytest.mark.parametrize("n_examples", [8, 300], ids=["gram_path", "dense_path"])
def test_stacked_logistic_regression_merges_samples(n_examples: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logistic regression's S·M per-example gradients are merged into M columns with the same G Gᵀ
    (gram.merge_samples): the stacked steps equal the unmerged ones and each copy's single run, U's column signs
    included, on USPS 3vs5 (D = 257; the Gram path for M = 8,
    the D x D one for M = 300)."""
    from bdl_bench.curvature import gram

    datasets = [build_dataset({"name": "libsvm/usps_3vs5", "split": s}) for s in (0, 1)]
    model = build_model({"name": "logreg", "bias": True}, in_features=256, out_features=1).double()
    cfg = {**METHODS["slang"], "rank": 3, "decay": 0.51, "momentum": 0.0}

    def problem(data, generator: torch.Generator) -> Problem:
        prior = prior_precision_vector(model, 25.0, 1e-5).double()
        return Problem(model, build_likelihood(data, None), data.n_train, prior, generator=generator)

    x = torch.stack([d.x_train[:n_examples] for d in datasets]).double()
    y = torch.stack([d.y_train[:n_examples] for d in datasets])

    def fit_stacked() -> object:
        generator = torch.Generator().manual_seed(1)
        method = build_method(cfg)
        method.setup_stack([problem(d, generator) for d in datasets])
        for _ in range(4):
            method.stack_step(x, y)
        return method

    merged = fit_stacked()
    with monkeypatch.context() as patch:
        patch.setattr(gram, "merge_samples", lambda factors, layout: None)
        unmerged = fit_stacked()
    for r in range(2):
        single = build_method(cfg)
        single.setup(problem(datasets[r], torch.Generator().manual_seed(1)))
        for _ in range(4):
            single.train_step(x[r], y[r])
        for other in (unmerged.copy_at(r), single):
            for key in ("mean", "prec_factor", "prec_diag"):
                torch.testing.assert_close(
                    getattr(merged.copy_at(r).state, key), getattr(other.state, key), rtol=1e-7, atol=1e-9
                )
