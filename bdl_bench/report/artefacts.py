"""The status page of the papers' artefacts: every table and figure with numbers, and where it stands.

One source, ``artefacts.yaml`` beside this module: per artefact its paper, label, what it measures, the
command that regenerates it, its cost, and its status, one of :data:`STATUSES`. ``results/README.md`` is
rendered from it (:func:`render_page`; a test keeps the committed page equal to the rendering), and
``bdl-bench reproduce --list`` prints it (:func:`listing`). A status that claims a result (``agrees``,
``differs``) must name the committed ``results/<folder>/reproduce.md`` that shows it (also tested)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

CATALOGUE = Path(__file__).with_name("artefacts.yaml")
STATUSES = ("agrees", "differs", "partial", "not yet run", "cannot run here")
"""``agrees``: at the paper's protocol, within the stated criterion; ``differs``: at the paper's protocol, outside
it (how much and why in ``note``); ``partial``: part of the artefact regenerated (what is missing in ``note``);
``not yet run``: runnable here, no committed result; ``cannot run here``: data or model out of reach (``note``)."""
PAPERS = {
    "slang": "SLANG (Mishkin et al., NeurIPS 2018)",
    "ktied": "k-tied Normal (Swiatkowski et al., ICML 2020)",
    "def": "DEF Laplace (Lee et al., ICML 2020)",
    "elrg": "ELRG-VI (Tomczak et al., NeurIPS 2020)",
}


@dataclass(frozen=True)
class Artefact:
    id: str
    paper: str
    label: str
    what: str
    status: str
    command: str | None = None
    results: str | None = None  # folder under results/ holding the committed reproduce.md
    cost: str | None = None
    note: str | None = None


def load_catalogue(path: Path = CATALOGUE) -> list[Artefact]:
    """The artefacts in ``path``, checked: known paper and status, unique ids."""
    entries = yaml.safe_load(path.read_text())
    artefacts = [Artefact(**entry) for entry in entries]
    for a in artefacts:
        if a.paper not in PAPERS:
            raise ValueError(f"{path}: {a.id}: unknown paper {a.paper!r}; one of {', '.join(PAPERS)}")
        if a.status not in STATUSES:
            raise ValueError(f"{path}: {a.id}: unknown status {a.status!r}; one of {', '.join(STATUSES)}")
    duplicates = [k for k, n in Counter(a.id for a in artefacts).items() if n > 1]
    if duplicates:
        raise ValueError(f"{path}: duplicate ids {duplicates}")
    return artefacts


def _cell(text: str | None) -> str:
    return " ".join((text or "–").split()).replace("|", "\\|")


def render_page(artefacts: list[Artefact], results_dir: Path | None = None) -> str:
    """``results/README.md``: a count per status, one table per paper, and the committed reproductions under
    ``results_dir`` that are no paper artefact (the project's own studies)."""
    counts = Counter(a.status for a in artefacts)
    lines = [
        "# Status of every table and figure",
        "",
        "<!-- Generated from bdl_bench/report/artefacts.yaml by `bdl-bench reproduce --status-page`; edit that file. -->",
        "",
        "One row per table and per figure with numbers in the four papers. *agrees*: regenerated at the paper's",
        "protocol and within the stated criterion; *differs*: at the paper's protocol, outside it (how much and why);",
        "*partial*: part of it regenerated (what is missing); *not yet run*: runnable here, no committed result;",
        "*cannot run here*: its data or model cannot be reached from these machines (the command that would run it",
        "where they can). A row claims no more than its committed `reproduce.md` shows. Run folders are git-ignored;",
        "each committed `results/<name>/reproduce.md` and `.csv` names the command, code version, date and cost.",
        "",
        "| status | artefacts |",
        "|---|---|",
        *(f"| {status} | {counts.get(status, 0)} |" for status in STATUSES),
        "",
    ]
    for paper, title in PAPERS.items():
        rows = [a for a in artefacts if a.paper == paper]
        if not rows:
            continue
        lines += [
            f"## {title}",
            "",
            "| artefact | what | status | result | command | cost | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for a in rows:
            result = f"[{a.results}/reproduce.md]({a.results}/reproduce.md)" if a.results else "–"
            command = f"`{a.command}`" if a.command else "–"
            lines.append(
                f"| {_cell(a.label)} | {_cell(a.what)} | **{a.status}** | {result} | {command} | {_cell(a.cost)} | {_cell(a.note)} |"
            )
        lines.append("")
    named = {a.results for a in artefacts if a.results}
    extra = sorted(p.parent.name for p in results_dir.glob("*/reproduce.md")) if results_dir else []
    extra = [name for name in extra if name not in named]
    if extra:
        lines += ["## Beyond the papers", ""]
        lines += [f"- [{name}]({name}/reproduce.md)" for name in extra]
        lines.append("")
    return "\n".join(lines)


def listing(artefacts: list[Artefact]) -> str:
    """``bdl-bench reproduce --list``: one line per artefact, its status and the command."""
    width = max(len(a.id) for a in artefacts)
    status_width = max(len(s) for s in STATUSES)
    return "\n".join(
        f"{a.id:<{width}}  {a.status:<{status_width}}  {a.command or '(' + (a.note or '').split(';')[0] + ')'}"
        for a in artefacts
    )
