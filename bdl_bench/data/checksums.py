"""SHA-256 verification of the shipped data files against ``data/SHA256SUMS`` (``sha256sum`` format, paths
relative to ``data/``), also when a loader reads a copy elsewhere (``root``): it must hold the same bytes.
``python -m bdl_bench.data.checksums [--write]`` checks every listed file (or rewrites the manifest; see
``data/README.md``)."""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TypeVar

import numpy as np

from bdl_bench.data.base import default_data_root
from bdl_bench.errors import DataFileError

MANIFEST_NAME = "SHA256SUMS"
T = TypeVar("T")
FIX_HINT = (
    "re-checkout the repository's data/ folder (git checkout -- data/) or copy it from the source "
    "named in data/README.md"
)


def manifest_path() -> Path:
    return default_data_root() / MANIFEST_NAME


def hexdigests(path: Path, *algorithms: str) -> list[str]:
    """The hex digests of the file at ``path`` by each of the :mod:`hashlib` ``algorithms``, in one read."""
    hashes = [hashlib.new(name, usedforsecurity=False) for name in algorithms]
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            for digest in hashes:
                digest.update(block)
    return [digest.hexdigest() for digest in hashes]


def _sha256(path: Path) -> str:
    return hexdigests(path, "sha256")[0]


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
def _once(read: Callable[[Path], T], path: str, size: int, mtime_ns: int) -> T:
    """``read(path)``, once per process while the file keeps its size and modification time; the arrays it
    returns (alone or in a tuple) are made read-only, since every caller gets the same ones."""
    value = read(Path(path))
    for array in value if isinstance(value, tuple) else (value,):
        if isinstance(array, np.ndarray):
            array.flags.writeable = False
    return value


def _stat_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


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
    actual = _once(_sha256, *_stat_key(path))
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


def read_data_file(rel: str, read: Callable[[Path], T], root: str | Path | None = None) -> T:
    """``read`` of the verified file :func:`data_file` ``(rel, root)``, parsed once per process while it keeps
    its size and modification time (arrays read-only)."""
    return _once(read, *_stat_key(data_file(rel, root)))


def compute_manifest(root: Path) -> str:
    """``sha256sum``-format text for every file under ``root`` except the manifest, sorted by path."""
    lines = [
        f"{_sha256(p)}  {p.relative_to(root).as_posix()}"
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
