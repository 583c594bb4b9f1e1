"""``bdl-bench data list|fetch|verify``: the download cache from the command line (docs/running.md). Names are
dataset names (``vision/mnist``) or cache keys (``mnist/train-images-idx3-ubyte.gz``)."""

from __future__ import annotations

import argparse
import logging
import sys

from bdl_bench.data import registry_files
from bdl_bench.data.download import (
    DownloadError,
    DownloadSettings,
    RemoteFile,
    cache_path,
    cache_root,
    checksum_problem,
    fetch,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bdl-bench data", description="Manage the dataset download cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=None, help="cache folder (default: $BDL_BENCH_DATA or ~/.cache/bdl-bench)")
    getter = argparse.ArgumentParser(add_help=False)
    getter.add_argument("--mirror", default=None, help="folder or base URL tried before the canonical URLs")
    getter.add_argument("--timeout", type=float, default=DownloadSettings.timeout, help="seconds (default %(default)s)")
    getter.add_argument("--retries", type=int, default=DownloadSettings.retries, help="per URL (default %(default)s)")
    getter.add_argument("--quiet", action="store_true", help="no progress bars")
    sub.add_parser("list", parents=[common], help="list datasets, their files and whether they are cached (no hashing)")
    fetch_parser = sub.add_parser("fetch", parents=[common, getter], help="download and verify")
    fetch_parser.add_argument("names", nargs="*", help="dataset names or cache keys")
    fetch_parser.add_argument("--all", action="store_true", help="every dataset (several GB)")
    verify_parser = sub.add_parser("verify", parents=[common, getter], help="re-hash cached files")
    verify_parser.add_argument("names", nargs="*", help="dataset names or cache keys (default: all)")
    verify_parser.add_argument("--no-refetch", action="store_true", help="report corrupt files, do not re-fetch")
    return parser


def resolve(names: list[str]) -> list[RemoteFile]:
    """The remote files behind dataset names and cache keys, without duplicates, in order (an unknown name exits,
    listing the known ones)."""
    keys: list[str] = []
    for name in names:
        if name in registry_files.DATASET_FILES:
            keys += registry_files.DATASET_FILES[name]
        elif name in registry_files.FILES:
            keys.append(name)
        else:
            known = ", ".join(sorted(registry_files.DATASET_FILES))
            raise SystemExit(f"bdl-bench data: unknown dataset or file {name!r}; datasets: {known}")
    return [registry_files.FILES[k] for k in dict.fromkeys(keys)]


def _all_names() -> list[str]:
    return sorted(registry_files.DATASET_FILES)


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def list_command(ns: argparse.Namespace) -> int:
    root = cache_root(ns.root)
    print(f"cache: {root}")
    for name in _all_names():
        print(f"{name}:")
        for remote in resolve([name]):  # size only: `verify` hashes
            path = cache_path(remote, root)
            if not path.is_file():
                status = "not cached"
            elif remote.size is not None and path.stat().st_size != remote.size:
                status = f"WRONG SIZE ({path.stat().st_size} bytes)"
            else:
                status = "cached"
            checksum = f"sha256 {remote.sha256[:12]}…" if remote.sha256 else f"md5 {remote.md5}"
            print(f"  {remote.key:<40} {_size(remote.size):>9}  {checksum:<38} {status}")
    return 0


def _fetch(remote: RemoteFile, ns: argparse.Namespace, note: str = "") -> bool:
    """Fetch ``remote`` and print the outcome; ``False`` when it failed."""
    settings = DownloadSettings(timeout=ns.timeout, retries=ns.retries, progress=not ns.quiet)
    try:
        path = fetch(remote, root=ns.root, mirror=ns.mirror, settings=settings)
    except DownloadError as err:
        print(f"FAILED   {remote.key}: {err}", file=sys.stderr)
        return False
    print(f"ok       {path}{note}")
    return True


def fetch_command(ns: argparse.Namespace) -> int:
    if not ns.names and not ns.all:
        raise SystemExit(f"bdl-bench data fetch: name datasets or give --all; datasets: {', '.join(_all_names())}")
    failed = [remote for remote in resolve(_all_names() if ns.all else ns.names) if not _fetch(remote, ns)]
    return 1 if failed else 0


def verify_command(ns: argparse.Namespace) -> int:
    bad = 0
    for remote in resolve(ns.names or _all_names()):
        path = cache_path(remote, ns.root)
        state = checksum_problem(path, remote) if path.is_file() else "missing"
        if state is None:
            print(f"ok       {path}")
        elif state == "missing":
            print(f"missing  {path}")
        elif ns.no_refetch:
            bad += 1
            print(f"CORRUPT  {path}: {state}")
        else:
            print(f"CORRUPT  {path}: {state}; fetching it again")
            bad += not _fetch(remote, ns, " (re-fetched)")
    return 1 if bad else 0


def main(args: list[str]) -> None:
    """Entry point of ``bdl-bench data``; exits with status 1 when a file could not be fetched or is corrupt."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    ns = _parser().parse_args(args)
    commands = {"list": list_command, "fetch": fetch_command, "verify": verify_command}
    status = commands[ns.command](ns)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
