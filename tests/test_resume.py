"""A run killed after some epochs resumes from its checkpoint to exactly the metrics of an unbroken run
(CPU, one torch thread, same seed)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from _runs import without_cost

from bdl_bench.checkpoint import load_checkpoint
from bdl_bench.errors import UserError
from bdl_bench.orchestration import sweep
from bdl_bench.orchestration.resume import CheckpointDeviceError, checkpoint_histories
from bdl_bench.orchestration.runner import run
from bdl_bench.orchestration.sweep import run_job, version_warnings
from bdl_bench.results import read_run_record


class Crash(Exception):
    """Stands for the process dying after an epoch."""


def _crash_after(epoch: int):
    def hook(done: int) -> None:
        if done == epoch:
            raise Crash(f"killed after epoch {done}")

    return hook


def _history_without_times(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "history.csv").open() as f:
        return [{k: v for k, v in row.items() if k != "time_s"} for row in csv.DictReader(f)]


def _same_metrics(a: dict, b: dict) -> None:
    assert without_cost(a) == without_cost(b)  # wall and CPU time, memory: the only things allowed to differ


@pytest.mark.parametrize("method", ["map", "bbb", "dropout", "slang", "laplace", "hmc"])
def test_run_killed_after_epoch_3_resumes_to_the_unbroken_metrics(
    tmp_path: Path, compose_cfg, at_epoch_end, method: str
) -> None:
    """(Laplace and HMC: killed while training the MAP, then their posterior fitted at the end.)"""
    assert torch.get_num_threads() == 1
    short_chain = ["method.n_samples=20", "method.n_warmup=10", "method.n_leapfrog=5"] if method == "hmc" else []
    cfg = compose_cfg([f"method={method}", "trainer.n_epochs=5", "trainer.checkpoint_every=2", *short_chain])
    unbroken = run(cfg, tmp_path / "unbroken").metrics
    killed = tmp_path / "killed"
    with at_epoch_end(_crash_after(3)), pytest.raises(Crash):
        run_job(cfg, killed)
    assert not (killed / "metrics.json").exists()
    checkpoint = load_checkpoint(killed / "checkpoint.pt")
    assert checkpoint is not None and checkpoint.epoch == 2 and checkpoint.history_rows == 2
    assert checkpoint.history == []  # the rows stay in history.csv, which already has epoch 3's row too
    assert len((killed / "history.csv").read_text().splitlines()) == 1 + 3
    resumed = run_job(cfg, killed)
    assert not resumed.skipped and read_run_record(killed)["attempts"] == 2
    _same_metrics(json.loads((killed / "metrics.json").read_text()), unbroken)
    assert _history_without_times(killed) == _history_without_times(tmp_path / "unbroken")
    assert not (killed / "checkpoint.pt").exists()  # removed once metrics.json is written


def test_a_run_resumed_under_another_code_version_is_named_in_the_warnings(
    tmp_path: Path, compose_cfg, at_epoch_end, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = compose_cfg(["method=map", "trainer.n_epochs=4", "trainer.checkpoint_every=1"])
    monkeypatch.setattr(sweep, "code_version", lambda: "0.1.0+gaaaaaaa111")
    with at_epoch_end(_crash_after(2)), pytest.raises(Crash):
        run_job(cfg, tmp_path / "killed")
    run_job(cfg, tmp_path / "whole")  # one attempt, one version: nothing to say
    assert read_run_record(tmp_path / "whole")["code_versions"] == ["0.1.0+gaaaaaaa111"]
    monkeypatch.setattr(sweep, "code_version", lambda: "0.1.0+gbbbbbbb222")
    run_job(cfg, tmp_path / "killed")
    record = read_run_record(tmp_path / "killed")
    assert record["code_versions"] == ["0.1.0+gaaaaaaa111", "0.1.0+gbbbbbbb222"] and record["attempts"] == 2
    spanning = [w for w in version_warnings(tmp_path) if "resumed or retried" in w]
    assert spanning == [
        "1 run(s) resumed or retried under more than one code version, in order (killed: aaaaaaa → bbbbbbb)"
    ]
    assert run_job(cfg, tmp_path / "killed").skipped  # finished: the record stays
    assert read_run_record(tmp_path / "killed")["code_versions"] == ["0.1.0+gaaaaaaa111", "0.1.0+gbbbbbbb222"]
    forced = compose_cfg(["method=map", "trainer.n_epochs=4", "trainer.checkpoint_every=1", "force=true"])
    run_job(forced, tmp_path / "killed")  # started afresh: only today's version made it
    assert read_run_record(tmp_path / "killed")["code_versions"] == ["0.1.0+gbbbbbbb222"]


def test_checkpoint_of_another_config_is_not_applied(tmp_path: Path, compose_cfg, at_epoch_end) -> None:
    with at_epoch_end(_crash_after(1)), pytest.raises(Crash):
        run(compose_cfg(["method=map", "trainer.n_epochs=3", "trainer.checkpoint_every=1"]), tmp_path)
    with pytest.raises(ValueError, match="belongs to another config .*force=true"):
        run(compose_cfg(["method=map", "trainer.n_epochs=3", "method.lr=0.02"]), tmp_path)


def test_checkpoint_names_its_device_and_is_refused_on_another(tmp_path: Path, compose_cfg, at_epoch_end) -> None:
    """A GPU run's checkpoint is not resumed by a CPU re-run (the generator states differ in size): one line
    naming both devices and the fix. run.json records the device and versions."""
    cfg = compose_cfg(["method=map", "trainer.n_epochs=3", "trainer.checkpoint_every=1", "trainer.device=cpu"])
    with at_epoch_end(_crash_after(1)), pytest.raises(Crash):
        run(cfg, tmp_path)
    record = read_run_record(tmp_path)
    assert record["device"] == "cpu" and record["torch_version"] == torch.__version__
    assert record["packages"]["pandas"] == pd.__version__ and record["packages"]["hydra-core"]
    assert "cuda_version" in record
    checkpoint = load_checkpoint(tmp_path / "checkpoint.pt")
    assert checkpoint is not None and checkpoint.device == "cpu"
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    torch.save({**state, "device": "cuda"}, tmp_path / "checkpoint.pt")  # as a GPU run leaves it
    with pytest.raises(CheckpointDeviceError, match="written on cuda and this run is on cpu.*trainer.device=cuda"):
        run(cfg, tmp_path)
    assert isinstance(CheckpointDeviceError("x"), UserError)


@pytest.mark.slow
def test_sigkilled_cli_run_resumes_to_the_unbroken_metrics(tmp_path: Path, compose_cfg) -> None:
    overrides = [
        "method=map",
        "trainer=smoke",
        "trainer.n_epochs=200",
        "trainer.batch_size=100",
        "trainer.eval_every=0",
    ]
    overrides += ["trainer.checkpoint_every=1"]
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "bdl_bench.orchestration.cli", "run", *overrides, f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoint.pt").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not (run_dir / "metrics.json").exists(), "the run finished before it could be killed"
    assert read_run_record(run_dir)["status"] == "running"  # no chance to record anything
    # the re-run resumes in this process (the CLI runs the same run_job; this saves a second start-up)
    assert not run_job(compose_cfg(overrides), run_dir).skipped
    unbroken = run(compose_cfg(overrides), tmp_path / "unbroken").metrics
    _same_metrics(json.loads((run_dir / "metrics.json").read_text()), unbroken)


def test_checkpoint_written_before_row_counts_still_resumes_its_rows(tmp_path: Path) -> None:
    """A checkpoint from before ``history_rows`` stored the rows themselves (key ``history``); it still loads."""
    legacy = {
        "epoch": 1,
        "config_hash": "abc",
        "method": {},
        "generators": {},
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": None,
        "history": [{"epoch": 1, "train/loss": 0.5}],
        "elapsed_s": 1.0,
    }
    torch.save(legacy, tmp_path / "checkpoint.pt")
    checkpoint = load_checkpoint(tmp_path / "checkpoint.pt")
    assert checkpoint is not None and checkpoint.history_rows is None
    assert checkpoint_histories(checkpoint, [tmp_path / "history.csv"], single=True) == [
        [{"epoch": 1, "train/loss": 0.5}]
    ]
