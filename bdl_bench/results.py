"""Run folders: atomic writes while a run is alive, and loading finished runs into a DataFrame.

A run folder holds ``config.yaml`` (the resolved config), ``history.csv`` (one row per epoch) and
``metrics.json``, written last: its presence means the run finished. Beside them: ``run.json`` (the latest
attempt), ``checkpoint.pt`` while a run is unfinished, ``params.pt`` once it has finished
(:func:`bdl_bench.checkpoint.save_params`), and ``failure.json``/``failure.txt`` when the latest attempt raised.

The *config hash* identifies what a run computes: a SHA-256 of the resolved config without the keys that only
say where or how verbosely it runs (:data:`HASH_EXCLUDED_KEYS`). A finished run is reused only by a job whose
config has the same hash."""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import math
import os
import secrets
import socket
import sys
import time
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from packaging.version import Version

from bdl_bench.errors import ResultsError

METRICS_FILE = "metrics.json"
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where PyYAML was built with it
CONFIG_FILE = "config.yaml"
HISTORY_FILE = "history.csv"
RUN_RECORD_FILE = "run.json"
CHECKPOINT_FILE = "checkpoint.pt"
PARAMS_FILE = "params.pt"
FAILURE_FILE = "failure.json"
FAILURE_TEXT_FILE = "failure.txt"

HASH_EXCLUDED_KEYS = (
    "force",
    "results_root",
    "experiment_name",
    "tuned_from",  # a key of earlier configs (the removed per-trial Optuna sweeper): their runs hash as before
    "trainer.device",
    "trainer.progress",
    "trainer.threads",
    "trainer.deterministic",  # the same numbers on the CPU; on a GPU, the same up to kernel non-determinism
    "trainer.checkpoint_every",
    "data.protocol.search",
    "data.protocol.gal_dropout",  # the inputs of tune=slang_table2's dropout protocol; what it sets is in the config
    "data.protocol.device",  # where it runs, like trainer.device
    "tolerance",  # how `reproduce` compares with the paper, not what a run computes
    "relative_to",  # likewise: the paper column `reproduce` shows the gaps to
    "figures",  # what `reproduce` draws from the runs
    "protocol",  # what `reproduce` says above the table about the protocol run
    "shared_map",  # which run's MAP `reproduce` hands the post-hoc columns (their method.map_dir is hashed)
    # how a tuned run's values were searched (bdl_bench.orchestration.search); the values it chose are in its config
    "search",
)
"""Config keys (and subtrees) that do not change what a run computes: left out of the config hash."""
OMITTED_WHEN_NULL = (
    "trainer.test_mc_prefixes",
    "trainer.n_val_mc_samples",
    "method.beta_decay",  # SLANG
    "method.lr_decay",  # BBB
    "data.standardise",  # toy/cubic
    "method.null_space",  # Laplace: null = prior
)
"""Keys added after runs were made, whose null default changes nothing those runs computed: left out of the hash
while null, so that the runs hash as before; set, they are hashed (such a run reports more)."""
HASHED_AS_NULL = ("data.root", "data.mirror")
"""Where the data files are cached and fetched from (SHA-256-checked, so the same data wherever they come from):
hashed as null whatever their value, so that a run's hash is the one it had before these were set or moved."""


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``: a reader sees
    the old file or the new one, never half of one. A failed write (a full disk: ``OSError`` with its
    ``errno``) removes the temporary file and leaves ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # named before it exists, so that a Ctrl-C at any moment after its creation still removes it; 0o666 less
    # the umask, as ``open`` gives (mkstemp's 0600 would hide results from the user's group)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        _name_the_file(error, path, tmp)
        raise


def _name_the_file(error: BaseException, path: Path, tmp: Path | None = None) -> None:
    """Give a failed write's ``OSError`` the file's name (a failed ``write`` or ``fsync`` has none; one on the
    temporary file ``tmp`` names ``path``, the file the user knows)."""
    if isinstance(error, OSError) and (not error.filename or error.filename == str(tmp)):
        error.filename = str(path)


def append_whole(path: Path, text: str, *, sync: bool = False) -> None:
    """Append ``text`` to ``path`` whole or not at all: a write that fails part way (a full disk) is cut
    back off, so the file never ends in half a line that the next append would run on from. ``sync``:
    ``fsync`` before returning."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            if sync:
                os.fsync(fd)
        except BaseException as error:
            os.ftruncate(fd, size)
            _name_the_file(error, path)
            raise
    finally:
        os.close(fd)


def read_csv_exact(path: Any) -> pd.DataFrame:
    """``pandas.read_csv`` of ``path`` (or an open file) with every float parsed to the value its text was written
    from: the default parser of pandas before 3.1 can miss by an ulp, which would change a searched value's config
    hash; pandas 3.1 parses exactly and deprecates the option."""
    exact = {"float_precision": "round_trip"} if Version(pd.__version__) < Version("3.1") else {}
    return pd.read_csv(path, **exact)


def write_metrics(run_dir: Path, metrics: Mapping[str, Any]) -> None:
    """``metrics.json``, NaN and infinite values written as null (JSON has neither)."""
    safe = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
    atomic_write_text(run_dir / METRICS_FILE, json.dumps(safe, indent=2))


def write_config(run_dir: Path, config: Mapping[str, Any]) -> None:
    atomic_write_text(run_dir / CONFIG_FILE, yaml.safe_dump(dict(config), sort_keys=False))


def _parse_csv_value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_history(path: Path, n_rows: int) -> list[dict[str, Any]]:
    """The first ``n_rows`` rows of a ``history.csv`` as written by :class:`HistoryWriter` (numbers parsed
    back exactly — ``csv`` writes floats with ``repr`` — and a row's empty cells left out, as it was appended)."""
    rows: list[dict[str, Any]] = []
    if n_rows > 0:
        with Path(path).open(newline="") as f:
            for raw in csv.DictReader(f):
                if len(rows) == n_rows:
                    break
                rows.append({k: _parse_csv_value(v) for k, v in raw.items() if v not in ("", None)})
    if len(rows) < n_rows:
        raise ValueError(
            f"{path} holds {len(rows)} rows but the run's checkpoint needs {n_rows}; "
            "the history was edited — delete checkpoint.pt (or re-run with force=true) to start over"
        )
    return rows


class HistoryWriter:
    """Appends one CSV row per epoch; columns are fixed by the first row and grow if needed.

    A row with the known columns is appended to the file (O(1) per epoch); a row that brings a new
    column rewrites the file atomically with the wider header, so the file is always valid CSV.
    ``rows`` restores the rows of a resumed run (:func:`read_history`); the file is rewritten with them at the
    first append, which drops any rows written after the checkpoint."""

    def __init__(self, path: Path, rows: Iterable[Mapping[str, Any]] = ()) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = [dict(r) for r in rows]
        self.columns: list[str] = []
        for r in self.rows:
            self.columns += [k for k in r if k not in self.columns]
        self._file_matches_rows = False  # the file on disk may be missing or stale until the first write

    def append(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))
        new_columns = [k for k in row if k not in self.columns]
        self.columns += new_columns
        if new_columns or not self._file_matches_rows:
            self._rewrite()
            return
        line = io.StringIO(newline="")
        csv.DictWriter(line, fieldnames=self.columns).writerow(row)
        append_whole(self.path, line.getvalue())  # Ctrl-C or a full disk leaves the whole row or none of it

    def _rewrite(self) -> None:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.path, text.getvalue())
        self._file_matches_rows = True


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"method": {"rank": 1}}`` → ``{"method.rank": 1}``; lists become strings."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, prefix=f"{name}."))
        elif isinstance(value, list | tuple):
            out[name] = str(list(value))
        else:
            out[name] = value
    return out


def find_run_dirs(root: Path) -> list[Path]:
    """Every folder below ``root`` (or ``root`` itself) holding a ``config.yaml``, except inside hidden
    folders (Hydra's ``.hydra/config.yaml`` copy, submitit's ``.submitit/``)."""
    root = Path(root)
    return sorted(
        p.parent
        for p in root.rglob(CONFIG_FILE)
        if not any(part.startswith(".") for part in p.parent.relative_to(root).parts)
    )


def config_hash(config: Mapping[str, Any]) -> str:
    """16 hex digits of SHA-256 over the flattened config, less :data:`HASH_EXCLUDED_KEYS` and the null ones of
    :data:`OMITTED_WHEN_NULL`, with :data:`HASHED_AS_NULL` as null."""
    flat = {
        k: None if k in HASHED_AS_NULL else v
        for k, v in flatten(config).items()
        if not any(k == x or k.startswith(f"{x}.") for x in HASH_EXCLUDED_KEYS)
        and not (v is None and k in OMITTED_WHEN_NULL)
    }
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_config(path: Path) -> dict[str, Any]:
    """The ``config.yaml`` at ``path`` as a dict (empty for an empty file), parsed with libyaml's safe loader where
    PyYAML has it: reading a results folder's thousands of run configs is most of ``bdl-bench table``'s work."""
    return yaml.load(Path(path).read_text(), Loader=_YAML_LOADER) or {}


def stored_config_hash(run_dir: Path) -> str | None:
    """The config hash of the ``config.yaml`` in ``run_dir``, or ``None`` when there is none."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        return None
    return config_hash(read_config(path))


@functools.cache
def package_digest() -> str:
    """SHA-256 of the package's Python source (every ``bdl_bench/**/*.py``, in path order): what a result kept for
    reuse must have been computed with, committed or not."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def code_version(repo: Path | None = None) -> str:
    """``<package version>+g<commit>`` when the package runs from a git checkout (``repo``, default the one
    holding this package; a linked worktree too), else the version."""
    from bdl_bench import __version__

    git = (repo or Path(__file__).resolve().parents[1]) / ".git"
    try:
        if git.is_file():  # a worktree or submodule: ".git" names the real folder
            git = (git.parent / git.read_text().strip().removeprefix("gitdir: ")).resolve()
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head.removeprefix("ref: ")
            # a linked worktree keeps its HEAD in its own folder and the branches in the common one
            common = (git / (git / "commondir").read_text().strip()).resolve() if (git / "commondir").exists() else git
            ref_path = common / ref
            if ref_path.exists():
                head = ref_path.read_text().strip()
            else:  # packed refs: "<sha> <ref>" lines
                lines = (common / "packed-refs").read_text().splitlines()
                head = next(line.split()[0] for line in lines if line.endswith(f" {ref}"))
        return f"{__version__}+g{head[:10]}"
    except (OSError, StopIteration, IndexError):
        return __version__


def read_run_record(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_RECORD_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def update_run_record(run_dir: Path, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into ``run.json`` (written atomically) and return the new record."""
    record = {**read_run_record(run_dir), **fields}
    atomic_write_text(Path(run_dir) / RUN_RECORD_FILE, json.dumps(record, indent=2, default=str))
    return record


def write_failure(run_dir: Path, error: BaseException, config: Mapping[str, Any], overrides: list[str]) -> None:
    """Record a failed attempt: ``failure.json`` (error, traceback, overrides, resolved config, where and
    when) and the plain traceback in ``failure.txt``."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    record = {
        "error_type": type(error).__name__,
        "message": str(error),
        "time": time.time(),
        "host": socket.gethostname(),
        "code_version": code_version(),
        "overrides": list(overrides),
        "traceback": text,
        "config": dict(config),
    }
    atomic_write_text(Path(run_dir) / FAILURE_FILE, json.dumps(record, indent=2, default=str))
    atomic_write_text(Path(run_dir) / FAILURE_TEXT_FILE, text)


def read_failure(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / FAILURE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def clear_attempt(run_dir: Path, *, finished: bool) -> None:
    """Remove the failure record of an earlier attempt; with ``finished``, also the metrics, the final
    parameters and the checkpoint (``force=true`` starts the run afresh)."""
    names = [FAILURE_FILE, FAILURE_TEXT_FILE]
    if finished:
        names += [METRICS_FILE, PARAMS_FILE, CHECKPOINT_FILE]
    for name in names:
        (Path(run_dir) / name).unlink(missing_ok=True)


COST_METRICS = ("train_time_s", "cpu_time_s", "peak_rss_mib")
"""What a run cost (runner.finish_run): the metrics two runs of the same config may differ in."""


def load_runs(root: Path, *, strict: bool = False) -> pd.DataFrame:
    """One row per finished run below ``root``: flattened config keys plus metrics and ``run_dir``. A run whose ``config.yaml`` or ``metrics.json`` cannot be
    read (cut short by a full disk or a killed copy) is left out with one warning line naming the file, or
    refused with ``strict``. ``frame.attrs["config_columns"]`` lists the config-key columns; ``config_nulls``
    names each run's keys that are null in its config (pandas would not tell them from keys the run lacks)."""
    rows = []
    config_columns: set[str] = set()
    for run_dir in find_run_dirs(Path(root)):
        if not (run_dir / METRICS_FILE).exists():
            continue
        try:
            config = _read_mapping(run_dir / CONFIG_FILE, lambda text: yaml.load(text, Loader=_YAML_LOADER))
            metrics = _read_mapping(run_dir / METRICS_FILE, json.loads)
        except _Unreadable as error:
            if strict:
                raise ResultsError(f"{error}; re-run that run or delete its folder") from None
            _warn_once(f"warning: skipped {error}; re-run that run to redo it")
            continue
        row = flatten(config)
        config_columns |= set(row)
        # keys set to null: pandas reads them as missing, like keys a run lacks, but null is a setting of its own
        row["config_nulls"] = tuple(sorted(k for k, v in row.items() if v is None))
        row.update(metrics)
        row["run_dir"] = str(run_dir)
        record = read_run_record(run_dir)
        row["code_version"] = record.get("code_version")
        row["device"] = record.get("device")  # cpu / cuda, from bdl_bench.orchestration.devices.device_record
        rows.append(row)
    frame = pd.DataFrame(rows)
    frame.attrs["config_columns"] = sorted(config_columns)
    return frame


class _Unreadable(Exception):
    """A run file that cannot be read or parsed (its message names it)."""


def _read_mapping(path: Path, parse: Any) -> dict[str, Any]:
    """The mapping in the JSON/YAML file ``path``."""
    try:
        value = parse(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as error:
        reason = " ".join(str(error).split())[:120]
        raise _Unreadable(f"{path}: unreadable or cut short ({type(error).__name__}: {reason})") from None
    if not isinstance(value, Mapping):
        raise _Unreadable(f"{path}: holds a {type(value).__name__}, not a mapping of keys to values")
    return dict(value)


_WARNED: set[str] = set()


def _warn_once(line: str) -> None:
    """Print ``line`` on stderr, once per process (a command may load the same folder twice)."""
    if line not in _WARNED:
        _WARNED.add(line)
        print(line, file=sys.stderr)
