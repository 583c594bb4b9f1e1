"""README and docs/: every relative link resolves, README stays a short front door, and CI runs README's commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "results" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _code_free(text: str) -> str:
    """``text`` without fenced code blocks and inline code (their brackets are not links)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`]*`", "", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    links = LINK.findall(_code_free(page.read_text()))
    broken = []
    for target in links:
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_readme_is_a_short_front_door_linking_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"


def test_ci_installs_and_tests_as_readme_says() -> None:
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[dev]"' in readme and 'pip install --quiet -e ".[dev]"' in ci
    test_command = re.search(r"## Tests\s+```bash\n(.+)\n```", readme).group(1).strip()
    assert test_command in ci
    assert "python3 -m venv" in ci  # a fresh environment each run, not the machine's packages
