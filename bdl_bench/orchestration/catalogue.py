"""``bdl-bench list`` and ``bdl-bench --version``: what can be chosen, and which code and packages run.

The listing reads ``conf/``: every option of a config group is a YAML file, and its first comment line
(after Hydra's ``# @package`` line) is the option's one-line description, so a new method or dataset is
listed as soon as its YAML exists.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

LISTED_GROUPS = ("method", "data", "model", "experiment", "variant", "tune", "trainer")
# The packages whose versions change results or behaviour; recorded in each run's run.json too.
MAIN_PACKAGES = ("torch", "numpy", "scipy", "pandas", "scikit-learn", "hydra-core", "omegaconf", "optuna")
DESCRIPTION_WIDTH = 100


def describe(path: Path) -> str:
    """The first comment line of a config file (not ``# @package``), cut to one short line."""
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("# @package"):
            continue
        if not text.startswith("#"):
            break  # the first key: no description above it
        text = text.lstrip("#").strip()
        return text if len(text) <= DESCRIPTION_WIDTH else text[: DESCRIPTION_WIDTH - 1].rstrip() + "…"
    return ""


def listing(conf_dir: Path, groups: tuple[str, ...] = LISTED_GROUPS) -> str:
    """Every option of ``groups`` as ``group=option  description`` lines, one block per group."""
    blocks = []
    for group in groups:
        root = conf_dir / group
        paths = sorted(root.rglob("*.yaml"), key=lambda p: p.relative_to(root).as_posix())
        names = [p.relative_to(root).with_suffix("").as_posix() for p in paths]
        width = max((len(n) for n in names), default=0)
        lines = [f"  {name:<{width}}  {describe(path)}".rstrip() for name, path in zip(names, paths)]
        blocks.append(f"{group}= ({len(names)})\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def package_versions() -> dict[str, str | None]:
    """Installed versions of :data:`MAIN_PACKAGES` (``None``: not installed), and Python's."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in MAIN_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_describe(repo: Path) -> str | None:
    """``git describe --always --dirty`` of the checkout the package runs from; ``None`` outside one."""
    if shutil.which("git") is None or not (repo / ".git").exists():
        return None
    command = ["git", "-C", str(repo), "describe", "--always", "--dirty", "--tags"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def version_text() -> str:
    """What ``bdl-bench --version`` prints: the package version, the git checkout, and the main packages."""
    from bdl_bench import __version__

    repo = Path(__file__).resolve().parents[2]
    described = git_describe(repo)
    head = f"bdl-bench {__version__}" + (f" (git {described})" if described else "")
    versions = package_versions()
    rest = ", ".join(f"{name} {version}" for name, version in versions.items() if version is not None)
    return f"{head}\n{rest}"
