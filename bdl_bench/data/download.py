"""Verified downloads into the data cache (docs/running.md): :func:`fetch` returns the cached copy of a
:class:`RemoteFile` after checking it, or gets it from ``mirror`` (a folder or base URL, tried as
``<mirror>/<key>`` then ``<mirror>/<file name>``) and then, unless ``$BDL_BENCH_OFFLINE`` is set, from the
canonical URLs. A download is resumed with an HTTP ``Range`` request after a broken connection, retried with
back-off, and renamed to its final name only once its size and checksums match; a file that does not match is
deleted, never used. Where only an MD5 is published, the SHA-256 of the accepted file is written beside it
(``<name>.sha256``) and checked on every later use as well. Each file is fetched under an exclusive ``flock``,
so concurrent runs share the cache safely."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import requests
from tqdm.auto import tqdm

from bdl_bench.data.checksums import hexdigests
from bdl_bench.errors import DataFileError

try:  # POSIX only; elsewhere concurrent fetches of one file are not serialised
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

CACHE_ENV = "BDL_BENCH_DATA"
"""Environment variable naming the cache folder."""
OFFLINE_ENV = "BDL_BENCH_OFFLINE"
"""When set to 1/true/yes, :func:`fetch` never contacts the canonical URLs (mirror and cache only)."""
DEFAULT_CACHE = "~/.cache/bdl-bench"
MIRROR_HINT = (
    "set data.mirror=<URL or folder holding the file> (command line: bdl-bench data fetch <dataset> --mirror ...), "
    f"or copy the file there yourself; the cache folder is ${CACHE_ENV} (default {DEFAULT_CACHE})"
)


class DownloadError(DataFileError):
    """No source gave a file matching its recorded checksum (the message names what was tried)."""


@dataclass(frozen=True)
class RemoteFile:
    """One downloadable file and what it must hash to (a SHA-256, or where none is trusted an MD5)."""

    key: str  # POSIX path inside the cache folder, e.g. mnist/train-images-idx3-ubyte.gz
    urls: tuple[str, ...]  # canonical URLs, tried in order
    sha256: str | None = None
    md5: str | None = None  # as published by the source or well-known loaders
    size: int | None = None  # bytes, None when not recorded

    def __post_init__(self) -> None:
        if self.sha256 is None and self.md5 is None:
            raise ValueError(f"remote file {self.key!r} needs a sha256 or an md5")
        path = PurePosixPath(self.key)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise ValueError(f"remote file key {self.key!r} must be a relative path without '..'")
        for name, value, length in (("sha256", self.sha256, 64), ("md5", self.md5, 32)):
            if value is not None and (len(value) != length or value.strip("0123456789abcdef")):
                raise ValueError(f"remote file {self.key!r}: {name} must be {length} lower-case hex digits")

    @property
    def filename(self) -> str:
        return PurePosixPath(self.key).name


@dataclass(frozen=True)
class DownloadSettings:
    """How hard :func:`fetch` tries: ``retries`` further attempts per URL after the first (on connection errors,
    time-outs, 5xx answers, truncated transfers), each resuming where the last one stopped."""

    timeout: float = 30.0  # seconds to wait for a connection and between received bytes
    retries: int = 3
    backoff: float = 1.0  # seconds before the first retry, doubled before each later one
    chunk_size: int = 1 << 16  # bytes per read
    progress: bool = True  # show a tqdm bar


def cache_root(root: str | Path | None = None) -> Path:
    """The cache folder: ``root`` if given, else ``$BDL_BENCH_DATA``, else ``~/.cache/bdl-bench``."""
    if root is None:
        root = os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(root).expanduser()


def cache_path(remote: RemoteFile, root: str | Path | None = None) -> Path:
    return cache_root(root) / remote.key


def offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# --- checksums ---------------------------------------------------------------------------------------------


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def checksum_problem(path: Path, remote: RemoteFile, *, use_sidecar: bool = True) -> str | None:
    """Why ``path`` is not a good copy of ``remote`` (size, SHA-256, MD5, and with ``use_sidecar`` the
    ``<name>.sha256`` written when an MD5-only file was first accepted), or ``None`` if it is."""
    size = path.stat().st_size
    if remote.size is not None and size != remote.size:
        return f"size {size} bytes differs from the recorded {remote.size}"
    sha256, md5 = hexdigests(path, "sha256", "md5")  # never cached: a file rewritten in place may keep its mtime
    if remote.sha256 is not None and sha256 != remote.sha256:
        return f"SHA-256 {sha256} differs from the recorded {remote.sha256}"
    if remote.md5 is not None and md5 != remote.md5:
        return f"MD5 {md5} differs from the recorded {remote.md5}"
    sidecar = _sidecar(path)
    if use_sidecar and remote.sha256 is None and sidecar.is_file():
        expected = sidecar.read_text(encoding="utf-8").split()[0] if sidecar.stat().st_size else ""
        if sha256 != expected:
            return f"SHA-256 {sha256} differs from {expected!r} recorded in {sidecar} when it was first fetched"
    return None


# --- transfers ---------------------------------------------------------------------------------------------


class _Retryable(Exception):
    """A transfer failure worth another attempt (5xx, a truncated body)."""


def download_url(url: str, part: Path, *, settings: DownloadSettings, expected_size: int | None = None) -> None:
    """Stream ``url`` into ``part``, resuming from ``part``'s current length.

    A server that ignores ``Range`` (status 200) restarts the file; 416 on a non-empty part means
    the part is already whole (the checksum decides). Connection errors, time-outs, 5xx answers and
    bodies shorter than their ``Content-Length`` are retried ``settings.retries`` times with
    back-off, each time resuming. A 4xx answer or spent retries raise :class:`DownloadError`;
    ``part`` keeps what arrived.
    """
    part.parent.mkdir(parents=True, exist_ok=True)
    attempt = 0
    while True:
        offset = part.stat().st_size if part.exists() else 0
        headers = {"Accept-Encoding": "identity"}  # the bytes as stored: checksums and ranges refer to them
        if offset:
            headers["Range"] = f"bytes={offset}-"
        try:
            with requests.get(url, headers=headers, stream=True, timeout=settings.timeout) as response:
                status = response.status_code
                if status == 416 and offset:
                    return
                if status >= 500 or status in (408, 429):
                    raise _Retryable(f"HTTP {status} {response.reason}")
                if status >= 400:
                    raise DownloadError(f"{url}: HTTP {status} {response.reason}")
                if status == 206:  # Content-Range: bytes <start>-<end>/<total>
                    start = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
                    if not offset or start is None or int(start.group(1)) != offset:
                        part.unlink(missing_ok=True)  # a range we did not ask for: start again
                        raise _Retryable(f"unexpected Content-Range {response.headers.get('Content-Range')!r}")
                    mode = "ab"
                else:  # full body: the server ignored the Range header, or there was nothing to resume
                    mode, offset = "wb", 0
                length = response.headers.get("Content-Length")
                total = offset + int(length) if length is not None else expected_size
                with (
                    open(part, mode) as f,
                    tqdm(
                        total=total,
                        initial=offset,
                        unit="B",
                        unit_scale=True,
                        desc=part.name.removesuffix(".part"),
                        disable=not settings.progress,
                        leave=False,
                    ) as bar,
                ):
                    for chunk in response.iter_content(settings.chunk_size):
                        f.write(chunk)
                        bar.update(len(chunk))
                got = part.stat().st_size
                if total is not None and got < total:
                    raise _Retryable(f"connection closed after {got} of {total} bytes")
                return
        except (
            requests.ConnectionError,
            requests.Timeout,
            requests.exceptions.ChunkedEncodingError,
            _Retryable,
        ) as err:
            attempt += 1
            if attempt > settings.retries:
                raise DownloadError(f"{url}: gave up after {attempt} attempts: {err}") from err
            delay = settings.backoff * 2 ** (attempt - 1)
            log.warning(
                "%s: %s; retrying in %.1f s (attempt %d of %d)", url, err, delay, attempt + 1, settings.retries + 1
            )
            time.sleep(delay)


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``.<name>.lock`` beside ``target`` (no-op without fcntl)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        handle = open(target.with_name(f".{target.name}.lock"), "a")
    except OSError:  # a read-only cache: nothing will be written there either
        handle = None
    if fcntl is None or handle is None:  # pragma: no cover
        yield
        return
    with handle:  # closing the file releases the lock
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield


def sources(remote: RemoteFile, mirror: str | Path | None = None) -> list[str | Path]:
    """Where :func:`fetch` looks, in order: mirror candidates, then canonical URLs (unless offline)."""
    found: list[str | Path] = []
    if mirror is not None and str(mirror) != "":
        text = str(mirror)
        if urlsplit(text).scheme in ("http", "https"):
            base = text.rstrip("/")
            found += [f"{base}/{remote.key}", f"{base}/{remote.filename}"]
        else:
            folder = Path(text.removeprefix("file://")).expanduser()
            found += [p for p in (folder / remote.key, folder / remote.filename) if p.is_file()]
    if not offline():
        found += list(remote.urls)
    return list(dict.fromkeys(found))


def missing_message(remote: RemoteFile, target: Path, mirror: str | Path | None, errors: list[str]) -> str:
    """The one message for 'no source worked': the URLs, the cache path and the mirror option."""
    given = mirror not in (None, "")
    nothing = f"the mirror {mirror} holds no copy" if given else "no mirror is given"
    tried = "\n".join(f"  - {e}" for e in errors) or f"  (nothing: ${OFFLINE_ENV} is set and {nothing})"
    checksum = f"SHA-256 {remote.sha256}" if remote.sha256 else f"MD5 {remote.md5}"
    mirror_note = f"The mirror {mirror} does not hold it. " if given else ""
    return (
        f"could not get {remote.key}; tried:\n{tried}\n"
        f"It is not in the cache either: {target} (expected {checksum}). Canonical URL(s): "
        f"{', '.join(remote.urls)}. {mirror_note}To work offline, {MIRROR_HINT}."
    )


def fetch(
    remote: RemoteFile,
    *,
    root: str | Path | None = None,
    mirror: str | Path | None = None,
    settings: DownloadSettings | None = None,
) -> Path:
    """The verified cached copy of ``remote`` in ``root`` (default :func:`cache_root`), fetched first when missing
    or corrupt, from ``mirror`` (see module docstring) or the canonical URLs. If no source gives a matching file,
    a :class:`DownloadError` names the URLs tried, the cache path and the ``data.mirror`` option."""
    settings = settings or DownloadSettings()
    target = cache_path(remote, root)
    if target.is_file() and checksum_problem(target, remote) is None:
        return target  # no lock needed to read a good copy (the cache may be read-only)
    if not target.is_file() and not sources(remote, mirror):  # offline, no mirror: leave the cache untouched
        raise DownloadError(missing_message(remote, target, mirror, []))
    with _locked(target):  # another process may be fetching it: wait, then look again
        if target.is_file():
            problem = checksum_problem(target, remote)
            if problem is None:
                return target
            log.warning("cached %s is corrupt (%s); fetching it again", target, problem)
            target.unlink()
            _sidecar(target).unlink(missing_ok=True)
        part = target.with_name(target.name + ".part")
        errors: list[str] = []
        for source in sources(remote, mirror):
            problem = _get_one(source, part, remote, settings)
            if problem is None:
                if remote.sha256 is None:  # first use of an MD5-only file: remember its SHA-256
                    _sidecar(part).write_text(f"{hexdigests(part, 'sha256')[0]}  {remote.filename}\n", encoding="utf-8")
                    os.replace(_sidecar(part), _sidecar(target))
                os.replace(part, target)
                log.info("fetched %s from %s", target, source)
                return target
            errors.append(f"{source}: {problem}")
        raise DownloadError(missing_message(remote, target, mirror, errors))


def _get_one(source: str | Path, part: Path, remote: RemoteFile, settings: DownloadSettings) -> str | None:
    """Bring ``source`` into ``part`` and check it; ``None`` on success, else why it failed.

    A resumed download that fails its checksum is retried once from scratch (the earlier bytes may
    have come from another version of the file); a bad file is always deleted.
    """
    for fresh in (False, True):
        resumed = part.exists() and part.stat().st_size > 0
        try:
            if isinstance(source, Path):
                shutil.copyfile(source, part)
            else:
                download_url(source, part, settings=settings, expected_size=remote.size)
        except (DownloadError, OSError, requests.RequestException) as err:
            if isinstance(source, Path):
                part.unlink(missing_ok=True)
            return str(err).removeprefix(f"{source}: ")
        problem = checksum_problem(part, remote, use_sidecar=False)
        if problem is None:
            return None
        part.unlink()
        if not resumed or fresh or isinstance(source, Path):
            return f"rejected: {problem}"
    return None  # pragma: no cover - the loop always returns
