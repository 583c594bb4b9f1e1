"""One writer per folder: a lock file that names its holder and is broken once the holder is gone.

``.lock`` is made with ``O_CREAT | O_EXCL`` (atomic on local file systems and NFS v3 and later, whatever their
flock support) and touched every :data:`HEARTBEAT_S` seconds; when it is stale, and how: ``docs/faults.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bdl_bench.errors import UserError

LOCK_FILE = ".lock"
HEARTBEAT_S = 30.0  # how often a holder touches its lock file
STALE_AFTER_S = 600.0  # another host's lock without a heartbeat this long is stale: a busy file server is not death
BREAK_STALE_AFTER_S = 60.0  # a .lock.break older than this was left by a process killed while breaking a lock

_HELD: dict[Path, tuple[str, int]] = {}  # lock file -> (token, nesting depth), for the locks this process holds
_HELD_BY = os.getpid()  # whose _HELD it is (a forked child holds none of its parent's locks)
_heartbeat: threading.Thread | None = None


def _held() -> dict[Path, tuple[str, int]]:
    global _HELD_BY
    if _HELD_BY != os.getpid():
        _HELD.clear()
        _HELD_BY = os.getpid()
    return _HELD


class FolderInUse(UserError, RuntimeError):
    """A folder another live process holds; the message names the holder."""

    def __init__(self, message: str, holder: Holder | None = None) -> None:  # pickles with the message alone
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: read from its file (``heartbeat`` is the file's modification time)."""

    host: str
    pid: int
    pid_start: str | None
    since: float
    heartbeat: float
    command: str
    token: str

    def stale(self) -> bool:
        """Whether the holder is gone (module docstring)."""
        if self.host != socket.gethostname():
            return time.time() - self.heartbeat > STALE_AFTER_S
        if self.pid == os.getpid():
            return all(token != self.token for token, _ in _held().values())  # an earlier process with our pid
        start = _pid_start(self.pid)
        if start is None:
            return not _pid_alive(self.pid)
        return self.pid_start is not None and start != self.pid_start

    def describe(self) -> str:
        """``host h, pid p, since <UTC time>, last heartbeat <n> s ago``."""
        beat = max(0, time.time() - self.heartbeat)
        return f"host {self.host}, pid {self.pid}, since {utc(self.since)}, last heartbeat {beat:.0f} s ago"


def utc(t: float | None) -> str:
    """``t`` (seconds since the epoch) as ``YYYY-MM-DD HH:MM:SS UTC``; ``?`` when unknown."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "?"


def _pid_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), or ``None`` where it
    cannot be read (no such process, or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name's closing parenthesis


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def read_holder(folder: Path) -> Holder | None:
    """The holder of ``folder``'s lock, or ``None`` when it has none (or the file is being replaced)."""
    path = Path(folder) / LOCK_FILE
    try:
        record = json.loads(path.read_text())
        heartbeat = path.stat().st_mtime
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    return Holder(
        host=str(record.get("host", "?")),
        pid=int(record.get("pid", -1)),
        pid_start=record.get("pid_start"),
        since=float(record.get("since", heartbeat)),
        heartbeat=heartbeat,
        command=str(record.get("command", "")),
        token=str(record.get("token", "")),
    )


def _create(path: Path, token: str) -> bool:
    """Create the lock file naming this process; ``False`` when it exists."""
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _pid_start(os.getpid()),
        "since": time.time(),
        "command": shlex.join(sys.argv),
        "token": token,
    }
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with open(fd, "w") as file:
            file.write(json.dumps(record))
    except OSError:
        path.unlink(missing_ok=True)
        raise
    return True


def _break_stale(folder: Path, holder: Holder | None) -> None:
    """Remove ``folder``'s lock if it still names the stale ``holder`` (under ``.lock.break``); with
    ``holder=None``, if it is still unreadable and older than :data:`BREAK_STALE_AFTER_S` (a process killed
    between making the file and writing its name)."""
    guard = Path(folder) / f"{LOCK_FILE}.break"
    if _age(guard) > BREAK_STALE_AFTER_S:
        guard.unlink(missing_ok=True)
    try:
        fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return  # another process is breaking it; the caller tries again
    os.close(fd)
    try:
        now = read_holder(folder)
        if holder is None and now is None and _age(Path(folder) / LOCK_FILE) > BREAK_STALE_AFTER_S:
            (Path(folder) / LOCK_FILE).unlink(missing_ok=True)
            print(f"{folder}: removed an unreadable lock left by a killed process", file=sys.stderr)
        elif holder is not None and now is not None and now.token == holder.token:
            (Path(folder) / LOCK_FILE).unlink(missing_ok=True)
            print(f"{folder}: took over the lock of a process that is gone ({holder.describe()})", file=sys.stderr)
    finally:
        guard.unlink(missing_ok=True)


def _age(path: Path) -> float:
    """Seconds since ``path`` was last modified (0 when it is gone)."""
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def in_use_message(folder: Path, holder: Holder) -> str:
    return (
        f"{folder} is in use by another process ({holder.describe()}); nothing was run. Wait for that "
        f"process to end (`bdl-bench status {folder}` shows it) or stop it; its lock is taken over once it is "
        f"gone (on another host: after {STALE_AFTER_S:.0f} s without a heartbeat)"
    )


def acquire(folder: Path) -> None:
    """Take ``folder``'s lock (re-entrant within this process); :class:`FolderInUse` when a live process holds it."""
    folder = Path(folder)
    path = (folder / LOCK_FILE).absolute()
    if path in _held():
        token, depth = _HELD[path]
        _HELD[path] = (token, depth + 1)
        return
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    for _ in range(20):
        if _create(path, token):
            _HELD[path] = (token, 1)
            _ensure_heartbeat()
            return
        holder = read_holder(folder)
        if holder is None:  # removed or being written between our create and read (or left unreadable)
            _break_stale(folder, None)
            time.sleep(0.05)
            continue
        if not holder.stale():
            raise FolderInUse(in_use_message(folder, holder), holder)
        _break_stale(folder, holder)
        time.sleep(0.05)
    raise FolderInUse(f"{folder}: could not take its lock ({path}); another process keeps replacing it", holder)  # type: ignore[possibly-undefined]


def release(folder: Path) -> None:
    """Give back ``folder``'s lock (the file is removed only if it still names this process)."""
    path = (Path(folder) / LOCK_FILE).absolute()
    if path not in _held():
        return
    token, depth = _HELD[path]
    if depth > 1:
        _HELD[path] = (token, depth - 1)
        return
    del _HELD[path]
    holder = read_holder(Path(folder))
    if holder is not None and holder.token == token:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def holding(folders: Sequence[Path]) -> Iterator[None]:
    """Hold the locks of ``folders`` (taken in order; all given back if one is in use) within the block; a
    failed write there (of a lock too: a full disk) is a one-line :class:`~.write_errors.WriteError`."""
    from bdl_bench.orchestration.write_errors import write_error

    taken: list[Path] = []
    try:
        for folder in folders:
            acquire(folder)
            taken.append(folder)
        yield
    except OSError as error:
        raise write_error(error) or error from None
    finally:
        for folder in reversed(taken):
            release(folder)


def _ensure_heartbeat() -> None:
    """Start (in this process) the daemon thread that touches every lock this process holds."""
    global _heartbeat
    if _heartbeat is None or not _heartbeat.is_alive():
        _heartbeat = threading.Thread(target=_beat, name="bdl-bench lock heartbeat", daemon=True)
        _heartbeat.start()


def _beat() -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        for path in list(_HELD):
            with contextlib.suppress(OSError):
                os.utime(path)


def lock_state(folder: Path) -> tuple[str, Holder | None]:
    """``("free", None)``, ``("held", holder)`` or ``("stale", holder)`` for ``folder``."""
    holder = read_holder(folder)
    if holder is None:
        return "free", None
    return ("stale" if holder.stale() else "held"), holder
