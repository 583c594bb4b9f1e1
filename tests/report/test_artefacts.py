"""The status page: rendered from the artefact catalogue, claims backed by committed files, commands that exist."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

from bdl_bench.orchestration.cli import STATUS_PAGE
from bdl_bench.orchestration.hydra_app import CONF_DIR, check_group_overrides, group_choices
from bdl_bench.report.artefacts import listing, load_catalogue, render_page

ROOT = CONF_DIR.parent
ARTEFACTS = load_catalogue()


def test_the_committed_status_page_is_the_catalogue_rendered() -> None:
    assert STATUS_PAGE.read_text() == render_page(ARTEFACTS, STATUS_PAGE.parent) + "\n", (
        "results/README.md is stale: run `bdl-bench reproduce --status-page`"
    )


@pytest.mark.parametrize("artefact", [a for a in ARTEFACTS if a.status in ("agrees", "differs", "partial")], ids=str)
def test_a_claimed_result_is_a_committed_reproduction(artefact) -> None:
    assert artefact.results, f"{artefact.id} claims {artefact.status!r} without naming its results folder"
    table = ROOT / "results" / artefact.results / "reproduce.md"
    assert table.is_file(), f"{artefact.id}: {table} is not committed"
    assert artefact.note, f"{artefact.id}: say what agrees or differs"


@pytest.mark.parametrize("artefact", [a for a in ARTEFACTS if a.command], ids=lambda a: a.id)
def test_every_command_names_something_that_exists(artefact) -> None:
    words = shlex.split(artefact.command)
    if words[:2] == ["bdl-bench", "reproduce"]:
        assert words[2] in group_choices("experiment")
    elif words[:2] == ["bdl-bench", "run"]:
        check_group_overrides([w for w in words[2:] if not w.startswith("-")])
    elif words[:2] == ["bdl-bench", "plot"]:
        assert words[3] in ("convergence", "covariance", "ood")
    elif words[:2] == ["python", "-m"]:
        spec = importlib.util.find_spec(words[2])
        assert spec is not None and 'if __name__ == "__main__"' in Path(spec.origin).read_text()
    else:
        assert words[0] == "python" and (ROOT / words[1]).is_file(), artefact.command
    if artefact.status == "cannot run here":
        assert artefact.note, f"{artefact.id}: say why it cannot run here"


def test_the_catalogue_refuses_an_unknown_status(tmp_path: Path) -> None:
    path = tmp_path / "artefacts.yaml"
    path.write_text("- {id: x, paper: slang, label: T, what: w, status: done}\n")
    with pytest.raises(ValueError, match="unknown status 'done'"):
        load_catalogue(path)


def test_listing_names_every_artefact_once() -> None:
    lines = listing(ARTEFACTS).splitlines()
    assert [line.split()[0] for line in lines] == [a.id for a in ARTEFACTS]
