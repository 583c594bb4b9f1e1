"""The final predictions resume where a killed run stopped (``bdl_bench.orchestration.prediction_store``): a
resumed evaluation draws only the samples it lacked and ends with the metrics of an unbroken run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _runs import without_cost

from bdl_bench.orchestration import prediction_store, runner
from bdl_bench.orchestration.prediction_store import PREDICTIONS_DIR, PredictionStore
from bdl_bench.orchestration.runner import run
from bdl_bench.orchestration.status import run_progress


class Crash(Exception):
    """Stands for the process dying during the evaluation."""


class FakeMethod:
    """What the store fingerprints: a point estimate and no posterior."""

    def __init__(self, theta: torch.Tensor) -> None:
        self.theta = theta

    def point_estimate(self) -> torch.Tensor:
        return self.theta

    def posterior(self) -> None:
        return None


def _predict(folder: Path, theta: torch.Tensor, crash_after: int | None = None, calls: list[int] | None = None):
    """Ten draws of two parts in chunks of 3 from a seeded generator; ``crash_after`` chunks, then a crash."""
    generator = torch.Generator().manual_seed(0)
    store = PredictionStore(folder, FakeMethod(theta), generator)
    made = calls if calls is not None else []

    def draw(n: int) -> dict[str, torch.Tensor]:
        if crash_after is not None and len(made) == crash_after:
            raise Crash
        made.append(n)
        return {"test": torch.randn(n, 4, 2, generator=generator), "ood": torch.rand(n, 3, 2, generator=generator)}

    outputs = store.predict("sets", draw, 10, 3)
    return outputs, generator.get_state(), made


def test_a_killed_stage_resumes_to_the_unbroken_outputs_and_generator(tmp_path: Path) -> None:
    theta = torch.arange(5.0)
    unbroken, state, calls = _predict(tmp_path / "unbroken", theta)
    assert calls == [3, 3, 3, 1]
    with pytest.raises(Crash):
        _predict(tmp_path / "killed", theta, crash_after=2)
    resumed, resumed_state, resumed_calls = _predict(tmp_path / "killed", theta)
    assert resumed_calls == [3, 1]  # only the samples it lacked
    assert all(torch.equal(resumed[p], unbroken[p]) for p in unbroken)
    assert torch.equal(resumed_state, state)  # the generator left where the unbroken stage leaves it


def test_a_torn_append_is_ignored(tmp_path: Path) -> None:
    theta = torch.arange(5.0)
    unbroken, _, _ = _predict(tmp_path / "unbroken", theta)
    with pytest.raises(Crash):
        _predict(tmp_path / "killed", theta, crash_after=2)
    with open(tmp_path / "killed" / PREDICTIONS_DIR / "sets.test.bin", "ab") as file:
        file.write(b"\x01" * 13)  # part of a third chunk, written before the process died
    resumed, _, calls = _predict(tmp_path / "killed", theta)
    assert calls == [3, 1]
    assert all(torch.equal(resumed[p], unbroken[p]) for p in unbroken)


def test_the_outputs_of_another_fit_are_not_reused(tmp_path: Path) -> None:
    with pytest.raises(Crash):
        _predict(tmp_path, torch.arange(5.0), crash_after=2)
    _, _, calls = _predict(tmp_path, torch.arange(5.0) + 1e-6)  # another fit: another fingerprint
    assert calls == [3, 3, 3, 1]


def test_one_chunk_stores_nothing(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    store = PredictionStore(tmp_path, FakeMethod(torch.zeros(2)), generator)
    out = store.predict("test", lambda n: {"test": torch.randn(n, 2, generator=generator)}, 4, 4)
    assert out["test"].shape == (4, 2) and not (tmp_path / PREDICTIONS_DIR).exists()


@pytest.mark.parametrize("method", ["laplace", "dropout"])  # all sets per sample; set by set
def test_a_run_killed_in_its_evaluation_resumes_it_to_the_unbroken_metrics(
    tmp_path: Path, compose_cfg, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    assert torch.get_num_threads() == 1
    monkeypatch.setattr(runner, "chunk_size", lambda n_parameters, n_examples: 2)  # 5 test samples: 3 chunks
    cfg = compose_cfg([f"method={method}", "trainer.n_epochs=3", "trainer.checkpoint_every=1"])
    unbroken = run(cfg, tmp_path / "unbroken").metrics
    original = PredictionStore._record
    recorded: list[int] = []

    def record(self, stage, key, done, outputs, crash_at=None):  # noqa: ANN001, ANN202
        original(self, stage, key, done, outputs)
        recorded.append(done)
        if crash_at is not None and done == crash_at:
            raise Crash

    monkeypatch.setattr(PredictionStore, "_record", lambda *a: record(*a, crash_at=4))
    killed = tmp_path / "killed"
    with pytest.raises(Crash):
        run(cfg, killed)
    progress = json.loads((killed / PREDICTIONS_DIR / prediction_store.PROGRESS_FILE).read_text())
    assert [stage["done"] for stage in progress.values()] == [4]
    stage = "sets" if method == "laplace" else "test"
    assert run_progress(killed).endswith(f"3 epochs written, 4 of 5 final {stage} samples stored")  # bdl-bench status
    recorded.clear()
    monkeypatch.setattr(PredictionStore, "_record", lambda *a: record(*a))
    resumed = run(cfg, killed).metrics
    assert recorded == [5]  # one chunk, the last sample, drawn after the restart
    assert without_cost(resumed) == without_cost(unbroken)
    assert not (killed / PREDICTIONS_DIR).exists()  # removed once metrics.json is written


def test_the_fingerprint_reads_every_tensor_of_the_posterior_scalars_too() -> None:
    """A posterior's fields, 0-dim ones included (a scale), are part of what makes a fit the same fit."""
    import dataclasses

    from bdl_bench.orchestration.prediction_store import fingerprint

    @dataclasses.dataclass
    class Posterior:
        mean: torch.Tensor
        scale: torch.Tensor

    class WithPosterior(FakeMethod):
        def __init__(self, scale: float) -> None:
            super().__init__(torch.zeros(3))
            self.scale = scale

        def posterior(self) -> Posterior:  # type: ignore[override]
            return Posterior(torch.zeros(3), torch.tensor(self.scale))

    assert fingerprint(WithPosterior(1.0)) == fingerprint(WithPosterior(1.0))
    assert fingerprint(WithPosterior(1.0)) != fingerprint(WithPosterior(2.0))
