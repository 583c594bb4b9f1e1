"""Run-folder files: the history CSV stays valid as rows and columns arrive."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from bdl_bench.results import HistoryWriter, config_hash, read_csv_exact, read_history


def _read(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_history_appends_and_widens(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    writer = HistoryWriter(path)
    writer.append({"epoch": 1, "train/loss": 0.5})
    writer.append({"epoch": 2, "train/loss": 0.4})
    assert _read(path) == [{"epoch": "1", "train/loss": "0.5"}, {"epoch": "2", "train/loss": "0.4"}]
    writer.append({"epoch": 3, "train/loss": 0.3, "test/nll": 0.9})  # a new column: header widens
    rows = _read(path)
    assert list(rows[0]) == ["epoch", "train/loss", "test/nll"]
    assert rows[0]["test/nll"] == "" and rows[2]["test/nll"] == "0.9"
    writer.append({"epoch": 4, "train/loss": 0.2})
    assert [r["epoch"] for r in _read(path)] == ["1", "2", "3", "4"]


def test_history_resumed_rows_are_rewritten_first(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    path.write_text("stale\n")
    writer = HistoryWriter(path, rows=[{"epoch": 1, "train/loss": 0.5}])
    writer.append({"epoch": 2, "train/loss": 0.4})
    assert [r["epoch"] for r in _read(path)] == ["1", "2"]


def test_read_history_gives_back_the_appended_rows_exactly(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    rows = [
        {"epoch": 1, "train/loss": 0.1 + 0.2},  # a float whose repr needs all 17 digits
        {"epoch": 2, "train/loss": float("nan"), "test/nll": 1e-310},
        {"epoch": 3, "train/loss": float("inf")},
    ]
    writer = HistoryWriter(path)
    for row in rows:
        writer.append(row)
    back = read_history(path, 3)
    assert [r["epoch"] for r in back] == [1, 2, 3] and all(type(r["epoch"]) is int for r in back)
    assert back[0] == rows[0] and back[2] == rows[2]  # row 1's missing test/nll cell is left out again
    assert math.isnan(back[1]["train/loss"]) and back[1]["test/nll"] == 1e-310
    assert read_history(path, 1) == back[:1] and len(read_history(path, 2)) == 2 and read_history(path, 0) == []
    with pytest.raises(ValueError, match="holds 3 rows but the run's checkpoint needs 4"):
        read_history(path, 4)


def test_csv_floats_come_back_exactly_as_written(tmp_path: Path) -> None:
    """A searched value read back from search.csv must be the value the trial ran with, to the last bit: the
    test run's config (and its hash) is rebuilt from it. The default parser of pandas 2.2 and 3.0 missed the
    first of these by one ulp."""
    values = np.concatenate([[0.07460103817013915], np.exp(np.random.default_rng(0).uniform(-12, 8, 20000))])
    path = tmp_path / "search.csv"
    path.write_text(pd.DataFrame({"noise_precision": values}).to_csv(index=False))
    back = read_csv_exact(path)["noise_precision"].to_numpy()
    assert np.array_equal(back, values)


def test_code_version_names_the_commit_of_a_checkout_and_of_a_linked_worktree(tmp_path: Path) -> None:
    import os
    import subprocess

    from bdl_bench import __version__
    from bdl_bench.results import code_version

    def git(*args: str, cwd: Path = tmp_path / "repo") -> str:
        env = {
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
        }
        return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout

    (tmp_path / "repo").mkdir()
    git("init", "-q", "-b", "main")
    git("commit", "-q", "--allow-empty", "-m", "one")
    head = git("rev-parse", "HEAD").strip()
    assert code_version(tmp_path / "repo") == f"{__version__}+g{head[:10]}"
    git("worktree", "add", "-q", str(tmp_path / "linked"), "-b", "other")
    assert code_version(tmp_path / "linked") == f"{__version__}+g{head[:10]}"
    git("pack-refs", "--all")  # branches only in packed-refs
    assert code_version(tmp_path / "linked") == f"{__version__}+g{head[:10]}"
    assert code_version(tmp_path / "nowhere") == __version__


def test_what_reproduce_draws_or_compares_is_not_part_of_a_runs_config_hash() -> None:
    from bdl_bench.results import config_hash

    base = {"method": {"name": "slang", "rank": 1}, "data": {"name": "libsvm/australian"}}
    extra = {"figures": [{"name": "fig1", "kind": "covariance"}], "tolerance": {"nll": "2%"}, "protocol": "ours"}
    assert config_hash(base) == config_hash({**base, **extra})
    assert config_hash(base) != config_hash({**base, "method": {"name": "slang", "rank": 2}})


def test_results_written_atomically_get_the_mode_of_an_ordinary_new_file(tmp_path: Path) -> None:
    """A temporary file is created 0600; the result written through it must not stay hidden from the user's group
    (a shared results folder on a cluster): it gets 0666 less the umask, as ``open`` would give it."""
    from bdl_bench.results import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "metrics.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "metrics.json").stat().st_mode & 0o777 == 0o644


def test_a_ctrl_c_just_after_the_temporary_file_is_created_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C lands between bytecodes: one that arrives right after the temporary file exists (inside the call
    that creates it) must still remove it, and leave the old file whole."""
    from bdl_bench import results

    (tmp_path / "history.csv").write_text("old")
    real = os.open

    def interrupted(path, *args, **kwargs):
        fd = real(path, *args, **kwargs)
        if Path(path).name.endswith(".tmp"):
            os.close(fd)
            raise KeyboardInterrupt
        return fd

    monkeypatch.setattr(results.os, "open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        results.atomic_write_text(tmp_path / "history.csv", "new")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.csv"]
    assert (tmp_path / "history.csv").read_text() == "old"


@pytest.mark.parametrize(
    "overrides, group, key, value",
    [
        (["method=slang"], "method", "beta_decay", 0.25),
        (["method=bbb"], "method", "lr_decay", 0.25),
        (["data=toy/cubic"], "data", "standardise", False),
        (["method=laplace"], "method", "null_space", "deterministic"),
    ],
)
def test_options_added_later_leave_earlier_runs_hashes_while_null(compose_cfg, overrides, group, key, value) -> None:
    """SLANG's ``beta_decay``, BBB's ``lr_decay``, toy/cubic's ``standardise`` (for SLANG App. F.1) and Laplace's
    ``null_space`` (DEF's toy at tau = 0): a run made before them hashes as before while they are null, and
    differently once set."""
    config = OmegaConf.to_container(compose_cfg(overrides), resolve=True)
    assert config[group][key] is None
    before = {**config, group: {k: v for k, v in config[group].items() if k != key}}
    assert config_hash(config) == config_hash(before)
    assert config_hash({**config, group: {**config[group], key: value}}) != config_hash(config)
