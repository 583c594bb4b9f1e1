"""The CLI's error path, end to end in a subprocess: a user error is one line on stderr, ``bdl-bench:
<message>`` naming the key or file, exit status 1, no traceback and no ``metrics.json``; ``--debug`` shows
the traceback; the run folder still records the failure (with its traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def bdl(*args: str, cwd: Path, debug: bool = False) -> subprocess.CompletedProcess[str]:
    """``bdl-bench <args>`` in a subprocess running this checkout's code, offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "BDL_BENCH_DEBUG")}
    env.update(PYTHONPATH=str(REPO), BDL_BENCH_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "bdl_bench.cli", *(["--debug"] if debug else []), *args]
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


def test_user_errors_keep_the_builtin_classes_their_callers_catch() -> None:
    from bdl_bench.data.archives import UnsafeArchiveError
    from bdl_bench.data.download import ChecksumError, DownloadError
    from bdl_bench.errors import UserError
    from bdl_bench.methods.base import NonFiniteLossError
    from bdl_bench.sweep import ConfigVersionError

    for cls, builtin in [
        (UnsafeArchiveError, ValueError),
        (ChecksumError, FileNotFoundError),
        (DownloadError, FileNotFoundError),
        (NonFiniteLossError, FloatingPointError),
        (ConfigVersionError, RuntimeError),
    ]:
        assert issubclass(cls, UserError) and issubclass(cls, builtin)


def test_a_bug_still_shows_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Only user errors are shortened: any other exception inside a run keeps Hydra's traceback."""
    import bdl_bench.sweep
    from bdl_bench.cli import main

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("an internal invariant")

    monkeypatch.setattr(bdl_bench.sweep, "run_job", broken)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["run", *SMOKE, f"results_root={tmp_path}"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'an internal invariant'" in err
