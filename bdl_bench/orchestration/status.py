"""``bdl-bench status <folder>``: what the runs below a sweep or results folder are doing now.

Each run folder (outside hidden folders such as ``.search/``) is finished, failed, running, stale, interrupted or
not started, from its lock, its ``run.json`` and its files (``docs/faults.md``). Reads files only.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from bdl_bench.methods.laplace.search import PROGRESS_FILE as SEARCH_PROGRESS_FILE
from bdl_bench.orchestration.locking import lock_state, utc
from bdl_bench.orchestration.prediction_store import stored_samples
from bdl_bench.results import CONFIG_FILE, HISTORY_FILE, METRICS_FILE, RUN_RECORD_FILE, read_failure

CLASSES = ("finished", "failed", "running", "stale", "interrupted", "not started")


@dataclass
class FolderStatus:
    """The runs below one folder, by class (``CLASSES``), each with its line of detail."""

    root: Path
    runs: dict[str, list[tuple[Path, str]]] = field(default_factory=lambda: {c: [] for c in CLASSES})

    def render(self) -> str:
        counts = ", ".join(f"{len(self.runs[c])} {c}" for c in CLASSES if self.runs[c] or c in CLASSES[:4])
        lines = [f"{self.root}: {sum(len(v) for v in self.runs.values())} runs: {counts}"]
        for cls in ("failed", "running", "stale", "interrupted", "not started"):
            for path, detail in self.runs[cls]:
                name = path.relative_to(self.root) if path != self.root and path.is_relative_to(self.root) else path
                lines.append(f"  {cls.upper()} {name}" + (f": {detail}" if detail else ""))
        return "\n".join(lines)


def run_folders(root: Path, files: tuple[str, ...] = (CONFIG_FILE, RUN_RECORD_FILE)) -> list[Path]:
    """The folders below ``root`` (or ``root`` itself) holding one of ``files``, outside hidden folders."""
    root = Path(root)
    found = {p.parent for name in files for p in root.rglob(name)}
    return sorted(d for d in found if not any(part.startswith(".") for part in d.relative_to(root).parts))


def _record(run_dir: Path) -> dict:
    try:
        record = json.loads((run_dir / RUN_RECORD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _lines(path: Path) -> int | None:
    try:
        with path.open() as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def run_progress(run_dir: Path) -> str:
    """How far an unfinished run got: epochs written, Laplace search points scored, final samples stored."""
    rows, points = _lines(run_dir / HISTORY_FILE), _lines(run_dir / SEARCH_PROGRESS_FILE)
    parts = [] if rows is None else [_count(max(rows - 1, 0), "epoch") + " written"]
    if points:
        parts.append(_count(points - 1, "search point") + " scored")  # after the header line
    parts += [f"{done} of {n} final {stage} samples stored" for stage, (done, n) in stored_samples(run_dir).items()]
    return "".join(f", {part}" for part in parts)


def _reason(run_dir: Path, record: dict) -> str:
    try:
        failure = read_failure(run_dir) or {}
    except (OSError, ValueError):
        failure = {}
    message = " ".join(str(failure.get("message") or record.get("error") or "").split())
    return f"{failure.get('error_type', 'error')}: {message}"[:300]


def classify(run_dir: Path) -> tuple[str, str]:
    """``(class, detail)`` of one run folder."""
    record = _record(run_dir)
    state, holder = lock_state(run_dir)
    if state == "held" and holder is not None:
        return "running", holder.describe() + run_progress(run_dir)
    if state == "stale" and holder is not None:
        return "stale", f"holder gone ({holder.describe()}){run_progress(run_dir)}; the same command resumes it"
    status = record.get("status")
    if status == "failed":
        return "failed", _reason(run_dir, record)
    if status == "running":
        where = f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, since {utc(record.get('started'))}"
        return "stale", f"run.json says running ({where}) but no process holds it{run_progress(run_dir)}"
    if (run_dir / METRICS_FILE).exists():
        return "finished", ""
    if status == "interrupted":
        return "interrupted", f"at {utc(record.get('ended'))}{run_progress(run_dir)}; the same command resumes it"
    return "not started", ""


def folder_status(root: Path) -> FolderStatus:
    result = FolderStatus(Path(root))
    for run_dir in run_folders(root):  # a stacked job's own folder (no run record) is left out: its splits count
        cls, detail = classify(run_dir)
        result.runs[cls].append((run_dir, detail))
    return result


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="bdl-bench status",
        description="How many runs below a sweep or results folder are finished, failed, running or stale.",
    )
    parser.add_argument("folder", type=Path)
    ns = parser.parse_args(args)
    if not ns.folder.is_dir():
        raise SystemExit(f"bdl-bench status: {ns.folder} is not a folder")
    status = folder_status(ns.folder)
    if not any(status.runs.values()):
        raise SystemExit(f"bdl-bench status: no run folder (config.yaml or run.json) below {ns.folder}")
    print(status.render())
