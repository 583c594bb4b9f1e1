"""Faults a cluster user meets: two processes on one run folder (bdl_bench/orchestration/locking.py), a full, read-only or
vanished results folder (bdl_bench/orchestration/write_errors.py), SIGTERM at a time limit (bdl_bench/orchestration/sigterm.py), and
``bdl-bench status`` over a folder of runs in every state (bdl_bench/orchestration/status.py)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _runs import without_cost

from bdl_bench.checkpoint import load_checkpoint
from bdl_bench.errors import Terminated
from bdl_bench.orchestration import locking
from bdl_bench.orchestration.runner import run
from bdl_bench.orchestration.sigterm import stop_at_epoch_end
from bdl_bench.orchestration.status import folder_status
from bdl_bench.orchestration.sweep import run_job
from bdl_bench.orchestration.write_errors import WriteError
from bdl_bench.results import append_whole, read_run_record

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "BDL_BENCH_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
FAST = ["method=map", "trainer=smoke", "trainer.eval_every=0", "trainer.threads=1"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "bdl_bench.orchestration.cli", *args]


def _same_metrics(a: dict, b: dict) -> None:
    assert without_cost(a) == without_cost(b)  # wall and CPU time, memory: the only things allowed to differ


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _write_lock(folder: Path, **fields) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "token": "other", **fields}
    (folder / locking.LOCK_FILE).write_text(json.dumps(record))


# --- one writer per folder ---------------------------------------------------------------------------------


def test_a_held_folder_is_refused_naming_its_holder_and_freed_on_release(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    locking.acquire(folder)
    try:
        probe = "from bdl_bench.orchestration import locking; import sys; locking.acquire(sys.argv[1])"
        out = subprocess.run([sys.executable, "-c", probe, str(folder)], env=ENV, capture_output=True, text=True)
        assert out.returncode == 1
        holder = f"FolderInUse: {folder} is in use by another process (host {socket.gethostname()}, pid {os.getpid()}, "
        assert holder in out.stderr and "last heartbeat" in out.stderr
        locking.acquire(folder)  # re-entrant within the process that holds it
        locking.release(folder)
        assert locking.lock_state(folder)[0] == "held"
    finally:
        locking.release(folder)
    assert locking.lock_state(folder) == ("free", None)
    out = subprocess.run([sys.executable, "-c", probe, str(folder)], env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_stale_locks_are_recognised_and_taken_over(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = tmp_path / "dead"  # same host, its pid has ended
    _write_lock(dead, pid=_dead_pid())
    assert locking.lock_state(dead)[0] == "stale"
    with locking.holding([dead]):
        assert locking.read_holder(dead).pid == os.getpid()
    assert "took over the lock of a process that is gone" in capsys.readouterr().err

    reused = tmp_path / "reused"  # same host, the pid is alive but started at another time: it was reused
    _write_lock(reused, pid=os.getppid(), pid_start="1")
    assert locking.lock_state(reused)[0] == "stale"
    _write_lock(reused, pid=os.getppid(), pid_start=locking._pid_start(os.getppid()))
    assert locking.lock_state(reused)[0] == "held"

    ours = tmp_path / "ours"  # our own pid, but not a lock this process took: an earlier process's
    _write_lock(ours)
    assert locking.lock_state(ours)[0] == "stale"

    remote = tmp_path / "remote"  # another host: stale only after STALE_AFTER_S without a heartbeat
    _write_lock(remote, host="node-that-is-not-this-one", pid=1)
    assert locking.lock_state(remote)[0] == "held"
    old = time.time() - locking.STALE_AFTER_S - 5
    os.utime(remote / locking.LOCK_FILE, (old, old))
    assert locking.lock_state(remote)[0] == "stale"


def test_force_does_not_break_a_live_lock_and_the_folder_is_not_touched(tmp_path: Path, compose_cfg) -> None:
    run_dir = tmp_path / "run"
    _write_lock(run_dir, pid=os.getppid(), pid_start=locking._pid_start(os.getppid()))  # a live process
    with pytest.raises(locking.FolderInUse, match=f"{run_dir} is in use by another process"):
        run_job(compose_cfg([*FAST, "force=true"]), run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [locking.LOCK_FILE]


def test_a_stacked_job_locks_its_folder_and_every_split_folder(tmp_path: Path, compose_cfg) -> None:
    cfg = compose_cfg(["method=bbb", "data.split=[0,1]", "trainer.n_epochs=1"])
    held = tmp_path / "stack" / "split=1"
    locking.acquire(held)  # this process holds it; a job of another process would be refused as below
    try:
        probe = (
            "import sys; from hydra import compose, initialize_config_dir; from bdl_bench.orchestration.sweep import run_job\n"
            f"with initialize_config_dir({str(REPO / 'conf')!r}, version_base='1.3'):\n"
            "    cfg = compose('config', overrides=sys.argv[2:])\n"
            "run_job(cfg, sys.argv[1])"
        )
        overrides = ["trainer=smoke", "method=bbb", "data.split=[0,1]", "trainer.n_epochs=1"]
        out = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path / "stack"), *overrides], env=ENV, capture_output=True, text=True
        )
        assert out.returncode == 1 and f"FolderInUse: {held} is in use" in out.stderr, out.stderr
        assert not list((tmp_path / "stack" / "split=0").iterdir())  # nothing was run: its lock came and went
        assert locking.lock_state(tmp_path / "stack") == ("free", None)  # the job's own lock was given back
    finally:
        locking.release(held)
    assert not run_job(cfg, tmp_path / "stack").skipped


@pytest.mark.slow
def test_two_identical_commands_started_together_train_once(tmp_path: Path) -> None:
    n_epochs = 150
    command = _cli("run", *FAST, f"trainer.n_epochs={n_epochs}", f"hydra.run.dir={tmp_path / 'run'}")
    processes = [
        subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in processes]
    codes = sorted(p.returncode for p in processes)
    assert codes == [0, 1], outputs
    (loser_err,) = [err for p, (_, err) in zip(processes, outputs) if p.returncode == 1]
    winner = next(p for p in processes if p.returncode == 0)
    (line,) = loser_err.splitlines()
    assert line.startswith(f"bdl-bench: {tmp_path / 'run'} is in use by another process (host {socket.gethostname()}")
    assert f"pid {winner.pid}, since" in line
    epochs = [row.split(",")[0] for row in (tmp_path / "run" / "history.csv").read_text().splitlines()[1:]]
    assert epochs == [str(e) for e in range(1, n_epochs + 1)]  # one row per epoch, none twice
    assert read_run_record(tmp_path / "run")["attempts"] == 1
    assert not (tmp_path / "run" / locking.LOCK_FILE).exists()


@pytest.mark.slow
def test_a_sweep_member_running_elsewhere_is_listed_and_the_others_go_on(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    held = sweep / "data.split=1,method=map,trainer.eval_every=0,trainer=smoke"
    locking.acquire(held)
    try:
        out = subprocess.run(
            _cli("run", "-m", "method=map", "trainer=smoke", "trainer.eval_every=0", "data.split=0,1,2")
            + [f"hydra.sweep.dir={sweep}"],
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        locking.release(held)
    assert out.returncode == 1, out.stderr
    assert "3 runs: 2 ran, 0 skipped (finished earlier), 0 failed, 0 unfinished, 1 running elsewhere" in out.stdout
    assert f"RUNNING ELSEWHERE {held.name}: host {socket.gethostname()}, pid {os.getpid()}, since" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    for split in (0, 2):
        assert (sweep / f"data.split={split},method=map,trainer.eval_every=0,trainer=smoke" / "metrics.json").exists()
    assert not (held / "run.json").exists() and not (held / "history.csv").exists()


# --- write errors ------------------------------------------------------------------------------------------


def _fail_after(n_ok: int, code: int, calls: list[int]):
    """A stand-in for ``os.fsync`` that fails with ``code`` after ``n_ok`` calls (a disk that fills up)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) > n_ok:
            raise OSError(code, os.strerror(code))
        real(fd)

    return fsync


def test_a_full_disk_mid_run_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path: Path, compose_cfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up at epoch 3's checkpoint: a WriteError naming the file, the cause and the free space;
    the checkpoint of epoch 2 and every finished file stay whole; no temporary file is left."""
    cfg = compose_cfg([*FAST, "trainer.n_epochs=5", "trainer.checkpoint_every=1"])
    run_dir = tmp_path / "run"
    from bdl_bench import checkpoint as checkpoint_module

    saves: list[int] = []
    real_save = checkpoint_module.atomic_write_bytes

    def filling(path: Path, data: bytes) -> None:
        saves.append(1)
        if len(saves) == 3:  # epoch 3's checkpoint: the bytes go out, the disk is full
            monkeypatch.setattr(os, "fsync", _fail_after(0, errno.ENOSPC, []))
        real_save(path, data)

    monkeypatch.setattr(checkpoint_module, "atomic_write_bytes", filling)
    with pytest.raises(WriteError) as caught:
        run_job(cfg, run_dir)
    message = str(caught.value)
    assert message.startswith(f"cannot write {run_dir / 'checkpoint.pt'}: no space left on the device (")
    assert " free of " in message and message.endswith("could not be written either")
    assert "\n" not in message
    assert load_checkpoint(run_dir / "checkpoint.pt").epoch == 2
    assert not list(run_dir.glob(".*.tmp"))
    assert (run_dir / "history.csv").read_text().count("\n") == 4  # header + 3 whole rows
    assert read_run_record(run_dir)["status"] == "running"  # its record could not be written: the line says so
    monkeypatch.undo()
    assert not run_job(cfg, run_dir).skipped  # room again: it resumes from epoch 2
    _same_metrics(json.loads((run_dir / "metrics.json").read_text()), run(cfg, tmp_path / "unbroken").metrics)


def test_a_read_only_folder_is_one_line_and_the_failure_is_recorded_when_it_can_be(
    tmp_path: Path, compose_cfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = compose_cfg([*FAST, "trainer.n_epochs=2"])
    run_dir = tmp_path / "run"
    from bdl_bench import results

    real = os.open

    def read_only_metrics(path, *args, **kwargs):
        if Path(path).name.startswith(".metrics.json"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(results.os, "open", read_only_metrics)
    with pytest.raises(
        WriteError,
        match=rf"^cannot write {re.escape(str(run_dir))}/metrics.json: the file system is read-only; the files",
    ):
        run_job(cfg, run_dir)
    assert not (run_dir / "metrics.json").exists()
    assert json.loads((run_dir / "failure.json").read_text())["error_type"] == "WriteError"
    assert read_run_record(run_dir)["status"] == "failed"


def test_a_vanished_run_folder_is_one_line(tmp_path: Path, compose_cfg, at_epoch_end) -> None:
    run_dir = tmp_path / "run"

    def vanish(epoch: int) -> None:
        if epoch == 1:
            shutil.rmtree(run_dir)

    message = f"cannot write {re.escape(str(run_dir))}/history.csv: the folder vanished"
    with at_epoch_end(vanish), pytest.raises(WriteError, match=message):
        run_job(compose_cfg([*FAST, "trainer.n_epochs=3"]), run_dir)


def test_a_failed_append_leaves_no_half_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "history.csv"
    path.write_text("epoch,loss\n1,0.5\n")
    real = os.write

    def half(fd: int, data: bytes) -> int:
        if len(data) > 4:
            return real(fd, data[:4])  # a short write; the rest then fails
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half)
    with pytest.raises(OSError) as caught:
        append_whole(path, "2,0.25\n")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    monkeypatch.undo()
    assert path.read_text() == "epoch,loss\n1,0.5\n"


def _tmpfs(tmp_path: Path, size: str) -> Path:
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return mount


@pytest.mark.slow
@pytest.mark.parametrize("size", ["24k", "40k"])
def test_a_run_on_a_tiny_file_system_is_one_line(tmp_path: Path, size: str) -> None:
    """On a 24 KiB tmpfs the run's record cannot be written; on 40 KiB its first checkpoint cannot."""
    mount = _tmpfs(tmp_path, size)
    try:
        out = subprocess.run(
            _cli("run", *FAST, "trainer.n_epochs=3", "trainer.checkpoint_every=1", f"hydra.run.dir={mount / 'run'}"),
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        (line,) = out.stderr.splitlines()
        assert out.returncode == 1
        assert re.match(
            rf"bdl-bench: cannot write {re.escape(str(mount))}/run/\S+: no space left on the device \(", line
        )
        assert "Traceback" not in out.stdout
        assert not list(mount.rglob("*.tmp"))
        for name in ("config.yaml", "run.json", "failure.json"):  # whole or absent
            if (mount / "run" / name).exists() and name != "config.yaml":
                json.loads((mount / "run" / name).read_text())
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# --- SIGTERM -----------------------------------------------------------------------------------------------

STOPPED = re.compile(
    r"^bdl-bench: stopped by SIGTERM after epoch (\d+); checkpoint at epoch (\d+); run the same command to resume$"
)


@pytest.mark.slow
def test_sigterm_mid_run_checkpoints_that_epoch_and_the_rerun_ends_as_an_unbroken_run(
    tmp_path: Path, compose_cfg
) -> None:
    overrides = [*FAST, "trainer.n_epochs=120", "trainer.checkpoint_every=0"]  # SIGTERM writes one all the same
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        _cli("run", *overrides, f"hydra.run.dir={run_dir}"),
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    history = run_dir / "history.csv"
    while not (history.exists() and history.read_text().count("\n") > 5):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before it could be stopped"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    (line,) = err.splitlines()
    match = STOPPED.match(line)
    assert match, line
    epoch = int(match[1])
    assert int(match[2]) == epoch and 5 <= epoch < 120
    assert load_checkpoint(run_dir / "checkpoint.pt").epoch == epoch
    assert history.read_text().count("\n") == epoch + 1
    assert read_run_record(run_dir)["status"] == "interrupted"
    assert not (run_dir / locking.LOCK_FILE).exists()
    # the re-run resumes (in this process: the CLI runs the same run_job) and ends as an unbroken run
    assert not run_job(compose_cfg(overrides), run_dir).skipped
    _same_metrics(
        json.loads((run_dir / "metrics.json").read_text()), run(compose_cfg(overrides), tmp_path / "u").metrics
    )


def test_sigterm_in_a_stacked_job_stops_at_the_epoch_end_and_resumes(tmp_path: Path, compose_cfg, at_epoch_end) -> None:
    overrides = ["method=bbb", "data.split=[0,1]", "trainer.n_epochs=4", "trainer.eval_every=0"]

    def sigterm_in_epoch_2(epoch: int) -> None:
        if epoch == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    with (
        at_epoch_end(sigterm_in_epoch_2),
        pytest.raises(Terminated, match="stopped by SIGTERM after epoch 2; checkpoint at epoch 2"),
    ):
        run_job(compose_cfg(overrides), tmp_path / "stack")
    assert signal.getsignal(signal.SIGTERM) == handler  # given back
    assert load_checkpoint(tmp_path / "stack" / "checkpoint.pt").epoch == 2
    for split in (0, 1):
        assert read_run_record(tmp_path / "stack" / f"split={split}")["status"] == "interrupted"
    run_job(compose_cfg(overrides), tmp_path / "stack")
    unbroken = run_job(compose_cfg(overrides), tmp_path / "unbroken")
    for split in (0, 1):
        _same_metrics(
            json.loads((tmp_path / "stack" / f"split={split}" / "metrics.json").read_text()),
            json.loads((tmp_path / "unbroken" / f"split={split}" / "metrics.json").read_text()),
        )
    assert unbroken.metrics


def test_sigterm_outside_the_epochs_stops_at_once() -> None:
    class Flags:
        in_epochs = False
        stop_requested = False

    flags = Flags()
    with pytest.raises(Terminated), stop_at_epoch_end(flags):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    flags.in_epochs = True
    with stop_at_epoch_end(flags):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    assert flags.stop_requested


# --- bdl-bench status --------------------------------------------------------------------------------------


def test_status_lists_finished_failed_running_and_stale_runs(tmp_path: Path, capsys) -> None:
    from bdl_bench.orchestration.cli import main

    def make(name: str, status: str, *, metrics: bool = False, failure: str | None = None) -> Path:
        folder = tmp_path / "sweep" / name
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text("method: {name: map}\n")
        record = {"status": status, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        (folder / "run.json").write_text(json.dumps(record))
        (folder / "history.csv").write_text("epoch,loss\n1,0.5\n2,0.4\n")
        if metrics:
            (folder / "metrics.json").write_text('{"rmse": 1.0}')
        if failure:
            (folder / "failure.json").write_text(json.dumps({"error_type": "DivergenceError", "message": failure}))
        return folder

    make("a_finished", "finished", metrics=True)
    make("b_skipped", "skipped", metrics=True)
    make("c_failed", "failed", failure="method 'map': non-finite loss\nlower the learning rate")
    running = make("d_running", "running")
    _write_lock(make("e_stale_lock", "running"), pid=_dead_pid())
    make("f_killed", "running")  # run.json says running, no lock: killed by SIGKILL (or the node died)
    make("g_interrupted", "interrupted")
    (tmp_path / "sweep" / ".search" / "split=0").mkdir(parents=True)  # hidden folders are not runs
    (tmp_path / "sweep" / ".search" / "split=0" / "config.yaml").write_text("{}")
    with locking.holding([running]):
        status = folder_status(tmp_path / "sweep")
        main(["status", str(tmp_path / "sweep")])
    out = capsys.readouterr().out
    assert {k: [p.name for p, _ in v] for k, v in status.runs.items()} == {
        "finished": ["a_finished", "b_skipped"],
        "failed": ["c_failed"],
        "running": ["d_running"],
        "stale": ["e_stale_lock", "f_killed"],
        "interrupted": ["g_interrupted"],
        "not started": [],
    }
    lines = out.splitlines()
    assert lines[0] == f"{tmp_path / 'sweep'}: 7 runs: 2 finished, 1 failed, 1 running, 2 stale, 1 interrupted"
    assert "  FAILED c_failed: DivergenceError: method 'map': non-finite loss lower the learning rate" in lines
    (running_line,) = [line for line in lines if line.startswith("  RUNNING d_running: ")]
    assert f"host {socket.gethostname()}, pid {os.getpid()}, since " in running_line
    assert re.search(r"last heartbeat \d+ s ago, 2 epochs written$", running_line)
    (stale,) = [line for line in lines if line.startswith("  STALE e_stale_lock: holder gone (")]
    assert "the same command resumes it" in stale
    assert any(line.startswith("  STALE f_killed: run.json says running (") for line in lines)


def test_an_unreadable_lock_is_removed_once_old(tmp_path: Path) -> None:
    """A process killed between making its lock file and writing its name leaves an empty file."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / locking.LOCK_FILE).write_text("")
    assert locking.lock_state(folder) == ("free", None)
    with pytest.raises(locking.FolderInUse, match="could not take its lock"):
        locking.acquire(folder)  # a fresh empty file may be a lock being written: not broken
    old = time.time() - locking.BREAK_STALE_AFTER_S - 5
    os.utime(folder / locking.LOCK_FILE, (old, old))
    with locking.holding([folder]):
        assert locking.read_holder(folder).pid == os.getpid()


def test_sigterm_during_a_laplace_search_stops_it_between_points(
    tmp_path: Path, compose_cfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The search is part of the fit (hours on DEF Table 1) and resumes point by point, so a SIGTERM stops it
    before its next point rather than at the fit's end; the rerun scores only the rest."""
    from bdl_bench.methods.laplace import search as search_module

    overrides = [
        "method=laplace",
        "data=toy/cubic",
        "data.n_train=40",
        "data.val_fraction=0.25",
        "method.structure=diag",
        "method.search={dataset_scale: [10, 30], prior_precision: [0.1, 1, 10], criterion: nll, n_samples: 4}",
    ]
    calls: list[int] = []
    original = search_module.predictive_metrics

    def metrics(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 3:  # the MAP's reference, then two points: a SIGTERM arrives while the 2nd is scored
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(search_module, "predictive_metrics", metrics)
    kept = "its 2 scored points kept in laplace_search.progress.jsonl"
    with pytest.raises(Terminated, match=rf"stopped by SIGTERM during the Laplace search \({kept}\); run the same"):
        run_job(compose_cfg(overrides), tmp_path / "run")
    assert len(calls) == 3  # no third point was scored
    progress = (tmp_path / "run" / search_module.PROGRESS_FILE).read_text().splitlines()
    assert len(progress) == 1 + 2
    calls.clear()
    monkeypatch.setattr(search_module, "predictive_metrics", original)
    run_job(compose_cfg(overrides), tmp_path / "run")
    assert (tmp_path / "run" / "metrics.json").exists()
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["search_n_resumed"] == 2


def test_a_stop_after_the_epochs_names_the_fit_or_the_evaluation(tmp_path: Path) -> None:
    """After the last epoch a run is either still fitting (a post-hoc posterior, its search) or evaluating."""
    from bdl_bench.orchestration.sigterm import EpochProgress

    progress = EpochProgress(5, 5, 0, tmp_path / "checkpoint.pt")
    assert "after epoch 5 (fitting)" in str(progress.interrupted(terminated=True))
    progress.evaluating = True
    assert "after epoch 5 (evaluating)" in str(progress.interrupted(terminated=True))
    assert "after epoch 5 (evaluating)" in str(progress.interrupted())
