"""Laplace ``method.search``: the (N, τ) grid of DEF App. E.3.1 on one curvature fit."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from _laplace import make_laplace
from torch import Tensor
from torch.testing import assert_close

from bdl_bench.errors import Terminated
from bdl_bench.likelihoods import Categorical
from bdl_bench.methods.base import Problem
from bdl_bench.methods.laplace import SEARCH_FILE, Laplace
from bdl_bench.methods.laplace import search as search_module
from bdl_bench.methods.laplace.structures import Diag
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector
from bdl_bench.orchestration.runner import run

F64 = torch.float64
GRID = {"dataset_scale": [1, 30], "prior_precision": [0.5, 5.0], "n_samples": 3, "accuracy_tolerance": None}


def _lenet_problem() -> tuple[Problem, Tensor, Tensor, Tensor, Tensor]:
    """A shrunk LeNet on random 8x8 images, 3 classes: 30 training and 20 validation examples."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # nn.init
    model = build_model(
        {"name": "lenet", "image_size": 8, "channels": [2, 3], "hidden": 8, "dropout": 0.0},
        in_features=64,
        out_features=3,
    ).to(F64)
    x, x_val = torch.rand(30, 64, generator=g, dtype=F64), torch.rand(20, 64, generator=g, dtype=F64)
    y, y_val = torch.randint(0, 3, (30,), generator=g), torch.randint(0, 3, (20,), generator=g)
    prior = prior_precision_vector(model, 1.0, None)
    return Problem(model, Categorical(), 30, prior, torch.Generator().manual_seed(1)), x, y, x_val, y_val


def _fit(method: Laplace, with_val: bool = True) -> Laplace:
    problem, x, y, x_val, y_val = _lenet_problem()
    method.setup(problem)
    if with_val:
        method.use_validation(x_val, y_val)
    method.fit(x, y, n_epochs=0, batch_size=30, data_generator=torch.Generator().manual_seed(3))
    return method


def _fields(method: Laplace) -> dict[str, Tensor]:
    posterior = method.posterior()
    return {f.name: getattr(posterior, f.name) for f in dataclasses.fields(posterior)}


@pytest.mark.parametrize("structure", ["diag", "kfac", "efb", "def"])
def test_search_posterior_equals_a_plain_run_at_the_chosen_point(structure: str) -> None:
    """Reference twin: the searched posterior (rebuilt from the one curvature pass) is bit for bit the
    plain fit's at (N, τ) = the chosen point."""
    searched = _fit(make_laplace(structure=structure, curvature="fisher", rank=4, search=GRID))
    chosen = (searched.extra_metrics["chosen_dataset_scale"], searched.extra_metrics["chosen_prior_precision"])
    assert [r.get("chosen", False) for r in searched.search_rows].count(True) == 1
    plain = _fit(
        make_laplace(
            structure=structure, curvature="fisher", rank=4, dataset_scale=chosen[0], prior_precision=chosen[1]
        ),
        with_val=False,
    )
    for name, value in _fields(plain).items():
        assert_close(_fields(searched)[name], value, rtol=0, atol=0, msg=name)


def test_search_picks_the_min_ece_point_within_the_accuracy_tolerance(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A constructed grid: the lowest ECE overall loses too much accuracy; the next lowest is chosen;
    a point far below the MAP's accuracy prunes the smaller τ of its N."""
    # Calls in order: the MAP, then N = 1 (τ = 10, 1), N = 2 (τ = 10, 1), N = 3 (τ = 10, then 1 pruned).
    table = iter(
        [
            {"accuracy": 0.90, "ece": 0.20, "nll": 0.5},  # MAP
            {"accuracy": 0.90, "ece": 0.05, "nll": 0.4},  # (1, 10)
            {"accuracy": 0.85, "ece": 0.01, "nll": 0.4},  # (1, 1): lowest ECE, accuracy 0.05 below the MAP
            {"accuracy": 0.898, "ece": 0.03, "nll": 0.4},  # (2, 10): chosen
            {"accuracy": 0.91, "ece": 0.04, "nll": 0.4},  # (2, 1)
            {"accuracy": 0.50, "ece": 0.00, "nll": 0.4},  # (3, 10): prunes (3, 1)
        ]
    )
    seen: list[tuple[float, float]] = []
    original = Diag.assemble

    def assemble(self: Diag, theta: Tensor, curvature: dict, scale: float, tau: Tensor):
        seen.append((scale, float(tau[0])))
        return original(self, theta, curvature, scale, tau)

    monkeypatch.setattr(search_module, "predictive_metrics", lambda *args, **kwargs: next(table))
    monkeypatch.setattr(Diag, "assemble", assemble)
    search = {
        "dataset_scale": [1, 2, 3],
        "prior_precision": [1, 10],
        "accuracy_tolerance": 0.005,
        "prune_accuracy_drop": 0.2,
        "n_samples": 2,
    }
    method = make_laplace(structure="diag", search=search)
    problem, x, y, x_val, y_val = _lenet_problem()
    method.setup(problem)
    method.use_validation(x_val, y_val, tmp_path)
    method.fit(x, y, n_epochs=0, batch_size=30, data_generator=torch.Generator().manual_seed(3))
    assert seen == [(1, 10), (1, 1), (2, 10), (2, 1), (3, 10), (2, 10)]  # the last: the chosen posterior
    assert method.extra_metrics["chosen_dataset_scale"] == 2 and method.extra_metrics["chosen_prior_precision"] == 10
    assert method.extra_metrics["search_val_ece"] == 0.03 and method.extra_metrics["search_n_evaluated"] == 5
    rows = list(csv.DictReader((tmp_path / SEARCH_FILE).open()))
    assert [(r["dataset_scale"], r["prior_precision"], r["status"]) for r in rows][-1] == ("3.0", "1.0", "pruned")
    assert [r["chosen"] for r in rows] == ["False", "False", "True", "False", "False", "False"]
    assert [r["eligible"] for r in rows[:5]] == ["True", "False", "True", "True", "False"]
    assert_close(method.posterior().mean, method.theta.detach())


def test_search_without_validation_data_is_refused_naming_the_fix(tmp_path: Path, compose_cfg) -> None:
    with pytest.raises(ValueError, match=r"data\.n_val=10000.*method\.search=null"):
        _fit(make_laplace(structure="diag", search=GRID), with_val=False)
    cfg = compose_cfg(["method=laplace", "data=toy/cubic", "method.search={dataset_scale: [1], prior_precision: [1]}"])
    with pytest.raises(ValueError, match="has none"):
        run(cfg, tmp_path)
    assert not (tmp_path / "history.csv").exists() or len((tmp_path / "history.csv").read_text().splitlines()) <= 1


@pytest.mark.parametrize(
    "search, match",
    [
        ({"dataset_scale": [], "prior_precision": [1]}, "non-empty"),
        ({"dataset_scale": [1], "prior_precision": [0]}, "positive"),
        ({"dataset_scale": [1], "prior_precision": [1], "tau": 3}, "unknown"),
        ({"dataset_scale": [1], "prior_precision": [1], "n_samples": 0}, "n_samples"),
        ({"dataset_scale": [1], "prior_precision": {"logspace": [0, 1]}}, "logspace"),
        ({"dataset_scale": [1], "prior_precision": {"linspace": [0, 1, 3]}}, "logspace"),
    ],
)
def test_bad_search_settings_are_refused(search: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_laplace(search=search)


def test_a_logspace_grid_gives_its_values() -> None:
    """DEF App. E.3.1's 100 values of τ are written {logspace: [a, b, 100]} (conf/experiment/def_table1.yaml)."""
    method = make_laplace(search={"dataset_scale": [1, 50000], "prior_precision": {"logspace": [-2, 6, 100]}})
    grid = method.search.prior_precision
    assert len(grid) == 100 and grid[0] == pytest.approx(1e-2) and grid[-1] == pytest.approx(1e6)
    assert grid[1] / grid[0] == pytest.approx(10 ** (8 / 99))


def test_a_run_writes_the_search_csv_and_the_chosen_point(tmp_path: Path, compose_cfg) -> None:
    """Through the runner (regression: criterion nll, no accuracy filter): the CSV holds every grid
    point, metrics.json the chosen (N, τ), and the test metrics are those of that posterior."""
    common = ["method=laplace", "data=toy/cubic", "data.n_train=40", "data.val_fraction=0.25", "method.structure=diag"]
    search = "method.search={dataset_scale: [10, 30], prior_precision: [0.1, 1, 10], criterion: nll, n_samples: 20}"
    metrics = run(compose_cfg([*common, search]), tmp_path / "search").metrics
    rows = list(csv.DictReader((tmp_path / "search" / SEARCH_FILE).open()))
    assert len(rows) == 6 and all(r["status"] == "evaluated" for r in rows)
    best = min(rows, key=lambda r: float(r["val_nll"]))
    assert best["chosen"] == "True"
    saved = json.loads((tmp_path / "search" / "metrics.json").read_text())
    assert saved["chosen_dataset_scale"] == float(best["dataset_scale"]) == metrics["chosen_dataset_scale"]
    assert saved["chosen_prior_precision"] == float(best["prior_precision"])
    assert {"curvature_time_s", "search_time_s", "search_val_nll"} <= set(saved)
    twin = [f"method.dataset_scale={best['dataset_scale']}", f"method.prior_precision={best['prior_precision']}"]
    plain = run(compose_cfg([*common, *twin]), tmp_path / "plain").metrics
    assert plain["rmse"] == pytest.approx(metrics["rmse"], rel=1e-6)


class _Killed(Exception):
    pass


def _search_in(
    folder: Path, monkeypatch: pytest.MonkeyPatch, kill_at: int | None = None, term_after: int | None = None, **grid
) -> Laplace:
    """A grid search on the LeNet problem writing into ``folder``; with ``kill_at``, stopped as its
    ``kill_at``-th grid point (counting from 1) is about to be scored; with ``term_after``, a SIGTERM is pending
    (``stop_requested``) once that many points are scored."""
    scored = []
    original = search_module.predictive_metrics

    def metrics(*args: object, **kwargs: object) -> dict:
        scored.append(1)  # the MAP's reference is call 1
        if kill_at is not None and len(scored) == kill_at + 1:
            raise _Killed
        return original(*args, **kwargs)

    monkeypatch.setattr(search_module, "predictive_metrics", metrics)
    method = make_laplace(structure="diag", search={**GRID, **grid})
    if term_after is not None:
        method.stop_requested = lambda: len(scored) - 1 >= term_after  # type: ignore[method-assign]
    problem, x, y, x_val, y_val = _lenet_problem()
    method.setup(problem)
    folder.mkdir(exist_ok=True)
    method.use_validation(x_val, y_val, folder)
    method.fit(x, y, n_epochs=0, batch_size=30, data_generator=torch.Generator().manual_seed(3))
    method.scored = len(scored) - 1  # type: ignore[attr-defined]
    return method


def test_a_stopped_search_resumes_from_its_scored_points_as_if_unbroken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    unbroken = _search_in(tmp_path / "unbroken", monkeypatch)
    with pytest.raises(_Killed):
        _search_in(tmp_path / "stopped", monkeypatch, kill_at=3)
    with caplog.at_level(logging.INFO, logger=search_module.__name__):
        resumed = _search_in(tmp_path / "stopped", monkeypatch)
    assert unbroken.scored == 4 and resumed.scored == 2  # the first two points came from the progress file
    points = [r.getMessage() for r in caplog.records if "(point " in r.getMessage()]
    assert len(points) == 2 and "(point 3 of at most 4): val ece" in points[0]  # a line per point scored here
    assert resumed.extra_metrics["search_n_resumed"] == 2 and unbroken.extra_metrics["search_n_resumed"] == 0
    drop = ("time_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in resumed.search_rows] == [
        {k: v for k, v in r.items() if k not in drop} for r in unbroken.search_rows
    ]
    for name, value in _fields(unbroken).items():
        assert_close(_fields(resumed)[name], value, rtol=0, atol=0, msg=name)


def test_points_of_another_fit_are_scored_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(_Killed):
        _search_in(tmp_path, monkeypatch, kill_at=3)
    progress = tmp_path / search_module.PROGRESS_FILE
    with open(progress, "a") as handle:
        handle.write('{"dataset_scale": 30.0, "prior_pre')  # a line torn by the kill
    assert _search_in(tmp_path, monkeypatch, n_samples=2).scored == 4  # another sample count: another fit
    assert len(progress.read_text().splitlines()) == 1 + 4


def test_a_sigterm_stops_the_search_before_its_next_point_and_a_rerun_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search takes hours: a SIGTERM (a cluster's time limit) stops it between points, not at the fit's end."""
    with pytest.raises(Terminated):
        _search_in(tmp_path, monkeypatch, term_after=2)
    assert len((tmp_path / search_module.PROGRESS_FILE).read_text().splitlines()) == 1 + 2
    assert _search_in(tmp_path, monkeypatch).scored == 2  # the other two of the grid's four points
