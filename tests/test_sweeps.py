"""Sweep members: skip finished runs, refuse another config version, record failures; sweeps (basic,
joblib and submitit-local launchers) isolate a failing member, summarise, and exit non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bdl_bench.methods.base import NonFiniteLossError
from bdl_bench.orchestration.sweep import EXIT_MESSAGE, ConfigVersionError, run_job, summarise, version_warnings
from bdl_bench.results import read_run_record

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bdl_bench.orchestration.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_finished_run_is_skipped_and_force_reruns_it(tmp_path: Path, compose_cfg) -> None:
    first = run_job(compose_cfg(["method=map"]), tmp_path)
    assert not first.skipped
    stamp = (tmp_path / "metrics.json").stat().st_mtime_ns
    second = run_job(compose_cfg(["method=map"]), tmp_path)
    assert second.skipped and second.metrics == json.loads((tmp_path / "metrics.json").read_text())
    assert (tmp_path / "metrics.json").stat().st_mtime_ns == stamp
    assert read_run_record(tmp_path)["status"] == "skipped"
    # bookkeeping keys (progress bar, checkpoint period) are not part of what a run computes
    assert run_job(compose_cfg(["method=map", "trainer.progress=true", "trainer.checkpoint_every=1"]), tmp_path).skipped
    forced = run_job(compose_cfg(["method=map", "force=true"]), tmp_path)
    assert not forced.skipped and read_run_record(tmp_path)["attempts"] == 2
    assert forced.metrics["rmse"] == first.metrics["rmse"]


def test_finished_run_of_another_config_version_is_refused(tmp_path: Path, compose_cfg) -> None:
    run_job(compose_cfg(["method=map"]), tmp_path)
    with pytest.raises(ConfigVersionError, match="another config version .*force=true"):
        run_job(compose_cfg(["method=map", "trainer.n_test_mc_samples=7"]), tmp_path)
    failure = json.loads((tmp_path / "failure.json").read_text())
    assert failure["error_type"] == "ConfigVersionError"
    assert (tmp_path / "metrics.json").exists()  # the old run is kept, never overwritten silently
    assert any("later failed attempt" in w for w in version_warnings(tmp_path))


def test_failing_run_leaves_a_failure_record(tmp_path: Path, compose_cfg) -> None:
    with pytest.raises(NonFiniteLossError):
        run_job(compose_cfg(["method=map", "method.lr=1e30"]), tmp_path)
    failure = json.loads((tmp_path / "failure.json").read_text())
    assert failure["error_type"] == "NonFiniteLossError" and "non-finite loss" in failure["message"]
    assert failure["config"]["method"]["lr"] == 1e30 and "Traceback" in failure["traceback"]
    assert (tmp_path / "failure.txt").read_text().startswith("Traceback")
    assert read_run_record(tmp_path)["status"] == "failed" and not (tmp_path / "metrics.json").exists()
    summary = summarise(tmp_path, since=0)
    assert [p for p, _ in summary.failed] == [tmp_path] and "NonFiniteLossError" in summary.render()


def test_failure_under_submitit_ends_the_process_with_status_one(tmp_path: Path) -> None:
    """Hydra's submitit launcher returns a failed job's record as a result: without this the Slurm job
    would be COMPLETED (hydra#1928)."""
    script = (
        "import sys; from hydra import compose, initialize_config_dir\n"
        "from bdl_bench.orchestration.sweep import run_job\n"
        f"with initialize_config_dir({str(REPO / 'conf')!r}, version_base='1.3'):\n"
        "    cfg = compose('config', overrides=['trainer=smoke', 'method=slang', 'data.split=99'])\n"
        "try:\n"
        f"    run_job(cfg, {str(tmp_path)!r})\n"
        "except ValueError:\n"
        "    print('caught, as submitit would')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SUBMITIT_EXECUTOR": "local"},
    )
    assert "caught, as submitit would" in out.stdout
    assert out.returncode == 1 and EXIT_MESSAGE in out.stderr


# The CLI sweeps use SLANG: unlike the Adam-based methods it does not import torch._dynamo, which
# saves seconds in every job process.
@pytest.mark.slow
def test_joblib_sweep_isolates_a_failing_member(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    out = _cli(
        *("run", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "method=slang", "trainer=smoke"),
        *("data.split=0,99,1", f"hydra.sweep.dir={sweep}"),
        cwd=tmp_path,
    )
    assert out.returncode == 1, out.stderr
    assert "3 runs: 2 ran, 0 skipped (finished earlier), 1 failed" in out.stdout
    assert "FAILED data.split=99,method=slang,trainer=smoke: ConfigError: uci/boston: split=99" in out.stdout
    for split in (0, 1):  # the members before and after the failing one both finished
        assert (sweep / f"data.split={split},method=slang,trainer=smoke" / "metrics.json").exists()
    assert json.loads((sweep / "data.split=99,method=slang,trainer=smoke" / "failure.json").read_text())["config"]


@pytest.mark.slow
def test_submitit_local_sweep_marks_the_failed_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    out = _cli(
        "run",
        "-m",
        "hydra/launcher=submitit_local",
        "method=slang",
        "trainer=smoke",
        "data.split=0,1,99",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert out.returncode == 1, out.stderr
    assert "3 runs: 2 ran, 0 skipped (finished earlier), 1 failed" in out.stdout
    for split in (0, 1):
        assert (sweep / f"data.split={split},method=slang,trainer=smoke" / "metrics.json").exists()
    assert (sweep / "data.split=99,method=slang,trainer=smoke" / "failure.json").exists()
    logs = [p.read_text() for p in (sweep / ".submitit").rglob("*_log.err")]
    assert len(logs) == 3 and sum(EXIT_MESSAGE in log for log in logs) == 1


def test_example_slurm_launcher_config_composes() -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], return_hydra_config=True
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gpu"
    assert launcher.array_parallelism == 64 and launcher.max_num_timeout == 3


def test_a_failed_stacked_job_records_each_split_with_its_own_overrides(tmp_path: Path) -> None:
    """A stack that diverges records the failure in every split's folder with the overrides that re-run that split
    alone (``data.split=k``), as a failed single run records them."""
    out = _cli(
        *("run", "method=slang", "trainer=smoke", "data.split=[0,1]", "method.lr=1e30"),
        f"results_root={tmp_path / 'r'}",
        cwd=tmp_path,
    )
    assert out.returncode == 1, out.stderr
    for split in (0, 1):
        (folder,) = (tmp_path / "r").glob(f"*/data.split={split},*")
        assert f"data.split={split}" in json.loads((folder / "failure.json").read_text())["overrides"]
