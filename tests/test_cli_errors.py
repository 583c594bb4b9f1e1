"""The CLI's error path, end to end in a subprocess: a user error is one line on stderr, ``bdl-bench:
<message>`` naming the key or file, exit status 1, no traceback and no ``metrics.json``; ``--debug`` shows
the traceback; the run folder still records the failure (with its traceback)."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def bdl(*args: str, cwd: Path, debug: bool = False) -> subprocess.CompletedProcess[str]:
    """``bdl-bench <args>`` in a subprocess running this checkout's code, offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "BDL_BENCH_DEBUG")}
    env.update(PYTHONPATH=str(REPO), BDL_BENCH_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "bdl_bench.orchestration.cli", *(["--debug"] if debug else []), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_one_line(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit status 1, exactly one stderr line ``bdl-bench: …`` holding every needle, no traceback."""
    lines = out.stderr.splitlines()
    assert out.returncode == 1, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("bdl-bench: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in out.stderr + out.stdout
    return lines[0]


SMOKE = ("trainer=smoke", "trainer.n_epochs=1", "method=map")

# (overrides, what the line must name)
BAD_RUNS = [
    (("trainer.n_epochs=-1",), ("trainer.n_epochs=-1", "integer >= 0")),
    (("trainer.n_epochs=0",), ("trainer.n_epochs=0", "trains nothing", "method.map_dir")),
    (("method.lr=nan",), ("method.lr=nan", "> 0")),
    (("data.split=20",), ("split=20", "0..19")),
    (("method=laplace", "method.structure=bogus"), ("structure 'bogus'", "kfac")),
    (("method.lr=1e30",), ("non-finite loss", "lower the learning rate")),  # divergence: NonFiniteLossError
]


@pytest.mark.parametrize(("overrides", "needles"), BAD_RUNS, ids=[" ".join(o) for o, _ in BAD_RUNS])
def test_a_bad_run_is_one_line_and_no_metrics(
    tmp_path: Path, overrides: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    out = bdl("run", *SMOKE, *overrides, f"results_root={tmp_path}", cwd=tmp_path)
    assert_one_line(out, *needles)
    assert not list(tmp_path.rglob("metrics.json"))
    (failure,) = tmp_path.rglob("failure.txt")  # the run folder keeps the traceback
    assert "Traceback" in failure.read_text() and (failure.parent / "failure.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu(tmp_path: Path) -> None:
    out = bdl("run", *SMOKE, "trainer.device=cuda", f"results_root={tmp_path}", cwd=tmp_path)
    assert_one_line(out, "trainer.device='cuda'", "trainer.device=auto or cpu")


def test_missing_and_corrupt_data_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = bdl("run", *SMOKE, f"data.root={empty}", f"results_root={tmp_path}", cwd=tmp_path)
    assert_one_line(out, f"{empty}/uci/bostonHousing/data.txt is missing")
    mirror = tmp_path / "mirror" / "mnist"
    mirror.mkdir(parents=True)
    (mirror / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b truncated download")
    out = bdl(
        "run",
        *SMOKE,
        "data=vision/mnist",
        "model=logreg",
        f"data.root={empty}",
        f"data.mirror={mirror.parent}",
        f"results_root={tmp_path}",
        cwd=tmp_path,
    )
    assert_one_line(out, "mnist/train-images-idx3-ubyte.gz", "differs from the recorded", "data.mirror=")
    assert not list(tmp_path.rglob("metrics.json"))


def test_output_folder_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "results").write_text("not a folder")
    out = bdl("run", *SMOKE, f"results_root={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line(out, f"{tmp_path / 'results'} is a file", "results_root=")


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    out = bdl("run", *SMOKE, "trainer.n_epochs=-1", f"results_root={tmp_path}", cwd=tmp_path, debug=True)
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "ConfigError: trainer.n_epochs=-1" in out.stderr


def test_a_sweep_lists_its_failed_members_without_tracebacks(tmp_path: Path) -> None:
    out = bdl("run", "-m", *SMOKE, "data.split=25,26", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr + out.stdout
    assert "bdl-bench: uci/boston: split=25 is out of range" in out.stderr
    assert "2 runs: 0 ran, 0 skipped (finished earlier), 2 failed" in out.stdout
    assert (
        "FAILED data.split=26,method=map,trainer.n_epochs=1,trainer=smoke: ConfigError: uci/boston: split=26"
        in out.stdout
    )


def test_command_line_mistakes_hydra_finds_are_one_line(tmp_path: Path) -> None:
    out = bdl("run", *SMOKE, "trainer.no_such_key=1", f"results_root={tmp_path}", cwd=tmp_path)
    assert_one_line(out, "trainer.no_such_key", "+trainer.no_such_key=1", "not in struct")
    out = bdl("run", *SMOKE, "data.split=[1", f"results_root={tmp_path}", cwd=tmp_path)
    assert_one_line(out, "'[1'", "override_grammar")
    out = bdl("run", "-m", *SMOKE, "trainer.no_such_key=1,2", f"results_root={tmp_path}", cwd=tmp_path)
    assert_one_line(out, "trainer.no_such_key")
    assert not list(tmp_path.rglob("metrics.json"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc refuses new folders on Linux")
def test_an_output_folder_the_system_refuses_is_one_line(tmp_path: Path) -> None:
    out = bdl("run", *SMOKE, "hydra.run.dir=/proc/bdl_bench_run", cwd=tmp_path)
    assert_one_line(out, "cannot make the output folder /proc/bdl_bench_run")


def test_a_bad_search_spec_fails_every_split_of_the_sweep_member(tmp_path: Path) -> None:
    bounds = "search.params.noise_precision=[1.0,0.1]"
    out = bdl("run", "-m", *SMOKE, "tune=uci", "method=bbb", "data=uci/yacht", "data.split=[0,1]", bounds, cwd=tmp_path)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr + out.stdout
    assert "\nbdl-bench: search.params.noise_precision=[1.0, 0.1]: bounds must satisfy 0 < low < high" in out.stderr
    assert "bdl-bench: bdl-bench:" not in out.stderr
    assert "2 runs: 0 ran, 0 skipped (finished earlier), 2 failed" in out.stdout  # each split's folder says so
    assert out.stdout.count("FAILED data.split=") == 2 and "bounds must satisfy" in out.stdout
    assert not list(tmp_path.rglob("metrics.json"))


def test_user_errors_keep_the_builtin_classes_their_callers_catch() -> None:
    from bdl_bench.data.archives import UnsafeArchiveError
    from bdl_bench.data.download import DownloadError
    from bdl_bench.errors import UserError
    from bdl_bench.methods.base import NonFiniteLossError
    from bdl_bench.orchestration.sweep import ConfigVersionError

    for cls, builtin in [
        (UnsafeArchiveError, ValueError),
        (DownloadError, FileNotFoundError),
        (NonFiniteLossError, FloatingPointError),
        (ConfigVersionError, RuntimeError),
    ]:
        assert issubclass(cls, UserError) and issubclass(cls, builtin)


def test_a_bug_still_shows_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Only user errors are shortened: any other exception inside a run keeps Hydra's traceback."""
    import bdl_bench.orchestration.sweep
    from bdl_bench.orchestration.cli import main

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("an internal invariant")

    monkeypatch.setattr(bdl_bench.orchestration.sweep, "run_job", broken)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["run", *SMOKE, f"results_root={tmp_path}"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'an internal invariant'" in err


def test_table_on_a_structure_sweep_with_a_cut_metrics_file(tmp_path: Path) -> None:
    """A real sweep over Laplace structures: one row per structure; a metrics.json cut short is skipped
    with one warning line (exit 0), refused with --strict (exit 1); an empty folder is one line."""
    sweep = tmp_path / "sweep"
    out = bdl(
        "run",
        "-m",
        *SMOKE,
        "method=laplace",
        "method.structure=diag,kfac",
        "data.split=0,1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    (cut,) = sweep.glob("data.split=1,*structure=kfac*/metrics.json")
    cut.write_text(cut.read_text()[:30])
    out = bdl("table", str(sweep), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"warning: skipped {cut}: unreadable or cut short")
    assert "| boston | laplace structure=diag | 2 |" in out.stdout
    assert "| boston | laplace structure=kfac | 1 |" in out.stdout
    assert_one_line(bdl("table", str(sweep), "--strict", cwd=tmp_path), str(cut), "cut short")
    (tmp_path / "empty").mkdir()
    assert_one_line(bdl("table", str(tmp_path / "empty"), cwd=tmp_path), "no finished runs", str(tmp_path / "empty"))


def _interrupt(command: list[str], cwd: Path, *, when: Any) -> tuple[int, str, str]:
    """Start ``command``, send SIGINT (Ctrl-C) once ``when(process)`` returns true, and return its exit
    status, the stderr lines read before and the stderr after."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), "BDL_BENCH_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a shell's background job ignores it
    )
    try:
        before = when(process)
        process.send_signal(signal.SIGINT)
        _, after = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, before, after


def _until_file(root: Path, pattern: str) -> Any:
    def wait(process: subprocess.Popen[str]) -> str:
        deadline = time.monotonic() + 120
        while not list(root.glob(pattern)):
            assert process.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.02)
        return ""

    return wait


def _first_stderr_line(process: subprocess.Popen[str]) -> str:
    assert process.stderr is not None
    return process.stderr.readline()


INTERRUPTED = re.compile(
    r"^bdl-bench: interrupted at epoch (\d+); checkpoint at epoch (\d+); run the same command to resume$"
)


@pytest.mark.parametrize(
    ("overrides", "run_dir"),
    [
        (("run", "method=map", "data=toy/cubic", "hydra.run.dir=out"), "out"),  # a single run
        (  # a sweep whose member stacks two splits
            ("run", "-m", "method=bbb", "data.split=[0,1]", "hydra.sweep.dir=sweep"),
            glob.escape("sweep/data.split=[0,1],") + "*",
        ),
    ],
    ids=["single run", "stacked sweep member"],
)
def test_ctrl_c_says_where_and_the_same_command_resumes(
    tmp_path: Path, overrides: tuple[str, ...], run_dir: str
) -> None:
    command = [
        sys.executable,
        "-m",
        "bdl_bench.orchestration.cli",
        *overrides,
        "trainer=smoke",
        "trainer.n_epochs=3000",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=1",
    ]
    status, _, err = _interrupt(command, tmp_path, when=_until_file(tmp_path, f"{run_dir}/checkpoint.pt"))
    (folder,) = tmp_path.glob(run_dir)
    assert status == 130, err
    (line,) = err.splitlines()
    match = INTERRUPTED.match(line)
    assert match, line
    epoch, saved = int(match[1]), int(match[2])
    assert 1 <= saved < epoch
    assert not list(tmp_path.rglob("metrics.json")) and not list(tmp_path.rglob("*.tmp"))
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"] == saved

    status, first, err = _interrupt(command, tmp_path, when=_first_stderr_line)
    assert first == f"{folder}: resuming from epoch {saved} (its checkpoint.pt)\n"
    assert status == 130 and INTERRUPTED.match(err.strip()), err


def test_a_reader_that_stops_early_gets_no_traceback() -> None:
    """``bdl-bench list | head -1``: the closed pipe ends the command quietly, not with a BrokenPipeError."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the first line: every write meets a closed pipe
    try:
        writer = subprocess.run(
            [sys.executable, "-m", "bdl_bench.orchestration.cli", "list"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in writer.stderr and "BrokenPipeError" not in writer.stderr, writer.stderr
