"""SHA-256 verification of the shipped data files against ``data/SHA256SUMS``.

The manifest is the repository's own ``data/SHA256SUMS`` (``sha256sum`` format, paths relative to
``data/``), even when a loader reads from another ``root``: a copy of the data elsewhere must hold the
same bytes. Each file is hashed at most once per process (the cache key includes size and mtime, so a
file rewritten in place is hashed again).

Command line::

    python -m bdl_bench.data.checksums            # check every file listed in data/SHA256SUMS
    python -m bdl_bench.data.checksums --write    # rewrite data/SHA256SUMS from the files in data/
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from functools import cache
from pathlib import Path

from bdl_bench.data.base import DataFileError, default_data_root

MANIFEST_NAME = "SHA256SUMS"
FIX_HINT = (
    "re-checkout the repository's data/ folder (git checkout -- data/) or copy it from the source "
    "named in data/README.md"
)


def manifest_path() -> Path:
    return default_data_root() / MANIFEST_NAME


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def parse_manifest(text: str) -> dict[str, str]:
    """``sha256sum`` lines ``<64 hex digits><space><space or *><path>`` as ``{path relative to data/ (no leading
    ./): lower-case digest}``; blank lines and ``#`` comments are skipped."""
    entries: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        digest, sep, rel = line.partition(" ")
        if not sep or len(digest) != 64:
            raise ValueError(f"line {lineno} of {MANIFEST_NAME} is not '<sha256>  <path>': {line!r}")
        rel = rel[1:] if rel[:1] in (" ", "*") else rel
        entries[rel.removeprefix("./")] = digest.lower()
    return entries


@cache
def load_manifest() -> dict[str, str]:
    """The parsed repository manifest (read once per process)."""
    try:
        return parse_manifest(manifest_path().read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataFileError(f"checksum manifest {manifest_path()} is missing; {FIX_HINT}") from None


@cache
def _digest_cached(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(Path(path))


def verify_file(path: Path, rel: str) -> Path:
    """``path`` (anywhere on disk) after checking that it exists and matches the manifest entry ``rel`` (its path
    relative to ``data/``, e.g. ``uci/yacht/data.txt``); otherwise a :class:`DataFileError`."""
    if not path.is_file():
        raise DataFileError(f"data file {path} is missing; {FIX_HINT}")
    expected = load_manifest().get(rel)
    if expected is None:
        raise DataFileError(
            f"data file {path} ({rel!r}) is not listed in {manifest_path()}; add it with "
            "`python -m bdl_bench.data.checksums --write` after checking its source"
        )
    stat = path.stat()
    actual = _digest_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if actual != expected:
        raise DataFileError(
            f"data file {path} is corrupted or modified: SHA-256 {actual} differs from {expected} recorded "
            f"in {manifest_path()}; {FIX_HINT}"
        )
    return path


def data_file(rel: str, root: str | Path | None = None) -> Path:
    """``rel`` (POSIX, e.g. ``libsvm/a1a.mat``) under ``root`` (default: the shipped ``data/``), verified."""
    base = default_data_root() if root is None else Path(root).expanduser()
    return verify_file(base / rel, rel)


def compute_manifest(root: Path) -> str:
    """``sha256sum``-format text for every file under ``root`` except the manifest, sorted by path."""
    lines = [
        f"{sha256_file(p)}  {p.relative_to(root).as_posix()}"
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME and "__pycache__" not in p.parts
    ]
    return "\n".join(lines) + "\n"


def check_all(root: Path) -> list[str]:
    """Verify every manifest entry under ``root``; return one message per bad file (empty if all good)."""
    problems = []
    for rel in sorted(load_manifest()):
        try:
            verify_file(root / rel, rel)
        except DataFileError as err:
            problems.append(str(err))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check or rewrite data/SHA256SUMS.")
    parser.add_argument("--write", action="store_true", help="rewrite the manifest from the files on disk")
    args = parser.parse_args(argv)
    root = default_data_root()
    if args.write:
        manifest_path().write_text(compute_manifest(root), encoding="utf-8")
        print(f"wrote {manifest_path()}")
        return 0
    problems = check_all(root)
    for msg in problems:
        print(msg, file=sys.stderr)
    print(f"{len(load_manifest()) - len(problems)} files OK, {len(problems)} bad")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
