"""The CLI end to end: `bdl-bench run` into a temp folder, then `bdl-bench table` reads it back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bdl_bench.orchestration.hydra_app import check_group_overrides, group_choices


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bdl_bench.orchestration.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_run_then_table(tmp_path: Path) -> None:
    out = _cli(
        "run", "-m", "method=map", "trainer=smoke", "data.split=0,1", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    metrics = sorted((tmp_path / "sweep").rglob("metrics.json"))
    assert len(metrics) == 2
    for path in metrics:
        values = json.loads(path.read_text())
        assert values["rmse"] > 0 and values["test_ll"] < 0
        assert (path.parent / "history.csv").read_text().startswith("epoch,")
        assert (path.parent / "config.yaml").exists()
    table = _cli("table", str(tmp_path / "sweep"), cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "| boston | map | 2 |" in table.stdout
    assert (tmp_path / "sweep" / "table.csv").exists()


def test_run_dir_override_and_cfg_job(tmp_path: Path) -> None:
    out = _cli("run", "method=map", "trainer=smoke", f"hydra.run.dir={tmp_path}/one", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "one" / "metrics.json").exists()
    cfg = _cli("run", "--cfg", "job", "method=bbb", cwd=tmp_path)
    assert cfg.returncode == 0, cfg.stderr
    assert "name: bbb" in cfg.stdout


def test_unknown_group_option_lists_choices() -> None:
    with pytest.raises(SystemExit, match="unknown data 'uci/no_such_set'; available: .*uci/boston"):
        check_group_overrides(["data=uci/no_such_set"])
    with pytest.raises(SystemExit, match="unknown method 'nope'; available: .*map"):
        check_group_overrides(["method=map,nope"])
    check_group_overrides(["data=uci/boston", "method=map", "data.split=3", "+foo=bar"])
    assert "uci/boston" in group_choices("data")


def test_unknown_command_and_help(tmp_path: Path) -> None:
    out = _cli("frobnicate", cwd=tmp_path)
    assert out.returncode != 0 and "unknown command 'frobnicate'" in out.stderr
    assert "bdl-bench run" in _cli("--help", cwd=tmp_path).stdout


def test_version_names_the_package_and_its_main_dependencies(tmp_path: Path) -> None:
    import torch

    from bdl_bench import __version__

    out = _cli("--version", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()[:2]
    assert first.startswith(f"bdl-bench {__version__}") and "(git " in first  # run from this checkout
    assert f"torch {torch.__version__}" in second and "hydra-core " in second


def test_list_shows_every_option_with_its_description(tmp_path: Path) -> None:
    from bdl_bench.orchestration.catalogue import LISTED_GROUPS, describe, listing
    from bdl_bench.orchestration.hydra_app import CONF_DIR

    out = _cli("list", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for group in LISTED_GROUPS:
        for choice in group_choices(group):
            line = next((x for x in out.stdout.splitlines() if x.split()[:1] == [choice]), None)
            assert line is not None, f"{group}={choice} missing from `bdl-bench list`"
    # every method, model, dataset and experiment says what it is
    for group in ("method", "model", "data", "experiment"):
        for path in (CONF_DIR / group).rglob("*.yaml"):
            assert describe(path), f"{path} has no description comment"
    assert listing(CONF_DIR, ("method",)).startswith("method= (")
    bad = _cli("list", "nope", cwd=tmp_path)
    assert bad.returncode == 1 and "unknown group 'nope'" in bad.stderr
